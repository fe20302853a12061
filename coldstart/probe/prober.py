"""The prober: one asyncio loop that watches one app and pushes each state change to the sinks.

Two ways to run it:

* **sidecar** — probe a target the pod runs anyway (``--target http://127.0.0.1:8000/health``);
* **wrapper** — start the app itself with ``$NOTIFY_SOCKET`` set, forward signals to it and exit
  with its code (``coldstart probe … -- python server.py``).

While starting, the check runs every ``startup_interval`` (5 ms) with a per-try deadline; once
READY it runs every ``interval``. An sd_notify datagram or a gRPC Watch message is a push and
applies at once. On SIGTERM the state goes DRAINING and every sink is told *before* the app gets
its SIGTERM and grace period.

FAILED (not READY within the start-up timeout) is logged at ERROR and pushed to the sinks; then
the sidecar ends with :data:`EXIT_FAILED` (as the kubelet restarts a container whose startupProbe
fails) unless ``keep_probing`` is set, and the wrapper stops the app (SIGTERM, grace, SIGKILL) and
ends with :data:`EXIT_FAILED`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from coldstart.config import ProbeTimingConfig
from coldstart.errors import InvalidArgument
from coldstart.probe.checks import Check, GrpcHealthCheck
from coldstart.probe.endpoint import ReadyEndpoint
from coldstart.probe.notify import NotifyListener
from coldstart.probe.sinks import Sink
from coldstart.probe.states import CheckResult, Notice, State, StateMachine, Status, Thresholds

__all__ = ["EXIT_FAILED", "ProbeConfig", "Prober"]

log = logging.getLogger("coldstart.probe")

_T = ProbeTimingConfig()  # the defaults, written once in coldstart.config
FORWARDED_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
EXIT_FAILED = 1  # what run() returns when start-up timed out (FAILED)


@dataclass(frozen=True)
class ProbeConfig:
    """Every knob of the prober, in seconds. Defaults (``coldstart.config.ProbeTimingConfig``,
    where each is described) suit a GPU model server.

    >>> ProbeConfig(service="llama", target="10.0.0.5:8000").startup_interval
    0.005
    """

    service: str = "default"
    target: str = "127.0.0.1"          # the address routers send requests to
    startup_interval: float = _T.startup_interval
    startup_try_timeout: float = _T.startup_try_timeout
    interval: float = _T.interval
    try_timeout: float = _T.try_timeout
    heartbeat: float = _T.heartbeat
    ttl: float = _T.ttl
    progress_every: float = _T.progress_every
    drain_delay: float = _T.drain_delay
    grace: float = _T.grace
    flush_timeout: float = _T.flush_timeout
    thresholds: Thresholds = field(default_factory=Thresholds)
    # sidecar: after FAILED (start-up timed out) go on probing, READY if the app comes up late,
    # instead of ending with EXIT_FAILED
    keep_probing: bool = False

    def __post_init__(self) -> None:
        for name in ("startup_interval", "startup_try_timeout", "interval", "try_timeout",
                     "heartbeat", "ttl", "flush_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be a positive number of seconds")
        for name in ("progress_every", "drain_delay", "grace"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must not be negative")
        if self.ttl <= self.heartbeat:
            raise InvalidArgument("ttl must be longer than the heartbeat period")


class _SinkWorker:
    """Sends changes to one sink in order; a slow or broken sink never holds up the others."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.pending: collections.deque[Status] = collections.deque()
        self.wake = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.errors = 0

    def push(self, status: Status) -> None:
        self.pending.append(status)
        self.idle.clear()
        self.wake.set()

    async def run(self) -> None:
        attempt = 0
        while True:
            if not self.pending:
                self.idle.set()
                self.wake.clear()
                await self.wake.wait()
                continue
            status = self.pending[0]
            try:
                await self.sink.publish(status)
            except Exception as exc:  # a sink's failure is logged, never fatal to the prober
                self.errors += 1
                if len(self.pending) > 1:
                    self.pending.popleft()  # a newer change supersedes this one
                    continue
                log.warning("sink %s: %s (retrying)", self.sink.name, exc)
                attempt += 1
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(2.0, 0.05 * 2**attempt)):
                        self.wake.clear()
                        await self.wake.wait()
                continue
            attempt = 0
            self.pending.popleft()


