"""Helpers shared by the prober's integration tests (not a test module)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from coldstart.probe.router import channel
from tests.fixtures.procs import stop

APP = str(Path(__file__).with_name("probe_app.py"))
ROOT = str(Path(__file__).resolve().parents[3])


class Watcher:
    """Subscribes to a service's change channel and keeps every document with its arrival time."""

    def __init__(self, url: str, service: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=5)
        self.pubsub = self.client.pubsub()  # type: ignore[no-untyped-call]
        self.pubsub.subscribe(channel(service))
        assert self.pubsub.get_message(timeout=5)  # the subscribe confirmation
        self.docs: list[tuple[float, dict[str, Any]]] = []
        self.cond = threading.Condition()
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            msg = self.pubsub.get_message(timeout=0.1)
            if msg and msg["type"] == "message":
                with self.cond:
                    self.docs.append((time.monotonic(), json.loads(msg["data"])))
                    self.cond.notify_all()

    def states(self, target: str) -> list[str]:
        with self.cond:
            out = [d["state"] for _, d in self.docs if d["target"] == target]
        # progress-only updates repeat a state; the sequence of distinct states is what matters
        return [s for i, s in enumerate(out) if i == 0 or out[i - 1] != s]

    def wait_for(self, target: str, state: str, timeout: float = 20.0,
                 after: int = 0) -> dict[str, Any]:
        """The first document from index ``after`` on with ``state``; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for _, doc in self.docs[after:]:
                    if doc["target"] == target and doc["state"] == state:
                        return doc
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [d["state"] for _, d in self.docs if d["target"] == target]
                    raise AssertionError(f"{target} never became {state}; saw {seen}")
                self.cond.wait(left)

    def close(self) -> None:
        self._stop = True
        self.thread.join(5)
        self.pubsub.close()
        self.client.close()


@contextlib.contextmanager
def coldstart_probe(args: Sequence[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run `coldstart probe ARGS` as its own process group; SIGTERM/SIGKILL it at the end."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "coldstart.cli", "probe", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        stop(proc)


def sigterm(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGTERM)  # the prober only (as the kubelet does to PID 1)
