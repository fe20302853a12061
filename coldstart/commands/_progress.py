"""Progress on stderr for long commands: a rich bar by bytes per phase on a terminal, nothing
when stderr is not a terminal or with ``-q``; messages go above the bar (or as plain lines)."""

from __future__ import annotations

import sys
import threading
from typing import Any

__all__ = ["Progress"]


class Progress:
    """Implements :class:`coldstart.progress.ByteProgress` and says messages.

    >>> with Progress(["download", "convert"], quiet=False) as p:   # doctest: +SKIP
    ...     p.expect(100); p.advance("download", 50); p.say("layer 1 done")
    """

    def __init__(self, phases: list[str], *, quiet: bool = False,
                 messages: bool = True) -> None:
        self.phases = phases
        self.quiet = quiet
        self.messages = messages and not quiet
        self._lock = threading.Lock()
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}
        self._total = 0

    @property
    def drawing(self) -> bool:
        """Whether a bar is shown (stderr is a terminal and not quiet)."""
        return self._bar is not None

    def __enter__(self) -> Progress:
        if self.quiet or not sys.stderr.isatty():
            return self
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        from rich.progress import Progress as RichProgress

        console = Console(stderr=True, soft_wrap=True)
        self._bar = RichProgress(TextColumn("{task.description:<9}"), BarColumn(),
                                 DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                                 console=console, transient=True, redirect_stdout=False)
        self._bar.start()
        self._tasks = {p: self._bar.add_task(p, total=None) for p in self.phases}
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def expect(self, n: int) -> None:
        with self._lock:
            self._total += n
            bar = self._bar
            if bar is not None:
                for task in self._tasks.values():
                    bar.update(task, total=self._total)

    def advance(self, phase: str, n: int) -> None:
        bar = self._bar
        if bar is not None and phase in self._tasks:
            bar.advance(self._tasks[phase], n)

    def say(self, text: str) -> None:
        """A message above the bar (a plain stderr line when no bar is drawn)."""
        if not self.messages:
            return
        bar = self._bar
        if bar is not None:
            bar.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=sys.stderr, flush=True)
