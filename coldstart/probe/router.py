"""Router side: routing state in Valkey/Redis, changed only by server-side functions.

One library (``FUNCTION LOAD``, Redis 7 functions; only commands Valkey also has) holds every
write, so each change is atomic and every router replica sees the same state. Keys of a service
share the hash tag ``{service}``, so in a cluster one service lives in one slot and every function
call names all of its keys::

    coldstart:v2:{svc}:state       hash  target -> STARTING|LOADING|READY|…
    coldstart:v2:{svc}:epoch       hash  target -> epoch of the last accepted update
    coldstart:v2:{svc}:doc         hash  target -> JSON status document
    coldstart:v2:{svc}:pool        zset  targets that may take a request now -> requests in flight
    coldstart:v2:{svc}:heartbeat   zset  target -> heartbeat deadline (server ms): a TTL per target
    coldstart:v2:{svc}:quarantine  zset  target -> end of quarantine (server ms)
    coldstart:v2:{svc}:strikes     hash  target -> consecutive connection failures
    coldstart:v2:{svc}:inflight    hash  target -> requests in flight
    coldstart:v2:{svc}:capacity    hash  target -> most requests in flight (absent/0: no limit)

The pool holds only targets that may be picked: READY, heartbeat alive, not quarantined and
below capacity. Every function keeps it so (a target leaves when it is quarantined, fills up or
stops being READY, and comes back when it is released, beats again or its quarantine ends), so
a pick reads a few entries at known ranks: O(log n) in the service's targets. Heartbeats run
out without any call, so they are checked lazily: a pick checks the target it takes (one whose
heartbeat ran out is dropped, never picked), bounded sweeps of at most 8 entries move the others
out (``update`` always, one ``pick`` or ``heartbeat`` in 16), and each heartbeat of a target that
is out of the pool puts it back if it may take a request. Each ``pick`` also moves up to 8
quarantines that have ended back in, and drops up to 256 entries whose heartbeat ran out before
it reports that no target can take a request.

Policies (``pick``'s first argument): ``spread`` (default) takes the target with the fewest
requests in flight and breaks ties at random (uniformly: a random rank among the k least
loaded), as a load balancer does; ``pack`` takes the one with the most in flight that still has
room, ties by name, so traffic fills the same targets first and the others stay idle (to scale
down): it is for targets with a capacity, since a target without one always has room and would
take every request.

The version in the key names keeps the state of different releases apart: a prober still on an
older release writes keys these routers never read, so its target is simply not theirs (rather
than a DRAINING target left in a pool it cannot see). Changes are published on
``coldstart:{svc}:changes`` (the JSON document, the same for every release). Deadlines use the
server's clock (``TIME``), so prober and router clocks never need to agree. ``pick``,
``quarantine`` and ``list`` take an optional last argument, a server time in ms to act at
instead of ``TIME``, for tests that drive time (routers never pass it). ``list`` returns one
page (``HSCAN``), so no call blocks the store for the whole service.

The library is versioned in its name and its functions' names (``coldstart_v2``,
``coldstart_v2_pick``, …), so stores shared with older releases keep both; it is loaded once
per store, by whichever client first finds it missing. Change the version with the Lua.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from coldstart.config import ProbeTimingConfig
from coldstart.errors import InvalidArgument, NotFound, Unavailable

__all__ = [
    "LIBRARY",
    "LIBRARY_NAME",
    "POLICIES",
    "Router",
    "TargetView",
    "channel",
    "function",
    "keys",
    "load_library",
    "loaded_by_another",
    "missing_library",
]

_T = ProbeTimingConfig()  # the defaults, written once in coldstart.config

LIBRARY_NAME = "coldstart_v2"

KEY_NAMES = (
    "state", "epoch", "doc", "pool", "heartbeat", "quarantine", "strikes", "inflight", "capacity",
)

POLICIES = ("spread", "pack")

LIST_PAGE = 256  # targets per list call: each call holds the store for one page only

LIBRARY = """#!lua name=coldstart_v2
-- KEYS, always all nine and in this order (one hash tag):
local STATE, EPOCH, DOC, POOL, HEARTBEAT, QUARANTINE, STRIKES, INFLIGHT, CAPACITY =
  1, 2, 3, 4, 5, 6, 7, 8, 9
