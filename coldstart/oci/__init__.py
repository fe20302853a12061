"""OCI images: references, manifests/indexes/configs, image-layout directories, registry client.

Names are imported lazily, so ``import coldstart.oci.reference`` does not pull in httpx.

>>> from coldstart.oci import Reference, RegistryClient                # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coldstart.oci.auth import AuthError
    from coldstart.oci.layout import OciLayout, parse_layout_spec
    from coldstart.oci.manifest import Descriptor, ImageConfig, Index, Manifest, Platform
    from coldstart.oci.reference import Reference
    from coldstart.oci.registry import RegistryClient, Resolved

_WHERE = {
    "Reference": "coldstart.oci.reference",
    "Descriptor": "coldstart.oci.manifest",
    "ImageConfig": "coldstart.oci.manifest",
    "Index": "coldstart.oci.manifest",
    "Manifest": "coldstart.oci.manifest",
    "Platform": "coldstart.oci.manifest",
    "OciLayout": "coldstart.oci.layout",
    "parse_layout_spec": "coldstart.oci.layout",
    "AuthError": "coldstart.oci.auth",
    "RegistryClient": "coldstart.oci.registry",
    "Resolved": "coldstart.oci.registry",
}

__all__ = [
    "AuthError",
    "Descriptor",
    "ImageConfig",
    "Index",
    "Manifest",
    "OciLayout",
    "Platform",
    "Reference",
    "RegistryClient",
    "Resolved",
    "parse_layout_spec",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'coldstart.oci' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
