"""The one retry helper (coldstart.remote.retry): attempts, total budget, backoff, deadlines.

No server needed; it sits beside the source suite it serves. Where time matters it is a
:class:`FakeClock`'s: pauses advance it, nothing sleeps, and no result depends on how fast the
machine is.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coldstart.errors import DeadlineExceeded, NotFound, Unavailable
from coldstart.remote.retry import Again, Backoff, Deadline, only_again, retry, until

FAST = Backoff(base=0.001, cap=0.002)


class FakeClock:
    """A monotonic clock that moves only when told: ``sleep`` (Backoff's ``wait``) and
    ``advance`` move it and record the pauses."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds


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
    clock = FakeClock()
    starts: list[float] = []

    def attempt(_: float) -> None:
        starts.append(clock.now)
        raise Again(Unavailable("busy"), retry_after=0.3,
                    out_of_time=DeadlineExceeded("budget spent"))

    with pytest.raises(DeadlineExceeded, match="budget spent"):
        retry(attempt, what="x", deadline=Deadline(0.5, "x", clock=clock), retries=10,
              backoff=Backoff(base=0.001, cap=0.002, wait=clock.sleep))
    # one Retry-After pause fitted in the 0.5 s budget, the next (0.2 s left) would not: two
    # attempts of the ten allowed, and no pause taken that the budget could not hold
    assert starts == [0.0, 0.3]
    assert clock.pauses == [0.3]


def test_each_attempt_gets_its_own_deadline_within_the_budget() -> None:
    clock = FakeClock()
    seen: list[float] = []

    def attempt(deadline: float) -> None:
        seen.append(deadline - clock.now)
        clock.advance(0.2)  # each attempt uses all of its own time
        raise Unavailable("again")

    with pytest.raises(Unavailable):
        retry(attempt, what="x", deadline=Deadline(0.5, "x", clock=clock), retries=5,
              backoff=Backoff(base=0.001, cap=0.002, wait=clock.sleep), per_attempt=0.2)
    # per_attempt seconds each, until what is left of the call's budget is less than that
    assert len(seen) == 3
    assert seen[:2] == pytest.approx([0.2, 0.2])
    assert 0 < seen[2] < 0.1 + 1e-9
    assert sum(clock.pauses) + 0.2 * 2 + seen[2] == pytest.approx(0.5)


def test_backoff_is_jittered_exponential_and_capped() -> None:
    b = Backoff(base=0.1, cap=0.4)
    for attempt, top in [(0, 0.1), (1, 0.2), (2, 0.4), (6, 0.4)]:
        delays = [b.delay(attempt) for _ in range(200)]
        assert all(0 <= d <= top for d in delays) and len(set(delays)) > 1
    assert b.delay(0, floor=0.5) == 0.5
    assert not b.sleep(0, Deadline(0.0, "x"))  # no pause past the deadline


def test_until_cuts_off_a_dribbling_body() -> None:
    clock = FakeClock()
    pulled = [0]

    def dribble() -> Iterator[bytes]:
        for _ in range(40):  # 5 s of body: it would end, slowly, if nothing cut it off
            clock.advance(0.125)  # each byte takes 1/8 s to arrive
            pulled[0] += 1
            yield b"x"

    got: list[bytes] = []
    with pytest.raises(DeadlineExceeded, match="too slowly"):
        for chunk in until(1.0, "body", dribble(), clock=clock):
            got.append(chunk)
    # the bytes that arrived before the deadline, and no read started after it
    assert got == [b"x"] * 8 and pulled[0] == 8 and clock.now == 1.0
    assert b"".join(until(5.0, "body", iter([b"a", b"b"]), clock=clock)) == b"ab"
