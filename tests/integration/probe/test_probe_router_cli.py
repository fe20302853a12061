"""`coldstart router pick|release|quarantine|list|forget` against a real redis-server."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from coldstart.probe.router import Router, channel

pytestmark = pytest.mark.integration


@pytest.fixture
def router(redis_server: str) -> Iterator[Router]:
    r = Router.connect(redis_server, f"svc-{uuid.uuid4().hex[:8]}")
    for target, state in (("a:1", "READY"), ("b:1", "LOADING")):
        doc = json.dumps({"state": state, "progress": 0.5} if state == "LOADING" else {})
        r._call("update", target, 1, state, doc, 60_000, channel(r.service), 0)
    yield r
    r.client.delete(*r.keys)


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldstart.cli", "router", *args,
                           "--redis", url], capture_output=True, text=True, timeout=60)


def test_pick_release_list(redis_server: str, router: Router) -> None:
    s = router.service
    assert cli(redis_server, "pick", s).stdout.strip() == "a:1"
    assert router.list()[0].inflight == 1
    listed = cli(redis_server, "list", s).stdout
    assert "a:1" in listed and "READY" in listed and "50%" in listed
    rows = json.loads(cli(redis_server, "list", s, "-o", "json").stdout)
    assert [(r["target"], r["state"], r["inflight"]) for r in rows] == [
        ("a:1", "READY", 1), ("b:1", "LOADING", 0)]
    assert cli(redis_server, "release", s, "a:1").stdout.strip() == "0"
    assert json.loads(cli(redis_server, "pick", s, "-o", "json").stdout) == {
        "service": s, "target": "a:1"}
    assert json.loads(cli(redis_server, "release", s, "a:1", "-o", "json").stdout) == {
        "service": s, "target": "a:1", "inflight": 0, "quarantine_s": None}


def test_no_target_is_exit_3_with_one_line(redis_server: str, router: Router) -> None:
    out = cli(redis_server, "release", router.service, "a:1", "--failed")
    assert "quarantined for 1 s" in out.stdout
    out = cli(redis_server, "pick", router.service)
    assert out.returncode == 3
    assert out.stderr.strip().splitlines() == [
        f"coldstart: error: no READY target with room in service {router.service!r}"]


def test_quarantine_and_forget(redis_server: str, router: Router) -> None:
    s = router.service
    assert cli(redis_server, "quarantine", s, "a:1", "--base", "2").stdout.strip() == "2"
    assert cli(redis_server, "quarantine", s, "a:1", "--base", "2").stdout.strip() == "4"
    assert cli(redis_server, "forget", s, "a:1").returncode == 0
    out = cli(redis_server, "forget", s, "a:1")
    assert out.returncode == 3 and "is not a target" in out.stderr
    assert [v.target for v in router.list()] == ["b:1"]


def test_pick_policy_pack(redis_server: str, router: Router) -> None:
    s = router.service
    doc = json.dumps({"state": "READY"})
    router._call("update", "c:1", 1, "READY", doc, 60_000, channel(s), 2)
    router._call("update", "a:1", 2, "READY", doc, 60_000, channel(s), 2)  # capacity 2
    picks = [cli(redis_server, "pick", s, "--policy", "pack").stdout.strip() for _ in range(3)]
    assert picks == ["a:1", "a:1", "c:1"]  # fills a:1 to its capacity, then the next by name
    out = cli(redis_server, "pick", s, "--policy", "nope")
    assert out.returncode == 2 and "nope" in out.stderr
