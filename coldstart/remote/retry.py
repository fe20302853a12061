"""The one retry policy of coldstart's network code: deadlines, jittered backoff, a total budget.

A call has one :class:`Deadline` (its whole budget, retries included). :func:`retry` runs an
attempt, and when the attempt fails in a way the caller calls transient, sleeps a jittered
exponential pause (:class:`Backoff`) and tries again, while attempts and budget last; a pause that
would end past the deadline is not taken (the last error is raised instead). Each attempt gets
its own deadline: ``per_attempt`` seconds from its start, never past the call's. :func:`until`
cuts a body off at a deadline: per-read socket timeouts alone never stop a server that dribbles
one byte at a time.

Written here rather than taken from ``tenacity`` (not a dependency; its stop/wait algebra is more
than these loops use, and it knows nothing of a per-attempt deadline) or httpx's transport
retries (they retry connection set-up only, never a 5xx, a ``Retry-After`` or a broken body).

>>> d = Deadline(5.0, "read blob")
>>> retry(lambda attempt_deadline: 42, what="read blob", deadline=d)
42
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from coldstart.errors import DeadlineExceeded, Unavailable

__all__ = ["Again", "Backoff", "Deadline", "only_again", "retry", "transient", "until"]

log = logging.getLogger("coldstart.remote")
T = TypeVar("T")


class Deadline:
    """A monotonic end time for one call: ``Deadline(seconds, what)``.

    ``clock`` (``time.monotonic``) is where "now" comes from; a test passes a fake clock's to
    drive time instead of sleeping.
    """

    def __init__(self, seconds: float, what: str, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.end = clock() + seconds
        self.seconds = seconds
        self.what = what

    def remaining(self) -> float:
        """Seconds left (negative once passed)."""
        return self.end - self.clock()

    def check(self) -> float:
        """Seconds left; :class:`DeadlineExceeded` once none are."""
        left = self.remaining()
        if left <= 0:
            raise DeadlineExceeded(f"{self.what}: no answer within {self.seconds:g} s")
        return left

    def sooner(self, seconds: float | None) -> float:
        """The monotonic time ``seconds`` from now, or this deadline's end if that is sooner."""
        if seconds is None:
            return self.end
        return min(self.clock() + seconds, self.end)


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: the pause before retry ``n`` (0-based) is uniform in
    ``[0, min(cap, base * 2**n)]``, at least ``floor`` (a server's ``Retry-After``).

    ``wait`` (``time.sleep``) takes a pause; a test passes a fake clock's, with the same clock
    in the :class:`Deadline`."""

    base: float = 0.1
    cap: float = 2.0
    wait: Callable[[float], None] = field(default=time.sleep, repr=False, compare=False)

    def delay(self, attempt: int, floor: float = 0.0) -> float:
        return max(floor, random.uniform(0, min(self.cap, self.base * 2 ** attempt)))

    def sleep(self, attempt: int, deadline: Deadline, floor: float = 0.0) -> bool:
        """Sleep before retry ``attempt``; False (without sleeping) if the deadline would pass
        first."""
        pause = self.delay(attempt, floor)
        if deadline.remaining() <= pause:
            return False
        self.wait(pause)
        return True


class Again(Exception):
    """Raised by an attempt: worth another try; ``error`` is what to raise when none is left.

    ``retry_after``: the pause before the next try is at least this (a server's
    ``Retry-After``). ``out_of_time``: raised instead of ``error`` when the call's budget, not
    its count of attempts, ran out.
    """

    def __init__(self, error: Unavailable, *, retry_after: float = 0.0,
                 out_of_time: Unavailable | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after = retry_after
        self.out_of_time = out_of_time


def transient(exc: BaseException) -> Again | None:
    """The default classification: :class:`Again` as raised, and any :class:`Unavailable` (a
    :class:`DeadlineExceeded` of one attempt too) is retried; anything else (NotFound,
    FormatError, ...) is not."""
    if isinstance(exc, Again):
        return exc
    return Again(exc) if isinstance(exc, Unavailable) else None


def only_again(exc: BaseException) -> Again | None:
    """Retry only what the attempt marked with :class:`Again` (its other errors are final)."""
    return exc if isinstance(exc, Again) else None


def retry(attempt: Callable[[float], T], *, what: str, deadline: Deadline, retries: int = 3,
          backoff: Backoff = Backoff(), per_attempt: float | None = None,
          classify: Callable[[BaseException], Again | None] = transient) -> T:
    """``attempt(attempt_deadline)`` until it returns, at most ``retries`` times more.

    ``classify(exc)`` says whether a failure is worth another attempt (an :class:`Again`) or
    final (None: ``exc`` is raised as it is). When no attempt or no budget is left, the
    :class:`Again`'s error is raised, from its own cause if it has one. ``attempt_deadline`` is
    a monotonic time (``per_attempt`` seconds from the attempt's start, never past
    ``deadline``). A retry repeats the whole attempt: attempts must be idempotent.
    """
    n = 0
    while True:
        try:
            return attempt(deadline.sooner(per_attempt))
        except Exception as exc:
            again = classify(exc)
            if again is None:
                raise
            final = again.error
            if n < retries:
                if backoff.sleep(n, deadline, again.retry_after):
                    log.info("%s: %s; retrying (attempt %d)", what, again.error, n + 2)
                    n += 1
                    continue
                final = again.out_of_time or again.error
            if final is exc:
                raise
            cause = final.__cause__ or (exc.__cause__ if isinstance(exc, Again) else exc)
            raise final from cause


def until(deadline: float, what: str, chunks: Iterator[bytes], *,
          clock: Callable[[], float] = time.monotonic) -> Iterator[bytes]:
    """``chunks``, cut off with :class:`DeadlineExceeded` once the monotonic ``deadline``
    passes (checked between reads; ``clock`` says when "now" is)."""
    while True:
        if clock() >= deadline:
            raise DeadlineExceeded(f"{what}: not received within its deadline (the server "
                                   "is sending too slowly)")
        chunk = next(chunks, None)
        if chunk is None:
            return
        yield chunk
