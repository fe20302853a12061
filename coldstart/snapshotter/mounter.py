"""The three methods the snapshotter needs from the filesystem side (CONVENTIONS §3).

The snapshotter never builds a FUSE filesystem: it hands a :class:`LayerMounter` a mountpoint and
a :class:`~coldstart.lazyfs.spec.LayerSpec`. The implementation in production is
``coldstart.lazyfs.client.FuseServerClient``, which asks the long-lived FUSE server
process; it is chosen in one place, :mod:`coldstart.snapshotter.daemon`.

Example::

    mounter.mount("/var/lib/coldstart/snapshots/7/fs", spec)   # raises ColdstartError
    mounter.check("/var/lib/coldstart/snapshots/7/fs")
    mounter.unmount("/var/lib/coldstart/snapshots/7/fs")
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from coldstart.lazyfs.spec import LayerSpec

__all__ = ["LayerMounter"]


@runtime_checkable
class LayerMounter(Protocol):
    def mount(self, mountpoint: str, spec: LayerSpec) -> None:
        """Mount the layer read-only on ``mountpoint`` (an empty directory); raise
        :class:`~coldstart.errors.ColdstartError` when it cannot be served lazily."""

    def check(self, mountpoint: str) -> None:
        """Raise :class:`~coldstart.errors.ColdstartError` unless the layer is served."""

    def unmount(self, mountpoint: str) -> None:
        """Unmount the layer and forget it (no error when it is not mounted)."""
