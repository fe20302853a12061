"""Snapshot restore: a ready container's memory, shipped like its image.

``coldstart snapshot create`` checkpoints a container that containerd runs (CRIU through
runc) and pushes the checkpoint as an OCI artifact of its image, chunked and compressed with a
digest per chunk; ``coldstart-runc`` (containerd's runc ``BinaryName``) restores a container
that asks for it (annotation ``dev.coldstart.snapshot``) from the snapshot matching it and the
node, and starts it normally when there is none or anything fails.

For an app, after a restore::

    from coldstart import snapshot

    @snapshot.after_restore
    def reconnect() -> None:        # runs once after each restore, in the main thread
        random.seed(); db.reconnect()

What a snapshot holds: the memory of every process of the container (heap, stacks, anonymous
tensors; secrets read before the checkpoint too), its open files' positions and its rootfs
changes. Memory mapped from the image's files (safetensors weights through mmap) is not in
it: it comes back through the lazily pulled image. Load tokens in an after-restore hook,
not before the checkpoint.
"""

from __future__ import annotations

import signal as _signal
import threading
from collections.abc import Callable

from coldstart.snapshot.signals import DEFAULT as DEFAULT_SIGNAL
from coldstart.snapshot.signals import signal_number

__all__ = ["after_restore", "restores"]

_hooks: list[Callable[[], object]] = []
_count = 0
_lock = threading.Lock()


def _signum(name: str) -> int:
    num = signal_number(name)
    if num is None:
        raise ValueError("no after-restore signal")
    return num


def _handler(signum: int, frame: object) -> None:
    global _count
    with _lock:
        _count += 1
        hooks = list(_hooks)
    for fn in hooks:
        fn()


def after_restore(fn: Callable[[], object] | None = None, *,
                  signal: str = DEFAULT_SIGNAL) -> Callable[..., object]:
    """Run ``fn`` after each restore of this process from a snapshot (usable as a
    decorator). The runc wrapper sends ``signal`` to restored processes that handle it;
    the handler installed here calls every registered hook, in the order registered, in the
    main thread. Call it from the main thread, before the snapshot is taken."""
    def register(f: Callable[[], object]) -> Callable[[], object]:
        with _lock:
            _hooks.append(f)
        _signal.signal(_signum(signal), _handler)
        return f

    return register(fn) if fn is not None else register


def restores() -> int:
    """How many times this process was restored (hooks run)."""
    return _count
