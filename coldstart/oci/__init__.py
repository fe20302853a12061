"""OCI images: references, manifests/indexes/configs, image-layout directories, registry client."""

from coldstart.oci.reference import Reference

__all__ = ["Reference"]
