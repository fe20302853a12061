"""Warm-up caches: what an app's start-up compiled, shipped as an OCI artifact of its image.

For an app that wants it in Python (the unmodified-app path is ``coldstart warmup run``)::

    from coldstart import warmup
    restored = warmup.load("registry.example/app:v3")   # before the first compiled call
    model = torch.compile(model); model(x)
    print(warmup.counters())        # Inductor's own hit and miss counters, this process
    warmup.save("registry.example/app:v3")              # once, after a start that compiled

Both take the registry options of :class:`coldstart.oci.registry.RegistryClient` as keywords.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coldstart.warmup.runner import Captured, Restored

__all__ = ["counters", "load", "save"]


def load(image: str, *, model_version: str | None = None, chunk_cache: str | None = None,
         **client_options: Any) -> Restored:
    """Restore ``image``'s warm-up artifact for this process's key into the cache directories
    its environment names; a miss or refusal comes back with its reason (never raised)."""
    from coldstart.oci.registry import RegistryClient
    from coldstart.warmup.keys import compute_key
    from coldstart.warmup.runner import restore

    with RegistryClient(**client_options) as client:
        return restore(client, image, key=compute_key(model_version), chunk_cache=chunk_cache)


def save(image: str, *, model_version: str | None = None, compiles: int = 0,
         **client_options: Any) -> Captured:
    """Push this process's compile caches as ``image``'s warm-up artifact for its key."""
    from coldstart.oci.registry import RegistryClient
    from coldstart.warmup.keys import compute_key
    from coldstart.warmup.runner import capture

    with RegistryClient(**client_options) as client:
        return capture(client, image, key=compute_key(model_version), compiles=compiles)


def counters() -> dict[str, int]:
    """Inductor's and AOTAutograd's cache counters in this process (``fxgraph_cache_hit``,
    ``fxgraph_cache_miss``, ``autograd_cache_hit``, ``autograd_cache_miss``); {} before torch
    compiled anything."""
    import sys

    if "torch" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters as c

    out: dict[str, int] = {}
    for group, names in (("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss")),
                         ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss"))):
        for name in names:
            out[name] = int(c[group].get(name, 0))
    return out
