"""The router's pools on a real redis-server: who may be picked, how picks spread, what a pick
and a list cost the store, and how often the library is loaded (issue 52's guarantees)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from coldstart.errors import NotFound
from coldstart.probe.router import LIBRARY_NAME, Router, channel, function
from coldstart.probe.sinks import RedisSink
from coldstart.probe.states import State, Status
from coldstart.stack.redis import start_redis

pytestmark = pytest.mark.integration


def put(r: Router, target: str, state: str, epoch: int = 1, *, ttl_ms: int = 60_000,
        capacity: int = 0) -> None:
    doc = json.dumps({"target": target, "state": state, "epoch": epoch})
    assert r._call("update", target, epoch, state, doc, ttl_ms, channel(r.service),
                   capacity) == 1


def pooled(r: Router) -> set[str]:
    return set(r.client.zrange(r.keys[3], 0, -1))


def names(n: int) -> list[str]:
    return [f"10.0.{i // 250}.{i % 250}:8000" for i in range(n)]


def test_quarantined_and_draining_targets_are_never_picked(router: Router) -> None:
    targets = names(40)
    for t in targets:
        put(router, t, "READY")
    quarantined, draining = set(targets[:10]), set(targets[10:20])
    for t in quarantined:
        router.quarantine(t, base=60, limit=60)
    for t in draining:
        put(router, t, "DRAINING", 2)
    assert pooled(router) == set(targets[20:])
    picked: Counter[str] = Counter()
    for _ in range(400):
        t = router.pick()
        picked[t] += 1
        router.release(t)
    assert set(picked) == set(targets[20:])
    # both policies, and with every other target full
    for t in targets[20:]:
        put(router, t, "READY", 3, capacity=1)
    held = [router.pick(policy="pack") for _ in range(20)]
    assert set(held) == set(targets[20:])
    with pytest.raises(NotFound):
        router.pick()
    assert not pooled(router)
    # a release gives the target its room back, and only that target
    router.release(held[0])
    assert pooled(router) == {held[0]}
    assert router.pick() == held[0]


def test_capacity_is_never_exceeded_by_64_concurrent_pickers(
    redis_server: str, router: Router,
) -> None:
    capacity = {t: 1 + i % 4 for i, t in enumerate(names(16))}  # 40 slots for 64 pickers
    for t, cap in capacity.items():
        put(router, t, "READY", capacity=cap)
    lock = threading.Lock()
    live: Counter[str] = Counter()
    picks: Counter[str] = Counter()
    over: list[tuple[str, int]] = []
    refused = 0
    start = threading.Barrier(64)

    def picker(policy: str) -> None:
        nonlocal refused
        r = Router.connect(redis_server, router.service, policy=policy)
        start.wait()
        for _ in range(30):
            try:
                t = r.pick()
            except NotFound:
                with lock:
                    refused += 1
                continue
            with lock:
                live[t] += 1
                picks[t] += 1
                if live[t] > capacity[t]:
                    over.append((t, live[t]))
            time.sleep(0.001)
            with lock:
                live[t] -= 1  # before release: release frees the slot
            r.release(t)
        r.client.close()

    errors: list[BaseException] = []

    def guarded(policy: str) -> None:
        try:
            picker(policy)
        except BaseException as exc:  # reported below, not lost with the thread
            errors.append(exc)
            raise

    threads = [threading.Thread(target=guarded, args=("pack" if i % 2 else "spread",))
               for i in range(64)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors and not any(th.is_alive() for th in threads), errors[:3]
    assert not over
    assert sum(picks.values()) + refused == 64 * 30
    assert set(picks) == set(capacity)
    views = router.list()
    assert all(v.inflight == 0 for v in views) and all(v.pooled for v in views)


def test_ties_spread_at_random_by_default(router: Router) -> None:
    """One request at a time over 100 idle targets: a name-ordered tie-break sent all of them
    to one target; a random one spreads them (2,000 picks: 20 each on average)."""
    targets = names(100)
    for t in targets:
        put(router, t, "READY")
    picked: Counter[str] = Counter()
    for _ in range(2000):
        t = router.pick()
        picked[t] += 1
        router.release(t)
    assert len(picked) == 100
    top20 = sum(n for _, n in picked.most_common(20))
    assert top20 < 0.35 * 2000, picked.most_common(5)  # 20 % if even; a name order: 100 %
    # and the least loaded still goes first: with one request held on each of 99, the 100th
    held = [router.pick() for _ in range(99)]
    [idle] = set(targets) - set(held)
    assert router.pick() == idle


def test_pack_fills_the_same_targets_and_leaves_the_others_idle(router: Router) -> None:
    targets = names(10)
    for t in targets:
        put(router, t, "READY", capacity=2)
    first = sorted(targets)[0]
    for _ in range(50):  # one request at a time: always the same target
        assert router.pick(policy="pack") == first
        router.release(first)
    # concurrent requests fill a target to its capacity before the next one gets any
    held = [router.pick(policy="pack") for _ in range(5)]
    order = sorted(targets)
    assert held == [order[0], order[0], order[1], order[1], order[2]]
    # the most loaded with room first, ties by name: order[0] and order[2] hold one each now
    router.release(order[0])
    assert router.pick(policy="pack") == order[0]
    router.release(order[1])
    router.release(order[1])  # order[1] is idle: order[2] holds one, so it takes the next
    assert router.pick(policy="pack") == order[2]
    packer = Router(router.client, router.service, policy="pack")
    assert packer.pick() == order[1]  # its own default policy: 0 and 2 are full, 1 is first


def test_a_target_whose_heartbeat_stops_leaves_the_pool_within_its_ttl(
    router: Router,
) -> None:
    """No pick needed: the other targets' heartbeats sweep it out once its TTL has run."""
    targets = names(20)
    silent, beating = targets[0], targets[1:]
    for t in beating:
        put(router, t, "READY")  # a minute: they cannot run out however slow this machine is
    start = time.monotonic()
    put(router, silent, "READY", ttl_ms=400)
    while time.monotonic() < start + 10 and silent in pooled(router):
        for t in beating:
            assert router._call("heartbeat", t, 1, 60_000) == 1
        time.sleep(0.02)
    assert silent not in pooled(router)
    assert time.monotonic() - start > 0.3  # not before its TTL
    assert pooled(router) == set(beating)
    assert all(router.pick() != silent for _ in range(50))
    view = next(v for v in router.list() if v.target == silent)
    assert not view.alive and not view.pooled and view.state == "READY"
    # it beats again: back in the pool
    assert router._call("heartbeat", silent, 1, 60_000) == 1
    assert silent in pooled(router)


