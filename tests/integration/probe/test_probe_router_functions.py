"""The router's server-side functions on a real redis-server: epochs, pick, quarantine, expiry."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
import redis
from redis.crc import key_slot

from coldstart.errors import InvalidArgument, NotFound
from coldstart.probe.router import Router, channel, keys

pytestmark = pytest.mark.integration


def put(r: Router, target: str, state: str, epoch: int, *, ttl_ms: int = 10_000,
        capacity: int = 0) -> int:
    doc = json.dumps({"target": target, "state": state, "epoch": epoch})
    return int(r._call("update", target, epoch, state, doc, ttl_ms,
                       channel(r.service), capacity))


def test_all_keys_of_a_service_share_one_cluster_slot() -> None:
    slots = {key_slot(k.encode()) for k in keys("llama-70b")}
    assert len(slots) == 1
    assert key_slot(channel("llama-70b").encode()) in slots


def test_a_stale_writer_loses(router: Router) -> None:
    assert put(router, "a:1", "READY", 200) == 1
    assert put(router, "a:1", "DEGRADED", 100) == 0   # older epoch
    assert put(router, "a:1", "DEGRADED", 200) == 0   # same epoch
    [view] = router.list()
    assert view.state == "READY" and view.doc["epoch"] == 200
    assert router._call("heartbeat", "a:1", 100, 5000) == 0  # old writer's heartbeat
    assert put(router, "a:1", "DEGRADED", 201) == 1
    assert router.list()[0].state == "DEGRADED"


def test_each_change_is_published(router: Router) -> None:
    sub = router.client.pubsub()
    sub.subscribe(channel(router.service))
    first = sub.get_message(timeout=2.0)
    assert first is not None and first["type"] == "subscribe"
    put(router, "a:1", "LOADING", 1)
    put(router, "a:1", "READY", 2)
    put(router, "a:1", "READY", 1)  # stale: not published
    got = []
    for _ in range(3):
        msg = sub.get_message(timeout=0.5)
        if msg:
            got.append(json.loads(msg["data"])["state"])
    sub.close()
    assert got == ["LOADING", "READY"]


def test_pick_takes_the_least_loaded_ready_target(router: Router) -> None:
    with pytest.raises(NotFound):
        router.pick()
    put(router, "a:1", "READY", 1)
    put(router, "b:1", "READY", 1)
    put(router, "c:1", "LOADING", 1)
    picks = Counter(router.pick() for _ in range(6))
    assert picks == {"a:1": 3, "b:1": 3}
    router.release("a:1")
    router.release("a:1")
    assert router.pick() == "a:1" and router.pick() == "a:1"
    # a target that leaves READY keeps its count, and is not picked
    put(router, "a:1", "DEGRADED", 2)
    assert {router.pick() for _ in range(3)} == {"b:1"}
    put(router, "a:1", "READY", 3)
    assert router.pick() == "a:1"  # 3 in flight against b's 6


def test_release_never_goes_below_zero(router: Router) -> None:
    put(router, "a:1", "READY", 1)
    assert router.release("a:1") == 0
    assert router.pick() == "a:1"
    assert router.list()[0].inflight == 1


def test_fifty_concurrent_picks_spread_evenly(redis_server: str, router: Router) -> None:
    for t in ("a:1", "b:1", "c:1", "d:1"):
        put(router, t, "READY", 1)
    got: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(50)

    def client() -> None:
        r = Router.connect(redis_server, router.service)
        start.wait()
        t = r.pick()
        with lock:
            got.append(t)
        r.client.close()

    threads = [threading.Thread(target=client) for _ in range(50)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    counts = Counter(got)
    assert len(got) == 50 and max(counts.values()) - min(counts.values()) <= 1
    for t, n in counts.items():
        for _ in range(n):
            router.release(t)
    assert all(v.inflight == 0 for v in router.list())


def server_ms(r: Router) -> int:
    """The store's clock (TIME) in ms: where a test that drives time starts."""
    seconds, micros = r.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_quarantine_backs_off_exponentially_and_clears(router: Router) -> None:
    """Time is driven explicitly (``at_ms``), from the store's clock before the targets were
    written (so their 10 s heartbeats outlive every time used here): no step depends on how
    long the machine takes between calls."""
    t = server_ms(router)
    put(router, "a:1", "READY", 1)
    put(router, "b:1", "READY", 1)
    assert router.quarantine("a:1", base=0.2, limit=0.5, at_ms=t) == 0.2
    assert {router.pick(at_ms=t + 199) for _ in range(4)} == {"b:1"}
    assert router.quarantine("a:1", base=0.2, limit=0.5, at_ms=t) == 0.4
    assert router.quarantine("a:1", base=0.2, limit=0.5, at_ms=t) == 0.5  # capped
    view = next(v for v in router.list(at_ms=t + 100) if v.target == "a:1")
    assert view.strikes == 3 and view.quarantine_ms == 400
    # out of picks until its quarantine ends, back from that millisecond on
    assert {router.pick(at_ms=t + 499) for _ in range(4)} == {"b:1"}
    assert router.pick(at_ms=t + 500) == "a:1"  # the least loaded, once it may be picked
    assert next(v for v in router.list(at_ms=t + 500) if v.target == "a:1").quarantine_ms == 0
    router.release("a:1", ok=True)  # a request that worked clears the strikes
    assert next(v for v in router.list() if v.target == "a:1").strikes == 0
    assert router.quarantine("a:1", base=0.2, limit=0.5) == 0.2


