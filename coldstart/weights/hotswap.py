"""Serve the active version of a model and hot-swap to a newly activated one.

:class:`ModelWatcher` polls ``active.yaml``. When it names another version, the watcher checks
the version (complete, every file there with its size), loads it **beside** the serving one,
runs the caller's validation, and only then swaps, atomically: a reader calling :meth:`current`
gets the old ``Served`` or the new one, never a mix. If anything fails, the old version keeps
serving, the error is kept in :attr:`last_error`, and that version is not retried until
``active.yaml`` changes again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from coldstart.errors import ColdstartError, DeadlineExceeded, InvalidArgument
from coldstart.weights.repository import ModelRepository

__all__ = ["ModelWatcher", "Served"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Served(Generic[T]):
    """A loaded version: what it is, and the object built from it."""

    version: str
    value: T


def _default_loader(location: str) -> Any:
    from coldstart.weights.loader import load

    return load(location)


class ModelWatcher(Generic[T]):
    """Keep the active version of ``model`` loaded; swap when ``active.yaml`` changes.

    ``loader(location)`` builds the served object from a version folder (default:
    :func:`coldstart.weights.load` into CPU tensors); ``validate(value)`` may raise to refuse a
    version; ``on_swap(old, new)`` is called after each swap.

    >>> watcher = ModelWatcher(ModelRepository("s3://models/repo"), "llama",
    ...                        poll_interval=2.0)  # doctest: +SKIP
    >>> watcher.start(); tensors = watcher.current().value  # doctest: +SKIP
    """

    def __init__(self, repo: ModelRepository, model: str, *,
                 loader: Callable[[str], T] = _default_loader,
                 validate: Callable[[T], None] | None = None,
                 on_swap: Callable[[Served[T] | None, Served[T]], None] | None = None,
                 poll_interval: float = 5.0) -> None:
        if poll_interval <= 0:
            raise InvalidArgument("poll_interval must be > 0 seconds")
        self.repo = repo
        self.model = model
        self.poll_interval = poll_interval
        self._loader = loader
        self._validate = validate
        self._on_swap = on_swap
        self._current: Served[T] | None = None
        self._failed: str | None = None
        self.last_error: BaseException | None = None
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> Served[T] | None:
        """The version being served (None before the first successful load)."""
        return self._current

    def poll_once(self) -> bool:
        """Look at ``active.yaml`` once; load, validate and swap if it changed. True if swapped.

        Errors with the new version are kept in :attr:`last_error`; the old version stays.
        """
        try:
            wanted = self.repo.active_version(self.model)
        except ColdstartError as exc:
            self._record(exc, None)
            return False
        current = self._current
        if current is not None and current.version == wanted:
            self._failed = None  # the pointer came back: a refused version may be tried again
            return False
        if wanted is None:
            return False
        if wanted == self._failed:
            return False  # already refused; wait for the pointer to move again
        try:
            self.repo.verify(self.model, wanted)
            value = self._loader(self.repo.location(self.model, wanted))
            if self._validate is not None:
                self._validate(value)
        except Exception as exc:  # any failure of a new version must leave the old one serving
            self._record(exc, wanted)
            return False
        new = Served(wanted, value)
        with self._changed:
            old, self._current = self._current, new
            self._failed = None
            self.last_error = None
            self._changed.notify_all()
        log.info("model %s: now serving version %s (was %s)", self.model, wanted,
                 old.version if old else None)
        if self._on_swap is not None:
            self._on_swap(old, new)
        return True

    def _record(self, exc: BaseException, version: str | None) -> None:
        with self._changed:
            self.last_error = exc
            if version is not None:
                self._failed = version
            self._changed.notify_all()
        log.warning("model %s: version %s refused, still serving %s: %s", self.model, version,
                    self._current.version if self._current else None, exc)

    def wait_for(self, version: str, timeout: float) -> Served[T]:
        """Block until ``version`` serves; :class:`DeadlineExceeded` after ``timeout`` seconds."""
        with self._changed:
            ok = self._changed.wait_for(
                lambda: (self._current is not None and self._current.version == version)
                or self._failed == version, timeout)
            current = self._current
            if ok and current is not None and current.version == version:
                return current
        if self._failed == version:
            raise DeadlineExceeded(f"{self.model}/{version} was refused: {self.last_error}")
        raise DeadlineExceeded(f"{self.model}/{version} not serving after {timeout} s")

    def start(self) -> None:
        """Load the active version now, then poll in a background thread."""
        if self._thread is not None:
            return
        self.poll_once()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"watch-{self.model}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_interval):
            self.poll_once()

    def stop(self) -> None:
        """Stop polling (the served version stays available)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> ModelWatcher[T]:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