def test_a_heartbeat_after_one_that_ran_out_puts_the_target_back(router: Router) -> None:
    """The paths where a target is turned away while its heartbeat has run out but no sweep
    has removed it yet (found in review): its next heartbeat must bring it back."""
    # full, then released after its heartbeat ran out: the release finds it not alive
    put(router, "full:1", "READY", ttl_ms=600, capacity=1)
    assert router.pick() == "full:1"
    time.sleep(0.8)
    router.release("full:1")
    assert "full:1" not in pooled(router)
    assert router._call("heartbeat", "full:1", 1, 60_000) == 1
    assert pooled(router) == {"full:1"}
    assert router.pick() == "full:1"
    router.release("full:1")
    # quarantined, and the quarantine ends while its heartbeat has run out
    put(router, "q:1", "READY", 2, ttl_ms=600)
    router.quarantine("q:1", base=0.1, limit=0.1)
    time.sleep(0.8)
    assert router.pick() == "full:1"  # the pick moves q:1's ended quarantine, finds it not alive
    assert "q:1" not in pooled(router)
    assert router._call("heartbeat", "q:1", 2, 60_000) == 1
    assert "q:1" in pooled(router)


def test_the_pool_is_exactly_the_targets_that_may_be_picked(router: Router) -> None:
    """2,000 random operations of every kind over 12 targets; after each, every target that
    may take a request is in the pool, and the pool holds nothing that is not READY,
    quarantined or full (one whose heartbeat ran out may linger until a sweep: never picked)."""
    rng = random.Random(52)
    targets = names(12)
    epochs = dict.fromkeys(targets, 0)
    held: list[str] = []
    for t in targets:
        epochs[t] += 1
        put(router, t, "READY", epochs[t], capacity=rng.choice([0, 1, 2]))
    for step in range(2000):
        t = rng.choice(targets)
        op = rng.random()
        if op < 0.25:
            try:
                held.append(router.pick(policy=rng.choice(["spread", "pack"])))
            except NotFound:
                pass
        elif op < 0.5 and held:
            router.release(held.pop(rng.randrange(len(held))), ok=rng.random() < 0.8)
        elif op < 0.6:
            epochs[t] += 1
            put(router, t, rng.choice(["READY", "READY", "DRAINING", "LOADING"]), epochs[t],
                ttl_ms=rng.choice([60_000, 60_000, 1]), capacity=rng.choice([0, 1, 2]))
        elif op < 0.7:
            router.quarantine(t, base=rng.choice([0.001, 60]), limit=60)
        elif op < 0.9:
            router._call("heartbeat", t, epochs[t], rng.choice([60_000, 60_000, 1]))
        else:
            time.sleep(0.002)  # heartbeats of 1 ms and quarantines of 1 ms run out
        views = {v.target: v for v in router.list()}
        in_pool = pooled(router)
        for v in views.values():
            cap = int(router.client.hget(router.keys[8], v.target) or 0)
            room = cap <= 0 or v.inflight < cap
            may = v.state == "READY" and v.alive and v.quarantine_ms == 0 and room
            if may:
                # eligible: in the pool, or its quarantine just ended and the next pick's
                # sweep brings it back
                ended = router.client.zscore(router.keys[5], v.target) is not None
                assert v.target in in_pool or ended, (step, v)
            if v.target in in_pool:
                assert v.state == "READY" and room, (step, v)
                assert v.quarantine_ms == 0, (step, v)


