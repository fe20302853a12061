"""The one retry helper (coldstart.remote.retry): attempts, total budget, backoff, deadlines.

No server needed; it sits beside the source suite it serves.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from coldstart.errors import DeadlineExceeded, NotFound, Unavailable
from coldstart.remote.retry import Again, Backoff, Deadline, only_again, retry, until

FAST = Backoff(base=0.001, cap=0.002)


def test_retries_transient_failures_until_success() -> None:
    calls: list[float] = []

    def attempt(deadline: float) -> str:
        calls.append(deadline)
        if len(calls) < 3:
            raise Unavailable("flaky")
        return "ok"

    assert retry(attempt, what="x", deadline=Deadline(5, "x"), backoff=FAST) == "ok"
    assert len(calls) == 3


def test_gives_up_after_the_attempts_and_raises_the_last_error() -> None:
    n = [0]

    def attempt(_: float) -> None:
        n[0] += 1
        raise Unavailable(f"down {n[0]}")

    with pytest.raises(Unavailable, match="down 3"):
        retry(attempt, what="x", deadline=Deadline(5, "x"), retries=2, backoff=FAST)


def test_final_errors_are_not_retried() -> None:
    n = [0]

    def attempt(_: float) -> None:
        n[0] += 1
        raise NotFound("gone")

    with pytest.raises(NotFound):
        retry(attempt, what="x", deadline=Deadline(5, "x"), backoff=FAST)
    assert n[0] == 1
    with pytest.raises(Unavailable):  # only_again: an unmarked Unavailable is final too
        retry(lambda _: (_ for _ in ()).throw(Unavailable("x")), what="x",
              deadline=Deadline(5, "x"), classify=only_again)


def test_the_budget_bounds_all_attempts_and_out_of_time_is_raised() -> None:
    def attempt(_: float) -> None:
        raise Again(Unavailable("busy"), retry_after=0.3,
                    out_of_time=DeadlineExceeded("budget spent"))

    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="budget spent"):
        retry(attempt, what="x", deadline=Deadline(0.5, "x"), retries=10, backoff=FAST)
    took = time.monotonic() - started
    assert 0.25 < took < 0.6  # one Retry-After pause fitted, the next would not


def test_each_attempt_gets_its_own_deadline_within_the_budget() -> None:
    seen: list[float] = []

    def attempt(deadline: float) -> None:
        seen.append(deadline - time.monotonic())
        raise Unavailable("again")

    with pytest.raises(Unavailable):
        retry(attempt, what="x", deadline=Deadline(10, "x"), retries=1, backoff=FAST,
              per_attempt=0.2)
    assert all(0 < left <= 0.2 for left in seen)


def test_backoff_is_jittered_exponential_and_capped() -> None:
    b = Backoff(base=0.1, cap=0.4)
    for attempt, top in [(0, 0.1), (1, 0.2), (2, 0.4), (6, 0.4)]:
        delays = [b.delay(attempt) for _ in range(200)]
        assert all(0 <= d <= top for d in delays) and len(set(delays)) > 1
    assert b.delay(0, floor=0.5) == 0.5
    assert not b.sleep(0, Deadline(0.0, "x"))  # no pause past the deadline


def test_until_cuts_off_a_dribbling_body() -> None:
    def dribble() -> Iterator[bytes]:
        while True:
            time.sleep(0.05)
            yield b"x"

    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="too slowly"):
        for _ in until(time.monotonic() + 0.3, "body", dribble()):
            pass
    assert time.monotonic() - started < 1.0
    assert b"".join(until(time.monotonic() + 5, "body", iter([b"a", b"b"]))) == b"ab"
