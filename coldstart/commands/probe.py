"""``coldstart probe``: probe an app aggressively while it starts and push its state to routers."""

from __future__ import annotations

import asyncio
import sys
import urllib.parse

import click

from coldstart.commands._common import configure_logging, explicit_log_level
from coldstart.config import ProbeTimingConfig
from coldstart.errors import InvalidArgument
from coldstart.probe.states import Thresholds

# Defaults are written once: timings in coldstart.config, thresholds in coldstart.probe.states.
_T = ProbeTimingConfig()
_TH = Thresholds()


def _host_port(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgument(f"{what} must be HOST:PORT, got {value!r}")
    return host or "0.0.0.0", int(port)


def _default_advertise(target: str | None) -> str:
    if target and "://" in target:
        parts = urllib.parse.urlsplit(target)  # parse_target has refused what cannot be parsed
        if parts.hostname:
            default = {"http": 80, "grpc": 50051}.get(parts.scheme, 0)
            port = parts.port or default
            return f"{parts.hostname}:{port}" if port else parts.hostname
    import socket

    return socket.gethostname()


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--target", metavar="URL",
              help="What to probe: http://HOST:PORT/PATH (200-399 is ready; a JSON body "
                   "{\"phase\":…, \"progress\":0.42} is passed on), tcp://HOST:PORT, "
                   "grpc://HOST:PORT[/SERVICE] (grpc.health.v1, Watch when offered) or "
                   "exec:COMMAND (exit 0 is ready).")
@click.option("--service", default="default", show_default=True, envvar="COLDSTART_SERVICE",
              help="Service the target belongs to (routers pick among one service's targets).")
@click.option("--advertise", metavar="HOST:PORT",
              help="Address routers send requests to. Default: the target's host:port.")
@click.option("--sink", "sinks", multiple=True, metavar="URL",
              help="Where state changes go; repeat for several. redis://… or valkey://… "
                   "(routing state + heartbeat + PUBLISH), http(s)://… (webhook POST), "
                   "k8s://NAMESPACE/POD[?api=URL&condition=TYPE&token_file=PATH] (pod "
                   "condition for readinessGates; the token file is read again per request, "
                   "as projected tokens rotate).")
@click.option("--listen", metavar="HOST:PORT",
              help="Serve readiness for the kubelet's readinessProbe: 200 only when READY "
                   "(any path), JSON on /status.")
@click.option("--notify-socket", metavar="PATH",
              help="Bind an sd_notify socket here (READY=1, STATUS=…, STOPPING=1, "
                   "X_PROGRESS=…). Wrapper mode makes one itself and sets $NOTIFY_SOCKET.")
@click.option("--startup-interval", type=float, default=_T.startup_interval, show_default=True,
              help="Seconds between tries while starting.")
@click.option("--startup-try-timeout", type=float, default=_T.startup_try_timeout,
              show_default=True,
              help="Deadline of one try while starting (s).")
@click.option("--startup-timeout", type=float, default=_T.startup_timeout, show_default=True,
              help="FAILED if not READY within this many seconds: logged as an error with the "
                   "last try's answer and pushed to the sinks; then the sidecar exits 1 "
                   "(unless --keep-probing) and the wrapper stops the app and exits 1.")
@click.option("--keep-probing", is_flag=True,
              help="Sidecar: after FAILED, probe on at --interval and go READY if the app "
                   "comes up late, instead of exiting 1 (which lets the kubelet restart this "
                   "container and show the failure, as for a failed startupProbe).")
@click.option("--interval", type=float, default=_T.interval, show_default=True,
              help="Seconds between tries once READY or DEGRADED.")
@click.option("--try-timeout", type=float, default=_T.try_timeout, show_default=True,
              help="Deadline of one try once READY (s).")
@click.option("--failures", type=int, default=_TH.failures, show_default=True,
              help="Consecutive failed or slow tries that turn READY into DEGRADED.")
@click.option("--successes", type=int, default=_TH.successes, show_default=True,
              help="Consecutive good tries that turn DEGRADED back into READY.")