def test_an_expired_target_is_not_picked_even_before_the_sweep_reaches_it(
    router: Router,
) -> None:
    """Dozens of targets expiring at once (a node lost): the sweep moves 8 per call, and a
    pick checks what it takes, so none of them is ever picked."""
    t0 = int(router.client.time()[0]) * 1000
    dead = [f"dead-{i:02d}:1" for i in range(40)]
    for t in dead:
        put(router, t, "READY", ttl_ms=1_000)
    put(router, "live:1", "READY", ttl_ms=600_000)
    for i in range(3):
        assert router.pick(at_ms=t0 + 60_000 + i) == "live:1"
    assert pooled(router) == {"live:1"}


def test_list_is_paged_and_complete(router: Router) -> None:
    targets = names(1000)
    pipe = router.client.pipeline(transaction=False)
    for t in targets:
        doc = json.dumps({"target": t, "state": "READY"})
        pipe.fcall(function("update"), len(router.keys), *router.keys, t, 1, "READY", doc,
                   60_000, channel(router.service), 0)
    pipe.execute()
    pages: list[int] = []
    call = router._call

    def counting(name: str, *args: Any) -> Any:
        out = call(name, *args)
        if name == "list":
            pages.append((len(out) - 1) // 8)
        return out

    router._call = counting  # type: ignore[method-assign]
    views = router.list(page=100)
    assert sorted(v.target for v in views) == sorted(targets)
    assert len(pages) >= 8 and max(pages) <= 300, pages  # never the whole service at once
    assert all(v.state == "READY" and v.pooled and v.alive for v in views)


def test_registering_1000_targets_loads_the_library_once(tmp_path: Path) -> None:
    async def register(url: str) -> None:
        gate = asyncio.Semaphore(64)  # 64 probers starting at any one moment

        async def one(i: int) -> None:
            async with gate:
                # a TTL that outlives registering 1,000 on the slowest machine
                sink = RedisSink(url, "fleet", f"10.1.{i // 250}.{i % 250}:8000", ttl=600)
                try:
                    await sink.publish(Status(State.STARTING, epoch=1))
                    await sink.publish(Status(State.READY, epoch=2))
                    await sink.heartbeat()
                finally:
                    await sink.close()

        await asyncio.gather(*(one(i) for i in range(1000)))

    with start_redis(tmp_path) as url:
        client = redis.Redis.from_url(url, decode_responses=True)
        client.config_resetstat()
        asyncio.run(register(url))
        stats = client.info("commandstats").get("cmdstat_function|load", {})
        loads = int(stats.get("calls", 0)) - int(stats.get("failed_calls", 0))
        assert loads == 1, stats
        assert int(stats.get("calls", 0)) <= 64  # at most the first wave finds it missing
        libraries = [dict(zip(lib[::2], lib[1::2], strict=True)) for lib in client.function_list()]
        assert [lib["library_name"] for lib in libraries] == [LIBRARY_NAME]
        r = Router(client, "fleet")
        assert len(r.list()) == 1000 and all(v.pooled for v in r.list())
        client.close()


def test_quarantine_of_a_target_the_store_does_not_know(router: Router) -> None:
    """A pod that is gone refuses connections, so routers quarantine targets that were
    forgotten: that writes nothing (no strikes or deadlines left behind) and says so."""
    put(router, "a:1", "READY")
    assert router.forget("a:1")
    with pytest.raises(NotFound, match="not a target"):
        router.quarantine("a:1")
    assert router.release("a:1") == 0
    assert not any(router.client.exists(k) for k in router.keys)


def test_an_error_reply_keeps_the_connection(router: Router) -> None:
    from coldstart.errors import Unavailable

    put(router, "a:1", "READY")
    assert router.pick() == "a:1"
    pool = router.client.connection_pool
    [conn] = pool._available_connections
    with pytest.raises(Unavailable):
        router._call("quarantine", "a:1", "not-a-number", 1000)  # the Lua fails
    assert pool._available_connections == [conn] and conn._sock is not None
    assert router.release("a:1") == 0


def test_a_store_that_refuses_the_library_is_unavailable_for_the_sink(
    redis_server: str,
) -> None:
    """A user whose ACL forbids FUNCTION LOAD, on a store without the library: the prober
    is told the sink is unavailable (and retries), it does not crash on a raw Redis error."""
    from coldstart.errors import Unavailable

    admin = redis.Redis.from_url(redis_server)
    user, password = f"probe-{uuid.uuid4().hex[:6]}", "secret"
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"],
                      channels=["*"], commands=["+@all", "-function|load"])
    libraries = admin.function_dump()
    admin.function_flush()
    host_port = redis_server.split("//")[1]
    sink = RedisSink(f"redis://{user}:{password}@{host_port}", "svc-acl", "a:1")

    async def go() -> None:
        try:
            with pytest.raises(Unavailable, match="cannot load the coldstart functions"):
                await sink.publish(Status(State.READY, epoch=1))
        finally:
            await sink.close()

    try:
        asyncio.run(go())
    finally:
        admin.function_restore(libraries, "REPLACE")  # type: ignore[arg-type]  # a dump is bytes
        admin.acl_deluser(user)
        admin.close()
