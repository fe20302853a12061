"""SIGINT, SIGTERM and SIGHUP as Ctrl-C, for commands that start daemons and must stop them."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

__all__ = ["signals_unwind"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(_sig: int, _frame: FrameType | None) -> None:
    """Unwind (every daemon is stopped on the way out); a second signal must not cut the
    clean-up short, so they are ignored from here on."""
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextlib.contextmanager
def signals_unwind() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM/SIGHUP raise KeyboardInterrupt (once); the previous
    handlers come back at its end."""
    old = {sig: signal.signal(sig, _interrupt) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