-- Invariant: POOL holds every target that is READY, heartbeat alive, not quarantined and below
-- its capacity, scored by requests in flight, and no target that is not READY, quarantined or
-- full. Heartbeats run out without any call, so they alone are checked lazily: a pick checks the
-- one it takes, sweeps move those that ran out (heartbeat set and pool both) in bounded steps of
-- SWEEP, and every heartbeat of a target out of the pool checks whether it may be back.
local SWEEP = 8
-- Of the heartbeats, one in SWEEP_EVERY also sweeps: a fleet's beats keep the pool clean at a
-- small fraction of their cost.
local SWEEP_EVERY = 16
-- Stale entries a pick drops before it gives up (a lost node's targets, not yet swept).
local STALE = 256

-- at: an explicit time (ms) to act at, for tests that drive time; absent or '': TIME
local function now_ms(at)
  if at and at ~= '' then
    return tonumber(at)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function inflight(keys, target)
  return tonumber(redis.call('HGET', keys[INFLIGHT], target) or '0')
end

local function capacity(keys, target)
  return tonumber(redis.call('HGET', keys[CAPACITY], target) or '0')
end

-- may take one more request: READY, heartbeat alive, not quarantined, below its capacity
local function eligible(keys, target, now, n)
  if redis.call('HGET', keys[STATE], target) ~= 'READY' then
    return false
  end
  local hb = redis.call('ZSCORE', keys[HEARTBEAT], target)
  if not hb or tonumber(hb) <= now then
    return false
  end
  local q = redis.call('ZSCORE', keys[QUARANTINE], target)
  if q and tonumber(q) > now then
    return false
  end
  local cap = capacity(keys, target)
  return cap <= 0 or n < cap
end

-- into the pool, scored by its n requests in flight, if the target may take a request; else out
local function place(keys, target, now, n)
  if eligible(keys, target, now, n) then
    redis.call('ZADD', keys[POOL], n, target)
  else
    redis.call('ZREM', keys[POOL], target)
  end
end

-- heartbeats that ran out: out of the heartbeat set and the pool until the target beats again
local function sweep_heartbeats(keys, now)
  local dead = redis.call('ZRANGE', keys[HEARTBEAT], '-inf', now, 'BYSCORE', 'LIMIT', 0, SWEEP)
  for _, target in ipairs(dead) do
    redis.call('ZREM', keys[HEARTBEAT], target)
    redis.call('ZREM', keys[POOL], target)
  end
end

-- quarantines that ended: back in the pool if the target may take a request
local function sweep_quarantines(keys, now)
  local back = redis.call('ZRANGE', keys[QUARANTINE], '-inf', now, 'BYSCORE', 'LIMIT', 0, SWEEP)
  for _, target in ipairs(back) do
    redis.call('ZREM', keys[QUARANTINE], target)
    place(keys, target, now, inflight(keys, target))
  end
end

-- update(target, epoch, state, doc, ttl_ms, channel, capacity): 1 applied, 0 stale epoch
local function update(keys, args)
  local target, epoch, state = args[1], tonumber(args[2]), args[3]
  local seen = redis.call('HGET', keys[EPOCH], target)
  if seen and tonumber(seen) >= epoch then
    return 0
  end
  local now = now_ms()
  local before = redis.call('HGET', keys[STATE], target)
  redis.call('HSET', keys[EPOCH], target, args[2])
  redis.call('HSET', keys[STATE], target, state)
  redis.call('HSET', keys[DOC], target, args[4])
  redis.call('ZADD', keys[HEARTBEAT], now + tonumber(args[5]), target)
  if tonumber(args[7]) > 0 then
    redis.call('HSET', keys[CAPACITY], target, args[7])
  else
    redis.call('HDEL', keys[CAPACITY], target)
  end
  if state == 'READY' and before ~= 'READY' then
    -- the target's own prober vouches for it again: a fresh start, no quarantine
    redis.call('ZREM', keys[QUARANTINE], target)
    redis.call('HDEL', keys[STRIKES], target)
  end
  place(keys, target, now, inflight(keys, target))
  sweep_heartbeats(keys, now)
  redis.call('PUBLISH', args[6], args[4])
  return 1
end

-- heartbeat(target, epoch, ttl_ms): 1 ok, 0 a newer writer owns the target, -1 unknown target
local function heartbeat(keys, args)
  local target = args[1]
  local seen = redis.call('HGET', keys[EPOCH], target)
  if not seen then
    return -1
  end
  if tonumber(seen) ~= tonumber(args[2]) then
    return 0
  end
  local now = now_ms()
  redis.call('ZADD', keys[HEARTBEAT], now + tonumber(args[3]), target)
  if not redis.call('ZSCORE', keys[POOL], target) then
    -- out of the pool (full, not READY, quarantined, or turned away while its last heartbeat
    -- had run out): back in if it may take a request now. Every beat checks, so no path can
    -- strand a target that may be picked for longer than one heartbeat.
    place(keys, target, now, inflight(keys, target))
  end
  if math.random(SWEEP_EVERY) == 1 then
    sweep_heartbeats(keys, now)
  end
  return 1
end

-- the pool's candidate under a policy, each step O(log n). spread: the fewest in flight, one of
-- them at random (the k least loaded are ranks 0..k-1); pack: the most in flight, the first by
-- name among them
local function candidate(keys, policy)
  if policy == 'pack' then
    local last = redis.call('ZRANGE', keys[POOL], -1, -1, 'WITHSCORES')
    if not last[1] then
      return nil
    end
    return redis.call('ZRANGE', keys[POOL], last[2], last[2], 'BYSCORE', 'LIMIT', 0, 1)[1]
  end
  local first = redis.call('ZRANGE', keys[POOL], 0, 0, 'WITHSCORES')
  if not first[1] then
    return nil
  end
  local k = redis.call('ZCOUNT', keys[POOL], first[2], first[2])
  if k <= 1 then
    return first[1]
  end
  local i = math.random(0, k - 1)
  return redis.call('ZRANGE', keys[POOL], i, i)[1]
end

-- pick(policy, [at]): a target that may take one more request, its count up by one in the same
-- call; nil when there is none. policy 'spread': the fewest in flight, ties at random; 'pack':
-- the most in flight that still has room, ties by name. O(log n): the pool holds only targets
-- that may be picked, so its candidate is the answer unless its heartbeat has just run out.
local function pick(keys, args)
  local now = now_ms(args[2])
  sweep_quarantines(keys, now)
  if math.random(SWEEP_EVERY) == 1 then
    sweep_heartbeats(keys, now)
  end
  for _ = 1, STALE do
    local target = candidate(keys, args[1])
    if not target then
      return false
    end
    local hb = redis.call('ZSCORE', keys[HEARTBEAT], target)
    if hb and tonumber(hb) > now then
      local n = redis.call('HINCRBY', keys[INFLIGHT], target, 1)
      local cap = capacity(keys, target)
      if cap > 0 and n >= cap then
        redis.call('ZREM', keys[POOL], target)  -- full: back when one of its requests is released
      else
        redis.call('ZADD', keys[POOL], n, target)
      end
      return target
    end
    -- its heartbeat ran out and no sweep had reached it yet: out until it beats again, and
    -- others that ran out with it (a lost node) with it
    redis.call('ZREM', keys[HEARTBEAT], target)
    redis.call('ZREM', keys[POOL], target)
    sweep_heartbeats(keys, now)
  end
  return false
end

-- release(target, ok): one request finished; ok=1 also clears the target's strikes.
local function release(keys, args)
  local target = args[1]
  local pooled = redis.call('ZSCORE', keys[POOL], target)
  if not pooled and redis.call('HEXISTS', keys[STATE], target) == 0 then
    return 0  -- forgotten meanwhile: nothing to count
  end
  local n = redis.call('HINCRBY', keys[INFLIGHT], target, -1)
  if n < 0 then
    n = 0
    redis.call('HSET', keys[INFLIGHT], target, 0)
  end
  if args[2] == '1' then
    redis.call('HDEL', keys[STRIKES], target)
  end
  if pooled then
    redis.call('ZADD', keys[POOL], n, target)  -- it may still be picked: only its count changed
  else
    place(keys, target, now_ms(), n)  -- it was full, or out: it may be back
  end
  return n
end

-- quarantine(target, base_ms, max_ms, [at]): out of the pool; the backoff doubles with each
-- consecutive strike. -1: not a target (forgotten, or never known): nothing is written.
local function quarantine(keys, args)
  local target = args[1]
  if redis.call('HEXISTS', keys[STATE], target) == 0 then
    return -1
  end
  local strikes = redis.call('HINCRBY', keys[STRIKES], target, 1)
  local backoff = math.min(tonumber(args[2]) * 2 ^ (strikes - 1), tonumber(args[3]))
  backoff = math.floor(backoff)
  redis.call('ZADD', keys[QUARANTINE], now_ms(args[4]) + backoff, target)
  redis.call('ZREM', keys[POOL], target)
  return backoff
end

-- forget(target): remove every trace of a target
local function forget(keys, args)
  local n = 0
  for i = 1, #keys do
    if i == POOL or i == HEARTBEAT or i == QUARANTINE then
      n = n + redis.call('ZREM', keys[i], args[1])
    else
      n = n + redis.call('HDEL', keys[i], args[1])
    end
  end
  return n
end

-- list(cursor, count, [at]): one page of targets (HSCAN of the state hash, about count of
-- them), never the whole service in one call. Returns the next cursor ('0': done), then per
-- target: target, state, inflight, heartbeat ms left, quarantine ms left, strikes, doc, pooled
local function list(keys, args)
  local now = now_ms(args[3])
  local page = redis.call('HSCAN', keys[STATE], args[1], 'COUNT', tonumber(args[2]))
  local out = {page[1]}
  local states = page[2]
  for i = 1, #states, 2 do
    local target = states[i]
    local hb = redis.call('ZSCORE', keys[HEARTBEAT], target)
    local q = redis.call('ZSCORE', keys[QUARANTINE], target)
    table.insert(out, target)
    table.insert(out, states[i + 1])
    table.insert(out, inflight(keys, target))
    table.insert(out, hb and (tonumber(hb) - now) or -1)
    table.insert(out, q and math.max(0, tonumber(q) - now) or 0)
    table.insert(out, tonumber(redis.call('HGET', keys[STRIKES], target) or '0'))
    table.insert(out, redis.call('HGET', keys[DOC], target) or '{}')
    table.insert(out, redis.call('ZSCORE', keys[POOL], target) and 1 or 0)
  end
  return out
end

redis.register_function('coldstart_v2_update', update)
redis.register_function('coldstart_v2_heartbeat', heartbeat)
redis.register_function('coldstart_v2_pick', pick)
redis.register_function('coldstart_v2_release', release)
redis.register_function('coldstart_v2_quarantine', quarantine)
redis.register_function('coldstart_v2_forget', forget)
redis.register_function{function_name='coldstart_v2_list', callback=list, flags={'no-writes'}}
"""


def _check_service(service: str) -> None:
    if not service or any(c in service for c in "{}\n\r ") or len(service) > 200:
        raise InvalidArgument(
            f"bad service name {service!r}: 1-200 characters, no braces, spaces or newlines"
        )


def keys(service: str) -> list[str]:
    """The nine keys of a service, in the order the library's functions expect.

    >>> keys("llama")[3]
    'coldstart:v2:{llama}:pool'
    """
    _check_service(service)
    return [f"coldstart:v2:{{{service}}}:{name}" for name in KEY_NAMES]


def channel(service: str) -> str:
    """The pub/sub channel that carries each change of a service's targets.

    >>> channel("llama")
    'coldstart:{llama}:changes'
    """
    _check_service(service)
    return f"coldstart:{{{service}}}:changes"


def function(name: str) -> str:
    """The library's name for one of its functions.

    >>> function("pick")
    'coldstart_v2_pick'
    """
    return f"{LIBRARY_NAME}_{name}"


def missing_library(exc: Exception) -> bool:
    """The store answered that a function of the library does not exist (never loaded, or
    flushed): load it and call again."""
    return "function not found" in str(exc).lower()


def loaded_by_another(exc: Exception) -> bool:
    """``FUNCTION LOAD`` failed only because another client loaded the library first."""
    return "already exists" in str(exc).lower()


def load_library(client: Any) -> None:
    """``FUNCTION LOAD`` the library with a sync redis-py client, unless it is there already.

    Without ``REPLACE``: when many clients find it missing at once (a fleet starting against a
    fresh store), one loads it and the others are told it exists, which is what they wanted.

    >>> # load_library(redis.Redis.from_url("redis://127.0.0.1:6379", socket_timeout=1))
    """
    import redis

    try:
        client.function_load(LIBRARY)
    except redis.ResponseError as exc:
        if not loaded_by_another(exc):
            raise Unavailable(f"cannot load the coldstart functions into Redis: {exc}") from exc
    except redis.RedisError as exc:
        raise Unavailable(f"cannot load the coldstart functions into Redis: {exc}") from exc


def _text(value: object) -> str:
    """A reply as text, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


def resp_bulk(value: object) -> bytes:
    raw = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


def resp_head(count: int, *parts: object) -> bytes:
    r"""The start of a RESP command of ``count`` parts: its header and its first ``parts``
    (all of them when ``count == len(parts)``).

    >>> resp_head(3, "FCALL", "f") + resp_bulk(0)
    b'*3\r\n$5\r\nFCALL\r\n$1\r\nf\r\n$1\r\n0\r\n'
    """
    return b"*%d\r\n" % count + b"".join(resp_bulk(p) for p in parts)


def _at(at_ms: int | None) -> tuple[str, ...]:
    """The optional time argument of a library function: none, or ``at_ms`` as an integer."""
    return () if at_ms is None else (str(int(at_ms)),)


def _policy(policy: str) -> str:
    if policy not in POLICIES:
        raise InvalidArgument(f"unknown policy {policy!r}: use {' or '.join(POLICIES)}")
    return policy


@dataclass(frozen=True)
class TargetView:
    """One target as ``list`` sees it. ``heartbeat_ms`` < 0: expired or never sent.
    ``pooled``: in the pool, so a pick may take it now."""

    target: str
    state: str
    inflight: int
    heartbeat_ms: int
    quarantine_ms: int
    strikes: int
    doc: dict[str, Any]
    pooled: bool = False

    @property
    def alive(self) -> bool:
        return self.heartbeat_ms > 0


class Router:
    """Pick, release and quarantine the targets of one service (sync redis-py client).

    ``policy``: how :meth:`pick` chooses, ``spread`` (the fewest requests in flight, ties at
    random) or ``pack`` (the most in flight that still has room, ties by name; for targets with
    a capacity, e.g. concurrency-1 GPU pods, so that the others stay idle and can scale down).

    >>> # r = Router.connect("redis://127.0.0.1:6379/0", "llama")
    >>> # target = r.pick(); ...; r.release(target)
    """

    def __init__(self, client: Any, service: str, url: str | None = None, *,
                 policy: str = "spread") -> None:
        self.client = client
        self.service = service
        self.url = url                  # for error messages
        self.keys = keys(service)
        self.policy = _policy(policy)
        self._heads: dict[tuple[str, int], bytes] = {}

    @classmethod
    def connect(cls, url: str, service: str, timeout: float = _T.router_timeout, *,
                policy: str = "spread") -> Router:
        """A router on its own connection pool; every call has ``timeout`` seconds."""
        import redis

        if url.startswith("valkey://"):
            url = "redis://" + url[len("valkey://"):]
        try:
            client = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout,
                decode_responses=True,
            )
        except ValueError as exc:
            raise InvalidArgument(f"bad Redis URL {url!r}: {exc}") from exc
        return cls(client, service, url, policy=policy)

    def _call(self, name: str, *args: object) -> Any:
        import redis

        fn = function(name)
        for attempt in (0, 1):
            try:
                return self._fcall(fn, args)
            except redis.ResponseError as exc:
                if attempt == 0 and missing_library(exc):
                    load_library(self.client)  # first use, or the server lost its functions
                    continue
                raise Unavailable(f"{fn} failed: {exc}") from exc
            except redis.TimeoutError as exc:
                raise Unavailable(f"{fn}: Redis did not answer in time: {exc}") from exc
            except redis.ConnectionError as exc:
                where = self.url or "Redis"
                raise Unavailable(f"{fn}: cannot reach {where}: {exc} (is Valkey/Redis "
                                  "running there? see --redis or $COLDSTART_REDIS)") from exc
            except redis.RedisError as exc:
                raise Unavailable(f"{fn}: {exc}") from exc
        raise AssertionError("unreachable")

    def _fcall(self, fn: str, args: tuple[object, ...]) -> Any:
        """One ``FCALL`` on a pooled connection, its name and keys encoded once per router.

        A router calls twice per request (pick, release), so the client's cost per call is the
        router's throughput: this sends the bytes redis-py would, at about half its CPU. It
        does not retry: a pick or release is not idempotent, and a pooled connection that went
        stale is reconnected by the pool before it is handed out. Clients without a plain
        connection pool (cluster, single-connection) take redis-py's own path.
        """
        import redis

        client = self.client
        pool = getattr(client, "connection_pool", None)
        if pool is None or getattr(client, "connection", None) is not None:
            return client.fcall(fn, len(self.keys), *self.keys, *args)
        head = self._heads.get((fn, len(args)))
        if head is None:
            head = resp_head(3 + len(self.keys) + len(args), "FCALL", fn, len(self.keys),
                              *self.keys)
            self._heads[(fn, len(args))] = head
        packed = head + b"".join(resp_bulk(a) for a in args)
        conn = pool.get_connection()
        try:
            conn.send_packed_command([packed])
            return conn.read_response()
        except redis.ResponseError:
            raise  # an error reply is a whole reply: the connection is still in step
        except BaseException:
            conn.disconnect()  # a reply may still be on its way: this connection is spent
            raise
        finally:
            pool.release(conn)

    def pick(self, *, policy: str | None = None, at_ms: int | None = None) -> str:
        """Take a READY target with room (its in-flight count goes up by one), chosen by
        ``policy`` (default: the router's).

        Raises :class:`NotFound` when no target can take the request. ``at_ms``: decide as if
        the store's clock read this (ms), for tests that drive time; by default the store's
        ``TIME``.
        """
        chosen = self.policy if policy is None else _policy(policy)
        target = self._call("pick", chosen, *_at(at_ms))
        if not target:
            raise NotFound(f"no READY target with room in service {self.service!r}")
        return _text(target)

    def release(self, target: str, ok: bool = True) -> int:
        """One request to ``target`` is over; returns its in-flight count now (0 for a target
        the store does not know any more).

        ``ok``: the request reached the target, which clears its strikes (the next quarantine
        starts again from ``base``); a quarantine already running still runs to its end.
        """
        return int(self._call("release", target, "1" if ok else "0"))

    def quarantine(self, target: str, base: float = 1.0, limit: float = 60.0, *,
                   at_ms: int | None = None) -> float:
        """Keep ``target`` out of picks after a connection failure; returns the backoff (s).

        The backoff doubles with each consecutive strike (``base``, 2 * ``base``, … up to
        ``limit``). A successful :meth:`release` clears the strikes, so the next quarantine is
        ``base`` again; the quarantine itself ends when its backoff has passed, or sooner when
        the target's prober reports it READY again after another state (a fresh start).
        The quarantine runs from ``at_ms`` (as :meth:`pick`), by default from now. Raises
        :class:`NotFound` for a target the store does not know (gone, or forgotten).
        """
        if base <= 0 or limit < base:
            raise InvalidArgument("quarantine needs 0 < base <= limit")
        ms = int(self._call("quarantine", target, int(base * 1000), int(limit * 1000),
                            *_at(at_ms)))
        if ms < 0:
            raise NotFound(f"{target} is not a target of {self.service}")
        return ms / 1000.0

    def forget(self, target: str) -> bool:
        """Remove a target entirely (gone for good). True if anything was removed."""
        return int(self._call("forget", target)) > 0

    def scan(self, *, page: int = LIST_PAGE, at_ms: int | None = None) -> Iterator[TargetView]:
        """Every target the service knows, a page of about ``page`` per call to the store
        (``HSCAN``), so the store is never held for the whole service; times left as of
        ``at_ms`` (as :meth:`pick`), by default now. A target that stays for the whole scan is
        seen once; one added or removed meanwhile may or may not be."""
        if page < 1:
            raise InvalidArgument("a list page holds at least one target")
        cursor, seen = "0", set()
        while True:
            flat = [_text(x) if isinstance(x, bytes) else x
                    for x in self._call("list", cursor, page, *_at(at_ms))]
            cursor = str(flat[0])
            for i in range(1, len(flat), 8):
                target = str(flat[i])
                if target in seen:
                    continue  # HSCAN may return a target twice while the hash is resized
                seen.add(target)
                try:
                    doc = json.loads(flat[i + 6])
                except ValueError:
                    doc = {}
                yield TargetView(
                    target, str(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]),
                    int(flat[i + 4]), int(flat[i + 5]), doc if isinstance(doc, dict) else {},
                    bool(int(flat[i + 7])),
                )
            if cursor == "0":
                return

    def list(self, *, page: int = LIST_PAGE, at_ms: int | None = None) -> list[TargetView]:
        """Every target the service knows, sorted by name (:meth:`scan`, collected)."""
        return sorted(self.scan(page=page, at_ms=at_ms), key=lambda v: v.target)