class Prober:
    """Probe one app and push its state to ``sinks``.

    >>> # prober = Prober(ProbeConfig(service="llama", target="10.0.0.5:8000"),
    >>> #                 HttpCheck("http://127.0.0.1:8000/health"), [RedisSink(...)])
    >>> # exit_code = await prober.run()                   # sidecar, until SIGTERM
    >>> # exit_code = await prober.run(["python", "server.py"])   # wrapper
    """

    def __init__(
        self, config: ProbeConfig, check: Check | None, sinks: Sequence[Sink] = (), *,
        notify_path: str | None = None, listen: tuple[str, int] | None = None,
        on_change: Callable[[Status], None] | None = None,
    ) -> None:
        self.config = config
        self.check = check
        self.sinks = list(sinks)
        self.notify_path = notify_path
        self.listen = listen
        self.on_change = on_change
        self._machine = StateMachine(config.thresholds, started=time.monotonic(),
                                     recover=config.keep_probing)
        self._epoch = 0
        self._last_push = 0.0
        self._workers: list[_SinkWorker] = []
        self._app_speaks = False
        self._watching = False
        self._drain_requested = asyncio.Event()
        self._signalled = False
        self._check_lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._failed = asyncio.Event()  # set when the state turns FAILED for good
        self._wrapping = False  # run() was given an app
        self._app_code: int | None = None  # the wrapped app's exit status, once it exited
        self.endpoint: ReadyEndpoint | None = None
        self.history: list[Status] = []

    @property
    def status(self) -> Status:
        return self._machine.status

    # state changes ---------------------------------------------------------------------------

    def _apply(self, new: Status | None) -> None:
        if new is None:
            return
        previous = self.history[-1] if self.history else None
        now = time.monotonic()
        if (previous is not None and previous.state is new.state
                and now - self._last_push < self.config.progress_every):
            return  # a progress-only update, rate-limited; the next change carries the latest
        # µs of wall time, never going back: a restarted prober outranks its predecessor
        self._epoch = max(self._epoch + 1, time.time_ns() // 1000)
        since = time.time() if previous is None or previous.state is not new.state else (
            previous.since)
        status = replace(new, epoch=self._epoch, since=since)
        self._machine.status = status
        self._last_push = now
        self.history.append(status)
        self._log(status)
        if status.state is State.FAILED and self._machine.final:
            self._failed.set()
        for worker in self._workers:
            worker.push(status)
        if self.on_change is not None:
            self.on_change(status)

    def _log(self, status: Status) -> None:
        target, state, detail = self.config.target, status.state.value, status.detail
        if status.state is State.FAILED:
            if not self._machine.timed_out:  # the wrapped app exited before it was asked to
                level = logging.WARNING if self._app_code == 0 else logging.ERROR
                log.log(level, "%s FAILED: %s; exiting with its code; see the app's output "
                        "above", target, detail)
                return
            if self._wrapping:
                then = f"stopping the app, then exiting with {EXIT_FAILED}"
            elif self.config.keep_probing:
                then = "probing on (--keep-probing)"
            else:
                then = f"exiting with {EXIT_FAILED} once the sinks are told"
            log.error("%s FAILED: %s; %s; check that the app starts and that the target is "
                      "right, or give it longer (--startup-timeout)", target, detail, then)
        elif status.state is State.DEGRADED:
            log.warning("%s DEGRADED: %s", target, detail)
        else:
            log.info("%s %s %s", target, state, detail)

    def feed(self, result: CheckResult) -> None:
        """Apply one check result (from polling or a push such as gRPC Watch)."""
        self._apply(self._machine.on_check(result, time.monotonic()))

    def notice(self, notice: Notice) -> None:
        """Apply one sd_notify message."""
        self._app_speaks = True
        self._apply(self._machine.on_notice(notice, time.monotonic()))
        if self.status.state is State.DRAINING:
            self._drain_requested.set()

    def request_drain(self) -> None:
        """What SIGTERM does: go DRAINING (sinks first), then stop the app within its grace."""
        self._signalled = True
        self._drain_requested.set()

    async def flush(self, timeout: float) -> bool:
        """Wait until every sink took every change so far; False if time ran out."""
        try:
            async with asyncio.timeout(timeout):
                for worker in self._workers:
                    await worker.idle.wait()
        except TimeoutError:
            return False
        return True

    # loops -----------------------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        cfg = self.config
        next_at = time.monotonic()
        while not self._stop.is_set():
            state = self.status.state
            if self._machine.final:
                return
            starting = state.starting_up
            interval = cfg.startup_interval if starting else cfg.interval
            self._apply(self._machine.on_tick(time.monotonic()))
            if self.history and self._machine.status is not self.history[-1]:
                self._apply(self._machine.status)  # progress held back by the rate limit
            # the app's own word (sd_notify) or a Watch stream governs; polling waits meanwhile
            pushing = self._watching or (self._app_speaks and starting)
            if self.check is not None and not pushing and state is not State.DRAINING:
                timeout = cfg.startup_try_timeout if starting else cfg.try_timeout
                async with self._check_lock:
                    result = await self.check.run(timeout)
                self.feed(result)
            else:
                # nothing to poll: only the start-up deadline needs the clock
                interval = max(interval, 0.05 if pushing else 0.5)
            next_at = max(next_at + interval, time.monotonic())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(next_at - time.monotonic()):
                    await self._stop.wait()

    def pushed(self, result: CheckResult) -> None:
        """Apply a result the app's server pushed (gRPC Watch): its word counts at once, with
        no hysteresis, since a push is sent once per change, not repeated like a poll."""
        state = self.status.state
        if result.ok:
            notice = Notice(ready=True, status=result.detail)
        elif state is State.READY:
            notice = Notice(reloading=True, status=result.detail)
        else:
            return
        self._apply(self._machine.on_notice(notice, time.monotonic()))

    async def _watch_loop(self, check: GrpcHealthCheck) -> None:
        while not self._stop.is_set() and not check.watch_unsupported:
            async for result in check.watch():
                self._watching = True
                self.pushed(result)
            self._watching = False
            await asyncio.sleep(self.config.interval)

    async def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(self.config.heartbeat)
            for sink in self.sinks:
                try:
                    async with asyncio.timeout(self.config.heartbeat):
                        await sink.heartbeat()
                except Exception as exc:  # the next heartbeat tries again
                    log.warning("heartbeat to %s: %s", sink.name, exc)

    # running ---------------------------------------------------------------------------------

    async def run(self, app: Sequence[str] | None = None, *, signals: bool = True) -> int:
        """Run until drained (SIGTERM), until FAILED, or, in wrapper mode, until the app exits.

        Returns the exit code: :data:`EXIT_FAILED` if start-up timed out (the sidecar, unless
        ``keep_probing``; the wrapper, after stopping the app), else 0 for the sidecar and the
        app's code in wrapper mode (128+N if a signal N killed it).
        """
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[None]] = []
        listener: NotifyListener | None = None
        tmpdir: tempfile.TemporaryDirectory[str] | None = None
        proc: asyncio.subprocess.Process | None = None
        installed: list[signal.Signals] = []
        try:
            for sink in self.sinks:
                await sink.start()
            self._workers = [_SinkWorker(s) for s in self.sinks]
            tasks += [asyncio.create_task(w.run()) for w in self._workers]
            if self.listen is not None:
                self.endpoint = ReadyEndpoint(
                    lambda: self.status, self.listen[0], self.listen[1],
                    self.config.service, self.config.target,
                )
                await self.endpoint.start()
            notify_path = self.notify_path
            if app is not None and notify_path is None:
                tmpdir = tempfile.TemporaryDirectory(prefix="coldstart-notify-")
                notify_path = os.path.join(tmpdir.name, "notify.sock")
            if notify_path is not None:
                listener = NotifyListener(notify_path, self.notice)
                await listener.start()
            self._wrapping = app is not None
            self._apply(self._machine.status)  # publish STARTING
            if signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, self.request_drain)
                    installed.append(sig)
            if app is not None:
                env = dict(os.environ)
                if notify_path is not None:
                    env["NOTIFY_SOCKET"] = notify_path
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *app, env=env, process_group=0,
                    )
                except OSError as exc:
                    raise InvalidArgument(f"cannot start {app[0]}: {exc}") from exc
                if signals:
                    for sig in FORWARDED_SIGNALS:
                        loop.add_signal_handler(sig, _forward(proc, sig))
                        installed.append(sig)
            tasks.append(asyncio.create_task(self._poll_loop()))
            tasks.append(asyncio.create_task(self._heartbeat_loop()))
            if isinstance(self.check, GrpcHealthCheck):
                tasks.append(asyncio.create_task(self._watch_loop(self.check)))
            return await (self._supervise(proc) if proc is not None else self._sidecar())
        finally:
            self._stop.set()
            for sig in installed:
                loop.remove_signal_handler(sig)
            if proc is not None and proc.returncode is None:
                await _terminate(proc, self.config.grace)
            await self.flush(self.config.flush_timeout)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if listener is not None:
                listener.close()
            if tmpdir is not None:
                tmpdir.cleanup()
            if self.endpoint is not None:
                await self.endpoint.close()
            if self.check is not None:
                await self.check.close()
            for sink in self.sinks:
                with contextlib.suppress(Exception):
                    await sink.close()

    async def _announce_drain(self, why: str) -> None:
        self._apply(self._machine.on_drain(time.monotonic(), why))
        if not await self.flush(self.config.flush_timeout):
            log.warning("not every sink took DRAINING within %s s", self.config.flush_timeout)
        if self.config.drain_delay:
            await asyncio.sleep(self.config.drain_delay)

    async def _sidecar(self) -> int:
        drain = asyncio.create_task(self._drain_requested.wait())
        failed = asyncio.create_task(self._failed.wait())
        try:
            await asyncio.wait([drain, failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain.cancel()
            failed.cancel()
        if self._failed.is_set():
            # tell the sinks before ending: routers stop picking the target, the pod condition
            # goes False; the kubelet then restarts this container, as for a failed startupProbe
            if not await self.flush(self.config.flush_timeout):
                log.warning("not every sink took FAILED within %g s", self.config.flush_timeout)
            return EXIT_FAILED
        await self._announce_drain("SIGTERM")
        # the app got its own SIGTERM from the kubelet; STOPPED once it no longer answers
        deadline = time.monotonic() + self.config.grace
        while self.check is not None and time.monotonic() < deadline:
            async with self._check_lock:  # the poll loop may be mid-try on the same connection
                result = await self.check.run(self.config.try_timeout)
            if not result.ok:
                break
            await asyncio.sleep(max(0.0, min(self.config.interval, deadline - time.monotonic())))
        self._apply(self._machine.on_stopped(time.monotonic(), "drained"))
        return 0

    async def _supervise(self, proc: asyncio.subprocess.Process) -> int:
        exited = asyncio.create_task(proc.wait())
        drain = asyncio.create_task(self._drain_requested.wait())
        failed = asyncio.create_task(self._failed.wait())
        timed_out = False
        try:
            while True:
                done, _ = await asyncio.wait(
                    [exited, drain, failed], timeout=0.5, return_when=asyncio.FIRST_COMPLETED
                )
                if exited in done:
                    break
                if drain in done:
                    if self._signalled:
                        await self._announce_drain("SIGTERM")
                        await _terminate(proc, self.config.grace)
                    else:  # the app said STOPPING=1 itself: routers are told, it stops alone
                        await self.flush(self.config.flush_timeout)
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(self.config.grace):
                                await asyncio.shield(exited)
                        await _terminate(proc, self.config.grace)
                    break
                if self.status.state is State.FAILED:
                    timed_out = True  # start-up took too long: stop the app, as systemd would
                    await _terminate(proc, self.config.grace)
                    break
        finally:
            drain.cancel()
            failed.cancel()
        code = self._app_code = await exited
        self._apply(self._machine.on_exit(code, time.monotonic()))
        if timed_out:
            # however the app ended after our SIGTERM (143, 137, 0), the cause is the time-out
            return EXIT_FAILED
        if code < 0:
            return 128 - code
        return code


def _forward(proc: asyncio.subprocess.Process, sig: int) -> Callable[[], None]:
    def send() -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
    return send


async def _terminate(proc: asyncio.subprocess.Process, grace: float) -> None:
    """SIGTERM the app, SIGKILL it if it outlives its grace period."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(grace):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
