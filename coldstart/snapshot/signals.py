"""The after-restore signal: how coldstart-runc tells a restored process it was restored."""

from __future__ import annotations

import signal

__all__ = ["DEFAULT", "signal_number"]

#: coldstart-runc's default (``snapshot.signal``): a real-time signal no runtime or framework
#: claims (glibc keeps the first two for itself, Python's SIGRTMIN is past them)
DEFAULT = "SIGRTMIN+6"


def signal_number(name: str) -> int | None:
    """``SIGUSR2``, ``SIGRTMIN+6``, ``40`` → the signal number; ``""`` → None."""
    name = name.strip().upper()
    if not name:
        return None
    if name.isdigit():
        return int(name)
    base, plus, off = name.partition("+")
    base = base if base.startswith("SIG") else "SIG" + base
    num = int(getattr(signal, base))
    return num + int(off) if plus else num
