"""A container's process tree, as /proc shows it."""

from __future__ import annotations

import contextlib
import os
import signal

__all__ = ["descendants", "kill_tree"]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants, the youngest first."""
    for p in reversed(descendants(pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
