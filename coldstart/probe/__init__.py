"""coldstart.probe: start-up probing with granular states, pushed to the request router.

The app side needs nothing but the standard library::

    from coldstart.probe import notify
    notify(ready=True)          # or notify(status="loading weights", progress=0.42)

The rest (checks, state machine, prober, sinks, router functions) is imported on first use, so an
app calling :func:`notify` never imports redis, httpx or grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from coldstart.probe.notify import notify
from coldstart.probe.states import CheckResult, Notice, State, StateMachine, Status, Thresholds

if TYPE_CHECKING:
    from coldstart.probe.checks import (
        Check,
        ExecCheck,
        GrpcHealthCheck,
        HttpCheck,
        TcpCheck,
        parse_target,
    )
    from coldstart.probe.endpoint import ReadyEndpoint
    from coldstart.probe.prober import ProbeConfig, Prober
    from coldstart.probe.router import Router, TargetView
    from coldstart.probe.sinks import KubernetesSink, RedisSink, Sink, WebhookSink, make_sink

__all__ = [
    "Check",
    "CheckResult",
    "ExecCheck",
    "GrpcHealthCheck",
    "HttpCheck",
    "KubernetesSink",
    "Notice",
    "ProbeConfig",
    "Prober",
    "ReadyEndpoint",
    "RedisSink",
    "Router",
    "Sink",
    "State",
    "StateMachine",
    "Status",
    "TargetView",
    "TcpCheck",
    "Thresholds",
    "WebhookSink",
    "make_sink",
    "notify",
    "parse_target",
]

_LAZY = {
    "Check": "checks", "ExecCheck": "checks", "GrpcHealthCheck": "checks", "HttpCheck": "checks",
    "TcpCheck": "checks", "parse_target": "checks", "ReadyEndpoint": "endpoint",
    "ProbeConfig": "prober", "Prober": "prober", "Router": "router", "TargetView": "router",
    "KubernetesSink": "sinks", "RedisSink": "sinks", "Sink": "sinks", "WebhookSink": "sinks",
    "make_sink": "sinks",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'coldstart.probe' has no attribute {name!r}")
    return getattr(importlib.import_module(f"coldstart.probe.{module}"), name)
