"""The state machine, driven by observations and an explicit clock (no sleeping)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coldstart.errors import InvalidArgument
from coldstart.probe.states import CheckResult, Notice, State, StateMachine, Thresholds

OK = CheckResult(ok=True, latency=0.001)
BAD = CheckResult(ok=False, latency=0.001, detail="HTTP 503")
SLOW = CheckResult(ok=True, latency=2.0)


def machine(**kw: float) -> StateMachine:
    t = Thresholds(**{"failures": 3, "successes": 2, "slow": 0.25, "startup_timeout": 10.0,
                      **kw})  # type: ignore[arg-type]
    return StateMachine(t, started=0.0)


def test_first_success_while_starting_is_ready_at_once() -> None:
    m = machine()
    assert m.on_check(BAD, 0.01) is None
    assert m.state is State.STARTING
    new = m.on_check(OK, 0.02)
    assert new is not None and new.state is State.READY and new.since == 0.02


def test_reported_progress_means_loading_and_is_clamped() -> None:
    m = machine()
    s = m.on_check(CheckResult(False, phase="weights", progress=0.42), 0.1)
    assert s is not None and (s.state, s.phase, s.progress) == (State.LOADING, "weights", 0.42)
    s = m.on_check(CheckResult(False, phase="weights", progress=7.0), 0.2)
    assert s is not None and s.progress == 1.0
    assert m.on_check(CheckResult(False, phase="weights", progress=1.0), 0.3) is None
    ready = m.on_check(OK, 0.4)
    assert ready is not None and ready.state is State.READY and ready.progress is None


def test_degraded_needs_consecutive_failures_and_recovery_needs_consecutive_successes() -> None:
    m = machine()
    m.on_check(OK, 0.0)
    # failures interrupted by a success do not add up
    for r in (BAD, BAD, OK, BAD, BAD):
        assert m.on_check(r, 1.0) is None
    degraded = m.on_check(BAD, 1.1)
    assert degraded is not None and degraded.state is State.DEGRADED
    assert degraded.detail == "HTTP 503"
    assert m.on_check(OK, 1.2) is None          # one success is not enough
    assert m.on_check(BAD, 1.3) is None         # and a failure resets the count
    assert m.on_check(OK, 1.4) is None
    back = m.on_check(OK, 1.5)
    assert back is not None and back.state is State.READY and back.since == 1.5


def test_slow_answers_count_as_failures_once_ready() -> None:
    m = machine()
    m.on_check(SLOW, 0.0)  # while starting, any success is READY
    assert m.state is State.READY
    m.on_check(SLOW, 0.1)
    m.on_check(SLOW, 0.2)
    s = m.on_check(SLOW, 0.3)
    assert s is not None and s.state is State.DEGRADED and "slow" in s.detail


def test_startup_timeout_fails_and_failed_is_final() -> None:
    m = machine(startup_timeout=5.0)
    assert m.on_tick(4.9) is None
    s = m.on_check(BAD, 5.1)
    assert s is not None and s.state is State.FAILED
    assert m.on_check(OK, 6.0) is None and m.on_notice(Notice(ready=True), 6.0) is None
    assert m.state is State.FAILED


def test_failed_says_why_and_recover_lets_a_late_start_be_ready() -> None:
    m = machine(startup_timeout=5.0)
    m.on_check(BAD, 1.0)
    s = m.on_check(CheckResult(False, detail="ConnectionRefusedError: nope"), 5.1)
    assert s is not None and s.state is State.FAILED and m.timed_out and m.final
    assert s.detail == "not ready after 5 s (last try: ConnectionRefusedError: nope)"
    late = StateMachine(Thresholds(startup_timeout=5.0), started=0.0, recover=True)
    failed = late.on_tick(5.1)
    assert failed is not None and failed.state is State.FAILED and not late.final
    assert late.on_check(BAD, 6.0) is None and late.on_notice(Notice(status="x"), 6.0) is None
    ready = late.on_check(OK, 7.0)
    assert ready is not None and ready.state is State.READY
    crashed = StateMachine(Thresholds(), started=0.0, recover=True)
    crashed.on_exit(3, 1.0)  # an app that exited is FAILED for good, recover or not
    assert crashed.final and crashed.on_check(OK, 2.0) is None


def test_ready_never_times_out() -> None:
    m = machine(startup_timeout=1.0)
    m.on_check(OK, 0.5)
    assert m.on_tick(100.0) is None


def test_notify_applies_at_once() -> None:
    m = machine()
    s = m.on_notice(Notice(status="loading weights", progress=0.3), 0.1)
    assert s is not None and s.state is State.LOADING and s.detail == "loading weights"
    s = m.on_notice(Notice(ready=True), 0.2)
    assert s is not None and s.state is State.READY
    s = m.on_notice(Notice(reloading=True), 0.3)
    assert s is not None and s.state is State.DEGRADED
    s = m.on_notice(Notice(ready=True), 0.4)
    assert s is not None and s.state is State.READY
    s = m.on_notice(Notice(stopping=True), 0.5)
    assert s is not None and s.state is State.DRAINING
    assert m.on_notice(Notice(ready=True), 0.6) is None  # draining is not undone


def test_drain_then_exit_is_stopped_but_exit_without_drain_is_failed() -> None:
    m = machine()
    m.on_check(OK, 0.0)
    d = m.on_drain(1.0)
    assert d is not None and d.state is State.DRAINING
    assert m.on_check(BAD, 1.1) is None and m.on_drain(1.2) is None
    s = m.on_exit(0, 2.0)
    assert s is not None and s.state is State.STOPPED
    crash = machine()
    crash.on_check(OK, 0.0)
    s = crash.on_exit(-11, 1.0)
    assert s is not None and s.state is State.FAILED and "-11" in s.detail


@pytest.mark.parametrize("kw", [{"failures": 0}, {"successes": 0}, {"slow": 0.0},
                                {"startup_timeout": -1.0}])
def test_bad_thresholds_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        Thresholds(**kw)  # type: ignore[arg-type]


def test_status_document() -> None:
    m = machine()
    s = m.on_check(CheckResult(False, phase="load", progress=0.5, detail="HTTP 503"), 1.0)
    assert s is not None
    doc = s.to_json("10.0.0.5:8000", "llama")
    assert doc["state"] == "LOADING" and doc["progress"] == 0.5 and doc["phase"] == "load"
    assert doc["target"] == "10.0.0.5:8000" and doc["service"] == "llama"


@given(st.lists(st.booleans(), max_size=200), st.integers(1, 5), st.integers(1, 5))
def test_hysteresis_holds_for_any_sequence(results: list[bool], failures: int,
                                           successes: int) -> None:
    """READY→DEGRADED only after `failures` bad tries in a row since the last change, and
    DEGRADED→READY only after `successes` good ones; never a change otherwise."""
    m = StateMachine(Thresholds(failures=failures, successes=successes), started=0.0)
    m.on_check(OK, 0.0)
    run_bad = run_good = 0
    for i, ok in enumerate(results):
        before = m.state
        run_bad, run_good = (0, run_good + 1) if ok else (run_bad + 1, 0)
        changed = m.on_check(OK if ok else BAD, float(i)) is not None
        if before is State.READY:
            assert changed == (not ok and run_bad == failures)
        else:
            assert changed == (ok and run_good == successes)
        if changed:
            run_bad = run_good = 0
        assert m.state in (State.READY, State.DEGRADED)