@click.option("--slow", type=float, default=_TH.slow, show_default=True,
              help="An answer slower than this (s) counts as a failure once READY.")
@click.option("--heartbeat", type=float, default=_T.heartbeat, show_default=True,
              help="Heartbeat period to the sinks (s).")
@click.option("--ttl", type=float, default=_T.ttl, show_default=True,
              help="Routers stop picking the target this long after its last heartbeat (s).")
@click.option("--capacity", type=int, default=0, show_default=True,
              help="Most requests in flight a router may give this target (0: no limit).")
@click.option("--drain-delay", type=float, default=_T.drain_delay, show_default=True,
              help="After routers are told DRAINING, wait this long before the app's SIGTERM.")
@click.option("--grace", type=float, default=_T.grace, show_default=True,
              help="The app's grace period after SIGTERM before SIGKILL (s).")
@click.argument("app", nargs=-1, type=click.UNPROCESSED, metavar="[-- APP ARGS...]")
def probe(
    target: str | None, service: str, advertise: str | None, sinks: tuple[str, ...],
    listen: str | None, notify_socket: str | None, startup_interval: float,
    startup_try_timeout: float, startup_timeout: float, interval: float, try_timeout: float,
    failures: int, successes: int, slow: float, heartbeat: float, ttl: float, capacity: int,
    drain_delay: float, grace: float, keep_probing: bool, app: tuple[str, ...],
) -> None:
    """Probe an app while it starts (every 5 ms) and push each state change to routers.

    States: STARTING, LOADING (with progress), READY, DEGRADED, DRAINING, STOPPED, FAILED.

    \b
    Sidecar (probe an app the pod runs anyway):
      coldstart probe --target http://127.0.0.1:8000/health \\
          --sink valkey://valkey:6379/0 --service llama --listen 0.0.0.0:9091
    Wrapper (start the app with $NOTIFY_SOCKET set, forward signals, exit with its code):
      coldstart probe --sink redis://127.0.0.1:6379/0 --service llama \\
          --target http://127.0.0.1:8000/health -- python server.py

    On SIGTERM the state goes DRAINING and the sinks are told before the app gets SIGTERM.
    State changes are logged at INFO, DEGRADED at WARNING, FAILED at ERROR.

    \b
    Exit codes:
      0  drained after SIGTERM (sidecar)
      1  FAILED: not READY within --startup-timeout (the sinks are told first; the
         wrapper stops the app first: SIGTERM, --grace, SIGKILL)
      2  bad arguments (e.g. an exec: target that does not exist)
      N  wrapper: the app's own exit code (128+N if signal N killed it)
    """
    from coldstart.probe.checks import Check, parse_target
    from coldstart.probe.prober import ProbeConfig, Prober
    from coldstart.probe.sinks import Sink, make_sink
    from coldstart.probe.states import Thresholds

    # a sidecar's log lines carry their time (the CLI's --log-level picks the level)
    configure_logging(explicit_log_level() or "warning", daemon=True)
    if not target and not app and not notify_socket:
        raise InvalidArgument("nothing to probe: give --target, --notify-socket or -- APP ARGS")
    if keep_probing and app:
        raise InvalidArgument(
            "--keep-probing is for the sidecar: a wrapped app that is not READY in time is "
            "stopped; drop the flag or run the app apart"
        )
    check: Check | None = parse_target(target) if target else None
    config = ProbeConfig(
        service=service, target=advertise or _default_advertise(target),
        startup_interval=startup_interval, startup_try_timeout=startup_try_timeout,
        interval=interval, try_timeout=try_timeout, heartbeat=heartbeat, ttl=ttl,
        drain_delay=drain_delay, grace=grace, keep_probing=keep_probing,
        thresholds=Thresholds(failures, successes, slow, startup_timeout),
    )
    built: list[Sink] = [
        make_sink(url, service, config.target, ttl=ttl, capacity=capacity) for url in sinks
    ]
    where = _host_port(listen, "--listen") if listen else None
    prober = Prober(config, check, built, notify_path=notify_socket, listen=where)
    code = asyncio.run(prober.run(list(app) if app else None))
    sys.exit(code)
