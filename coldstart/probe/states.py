"""Readiness states of one target and the pure state machine that moves between them.

::

    STARTING ─► LOADING ─► READY ⇄ DEGRADED
        │          │         │        │
        └──────────┴─► FAILED (start-up timeout, crash)
                         └─► READY (``recover``: a start-up that timed out comes up late)
    any live state ─► DRAINING (SIGTERM, STOPPING=1) ─► STOPPED

The machine takes observations (a check's result, an sd_notify message, the app's exit, a drain
request, the clock) and returns the state change they cause, if any. It does no I/O and never
reads the clock itself, so every transition is tested without sleeping.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from coldstart.config import ProbeTimingConfig
from coldstart.errors import InvalidArgument

__all__ = [
    "CheckResult",
    "Notice",
    "State",
    "StateMachine",
    "Status",
    "Thresholds",
]

_T = ProbeTimingConfig()  # the defaults, written once in coldstart.config


class State(enum.StrEnum):
    STARTING = "STARTING"
    LOADING = "LOADING"
    READY = "READY"
    DEGRADED = "DEGRADED"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        return self in (State.STOPPED, State.FAILED)

    @property
    def starting_up(self) -> bool:
        return self in (State.STARTING, State.LOADING)


@dataclass(frozen=True)
class CheckResult:
    """One try of a check. ``phase``/``progress`` are what the app reported, if anything.

    >>> CheckResult(ok=True, latency=0.0004).ok
    True
    """

    ok: bool
    latency: float = 0.0
    detail: str = ""
    phase: str | None = None
    progress: float | None = None


@dataclass(frozen=True)
class Notice:
    """One sd_notify datagram, parsed (see :func:`coldstart.probe.notify.parse_notice`)."""

    ready: bool = False
    stopping: bool = False
    reloading: bool = False
    status: str | None = None
    phase: str | None = None
    progress: float | None = None
    warmup: str | None = None       # X_WARMUP: hit | partial | miss (coldstart warmup run)


@dataclass(frozen=True)
class Thresholds:
    """When READY turns DEGRADED and back (hysteresis), and when start-up gives up.

    ``slow`` (seconds): an answer slower than this counts as a failure while READY/DEGRADED.

    >>> Thresholds(failures=3, successes=2).failures
    3
    """

    failures: int = 3
    successes: int = 2
    slow: float = 0.25
    startup_timeout: float = _T.startup_timeout

    def __post_init__(self) -> None:
        if self.failures < 1 or self.successes < 1:
            raise InvalidArgument("failure and success thresholds must be at least 1")
        if not (self.slow > 0 and self.startup_timeout > 0):
            raise InvalidArgument("slow and startup_timeout must be positive seconds")


@dataclass(frozen=True)
class Status:
    """What the sinks publish about one target: its state plus what the app said about itself."""

    state: State
    epoch: int = 0
    phase: str | None = None
    progress: float | None = None
    detail: str = ""
    since: float = 0.0  # wall-clock seconds of the last state change
    warmup: str | None = None  # the warm-up cache's verdict, as the app's READY said it

    def to_json(self, target: str, service: str) -> dict[str, object]:
        """A JSON-ready dict; the same document goes to Redis, webhooks and ``/status``."""
        doc: dict[str, object] = {
            "service": service,
            "target": target,
            "state": self.state.value,
            "epoch": self.epoch,
            "since": round(self.since, 6),
        }
        if self.phase is not None:
            doc["phase"] = self.phase
        if self.progress is not None:
            doc["progress"] = self.progress
        if self.detail:
            doc["detail"] = self.detail
        if self.warmup is not None:
            doc["warmup"] = self.warmup
        return doc


@dataclass
class StateMachine:
    """Turns observations into state changes. Each ``on_*`` returns the new Status or None.

    >>> m = StateMachine(Thresholds(failures=2, successes=1), started=0.0)
    >>> m.on_check(CheckResult(ok=True), now=0.01).state
    <State.READY: 'READY'>
    >>> m.on_check(CheckResult(ok=False), now=0.02) is None   # one failure: still READY
    True
    >>> m.on_check(CheckResult(ok=False), now=0.03).state
    <State.DEGRADED: 'DEGRADED'>
    """

    thresholds: Thresholds = field(default_factory=Thresholds)
    started: float = 0.0
    status: Status = field(default_factory=lambda: Status(State.STARTING))
    # True: a start-up that timed out is not final; a later good try (or READY=1) is READY
    recover: bool = False
    # True once start-up timed out (FAILED for that reason, not because the app exited)
    timed_out: bool = False
    _fails: int = 0
    _oks: int = 0
    _last_error: str = ""  # the last failed try while starting: FAILED says why

    @property
    def state(self) -> State:
        return self.status.state

    @property
    def _recoverable(self) -> bool:
        return self.recover and self.timed_out and self.state is State.FAILED

    @property
    def final(self) -> bool:
        """No observation can change the state any more (STOPPED, or FAILED for good)."""
        return self.state.terminal and not self._recoverable

    def _move(self, state: State, now: float, detail: str = "", **info: object) -> Status | None:
        phase = info.get("phase", self.status.phase)
        progress = info.get("progress", self.status.progress)
        warmup = info.get("warmup", self.status.warmup)
        if state is self.status.state and phase == self.status.phase and (
            progress == self.status.progress and (not detail or detail == self.status.detail)
            and warmup == self.status.warmup
        ):
            return None
        since = now if state is not self.status.state else self.status.since
        self._fails = self._oks = 0
        self.status = replace(
            self.status, state=state, detail=detail or self.status.detail,
            phase=phase if isinstance(phase, str) else None,
            progress=progress if isinstance(progress, float) else None, since=since,
            warmup=warmup if isinstance(warmup, str) else None,
        )
        if state is not State.LOADING and state is not State.STARTING:
            # progress means "how far loading got"; it is stale once loading is over
            self.status = replace(self.status, progress=None)
        return self.status

    def _report(self, result: CheckResult | Notice) -> dict[str, object]:
        info: dict[str, object] = {}
        if result.phase is not None:
            info["phase"] = result.phase
        if result.progress is not None and math.isfinite(result.progress):
            info["progress"] = min(1.0, max(0.0, float(result.progress)))
        if isinstance(result, Notice) and result.warmup:
            info["warmup"] = result.warmup
        return info

    def on_check(self, result: CheckResult, now: float) -> Status | None:
        """Feed one check try. First success while starting → READY at once (no hysteresis)."""
        state = self.state
        if self._recoverable and result.ok:
            return self._move(State.READY, now, result.detail or "check passed",
                              **self._report(result))
        if state.terminal or state is State.DRAINING:
            return None
        info = self._report(result)
        if state.starting_up:
            if result.ok:
                return self._move(State.READY, now, result.detail or "check passed", **info)
            if result.detail:
                self._last_error = result.detail
            if info:
                return self._move(State.LOADING, now, result.detail, **info)
            return self.on_tick(now)
        good = result.ok and result.latency <= self.thresholds.slow
        if state is State.READY:
            if good:
                self._fails = 0
                return None
            self._fails += 1
            if self._fails >= self.thresholds.failures:
                why = result.detail if not result.ok else f"slow answer {result.latency:.3f} s"
                return self._move(State.DEGRADED, now, why, **info)
            return None
        # DEGRADED
        if not good:
            self._oks = 0
            return None
        self._oks += 1
        if self._oks >= self.thresholds.successes:
            return self._move(State.READY, now, "recovered", **info)
        return None

    def on_notice(self, notice: Notice, now: float) -> Status | None:
        """Feed one sd_notify message. The app's own word applies at once (it is a push)."""
        state = self.state
        if self._recoverable and notice.ready:
            return self._move(State.READY, now, notice.status or "READY=1",
                              **self._report(notice))
        if state.terminal:
            return None
        if notice.stopping:
            return self._move(State.DRAINING, now, notice.status or "app is stopping")
        if state is State.DRAINING:
            return None
        info = self._report(notice)
        if notice.ready:
            return self._move(State.READY, now, notice.status or "READY=1", **info)
        if notice.reloading:
            return self._move(State.DEGRADED, now, notice.status or "app is reloading", **info)
        if state.starting_up and (notice.status or info):
            return self._move(State.LOADING, now, notice.status or "", **info)
        if notice.status or info:
            return self._move(state, now, notice.status or "", **info)
        return None

    def on_tick(self, now: float) -> Status | None:
        """Let time pass: start-up that lasts too long fails; the detail says how long it
        waited and what the last failed try answered."""
        if self.state.starting_up and now - self.started > self.thresholds.startup_timeout:
            self.timed_out = True
            why = f"not ready after {self.thresholds.startup_timeout:g} s"
            if self._last_error:
                why += f" (last try: {self._last_error})"
            elif self.state is State.LOADING and self.status.detail:
                why += f" (still loading: {self.status.detail})"
            return self._move(State.FAILED, now, why)
        return None

    def on_drain(self, now: float, why: str = "SIGTERM") -> Status | None:
        """Start draining (tell routers first; the caller then gives the app its grace)."""
        if self.state.terminal or self.state is State.DRAINING:
            return None
        return self._move(State.DRAINING, now, why)

    def on_exit(self, code: int, now: float) -> Status | None:
        """The app exited: STOPPED if it was asked to (draining), else FAILED."""
        if self.state.terminal:
            return None
        if self.state is State.DRAINING:
            return self._move(State.STOPPED, now, f"app exited with {code}")
        return self._move(State.FAILED, now, f"app exited with {code}")

    def on_stopped(self, now: float, why: str = "stopped") -> Status | None:
        """The prober itself is done (sidecar after its grace period)."""
        if self.state.terminal:
            return None
        return self._move(State.STOPPED, now, why)