def test_ready_again_lifts_the_quarantine(router: Router) -> None:
    put(router, "a:1", "READY", 1)
    router.quarantine("a:1", base=60, limit=60)
    with pytest.raises(NotFound):
        router.pick()
    put(router, "a:1", "READY", 2)  # still READY: no fresh start, stays quarantined
    with pytest.raises(NotFound):
        router.pick()
    put(router, "a:1", "STARTING", 3)
    put(router, "a:1", "READY", 4)
    assert router.pick() == "a:1"


def test_expired_heartbeat_is_never_picked_until_it_beats_again(router: Router) -> None:
    put(router, "a:1", "READY", 1, ttl_ms=150)
    put(router, "b:1", "READY", 1, ttl_ms=60_000)
    router.release("b:1")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and router.list()[0].alive:
        time.sleep(0.05)
    assert not router.list()[0].alive
    assert {router.pick() for _ in range(5)} == {"b:1"}
    assert router._call("heartbeat", "a:1", 1, 60_000) == 1
    assert router.pick() == "a:1"
    assert router._call("heartbeat", "zz:1", 1, 1000) == -1  # unknown target


def test_forget_and_list(router: Router) -> None:
    put(router, "a:1", "READY", 1)
    assert [v.target for v in router.list()] == ["a:1"]
    assert router.forget("a:1") and not router.forget("a:1")
    assert router.list() == []


def test_functions_are_reloaded_when_the_server_lost_them(router: Router) -> None:
    router.client.function_flush()
    put(router, "a:1", "READY", 1)  # first call loads the library again
    assert router.pick() == "a:1"


def test_bad_arguments(router: Router) -> None:
    with pytest.raises(InvalidArgument):
        router.quarantine("a:1", base=0, limit=1)
    with pytest.raises(InvalidArgument):
        Router.connect("redis://127.0.0.1:1/0", "has space")
    with pytest.raises(InvalidArgument):
        Router.connect("nonsense://x", "svc")


def test_unreachable_store_is_unavailable_within_the_deadline() -> None:
    from coldstart.errors import Unavailable

    r = Router.connect("redis://127.0.0.1:1/0", "svc", timeout=0.5)
    with pytest.raises(Unavailable):
        r.pick()
    assert isinstance(r.client, redis.Redis)
