"""Router side: routing state in Valkey/Redis, changed only by server-side functions.

One library (``FUNCTION LOAD``, Redis 7 functions; only commands Valkey also has) holds every
write, so each change is atomic and every router replica sees the same state. Keys of a service
share the hash tag ``{service}``, so in a cluster one service lives in one slot and every function
call names all of its keys::

    coldstart:{svc}:state       hash  target -> STARTING|LOADING|READY|…
    coldstart:{svc}:epoch       hash  target -> epoch of the last accepted update
    coldstart:{svc}:doc         hash  target -> JSON status document
    coldstart:{svc}:ready       zset  READY targets scored by requests in flight
    coldstart:{svc}:heartbeat   zset  target -> heartbeat deadline (server ms): a TTL per target
    coldstart:{svc}:quarantine  zset  target -> end of quarantine (server ms)
    coldstart:{svc}:strikes     hash  target -> consecutive connection failures
    coldstart:{svc}:inflight    hash  target -> requests in flight
    coldstart:{svc}:capacity    hash  target -> most requests in flight (absent/0: no limit)

Changes are published on ``coldstart:{svc}:changes`` (the JSON document). Deadlines use the
server's clock (``TIME``), so prober and router clocks never need to agree. ``pick``,
``quarantine`` and ``list`` take an optional last argument, a server time in ms to act at
instead of ``TIME``: tests drive time with it rather than sleeping (routers never pass it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from coldstart.config import ProbeTimingConfig
from coldstart.errors import InvalidArgument, NotFound, Unavailable

__all__ = [
    "LIBRARY",
    "LIBRARY_NAME",
    "Router",
    "TargetView",
    "channel",
    "keys",
    "load_library",
]

_T = ProbeTimingConfig()  # the defaults, written once in coldstart.config

LIBRARY_NAME = "coldstart_v1"

KEY_NAMES = (
    "state", "epoch", "doc", "ready", "heartbeat", "quarantine", "strikes", "inflight", "capacity",
)

LIBRARY = """#!lua name=coldstart_v1
-- KEYS (always all nine, same hash tag): state epoch doc ready heartbeat quarantine strikes
-- inflight capacity

-- at: an explicit time (ms) to act at, for tests that drive time; absent or '': TIME
local function now_ms(at)
  if at and at ~= '' then
    return tonumber(at)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function inflight(keys, target)
  return tonumber(redis.call('HGET', keys[8], target) or '0')
end

-- update(target, epoch, state, doc, ttl_ms, channel, capacity): 1 applied, 0 stale epoch
local function update(keys, args)
  local target, epoch, state = args[1], tonumber(args[2]), args[3]
  local seen = redis.call('HGET', keys[2], target)
  if seen and tonumber(seen) >= epoch then
    return 0
  end
  local before = redis.call('HGET', keys[1], target)
  redis.call('HSET', keys[2], target, args[2])
  redis.call('HSET', keys[1], target, state)
  redis.call('HSET', keys[3], target, args[4])
  redis.call('ZADD', keys[5], now_ms() + tonumber(args[5]), target)
  if tonumber(args[7]) > 0 then
    redis.call('HSET', keys[9], target, args[7])
  else
    redis.call('HDEL', keys[9], target)
  end
  if state == 'READY' then
    if before ~= 'READY' then
      -- the target's own prober vouches for it again: a fresh start, no quarantine
      redis.call('ZREM', keys[6], target)
      redis.call('HDEL', keys[7], target)
    end
    redis.call('ZADD', keys[4], inflight(keys, target), target)
  else
    redis.call('ZREM', keys[4], target)
  end
  redis.call('PUBLISH', args[6], args[4])
  return 1
end

-- heartbeat(target, epoch, ttl_ms): 1 ok, 0 a newer writer owns the target, -1 unknown target
local function heartbeat(keys, args)
  local target = args[1]
  local seen = redis.call('HGET', keys[2], target)
  if not seen then
    return -1
  end
  if tonumber(seen) ~= tonumber(args[2]) then
    return 0
  end
  redis.call('ZADD', keys[5], now_ms() + tonumber(args[3]), target)
  if redis.call('HGET', keys[1], target) == 'READY' then
    redis.call('ZADD', keys[4], inflight(keys, target), target)
  end
  return 1
end

-- pick([at]): the READY, live, non-quarantined target with the fewest requests in flight and
-- room for one more; its count goes up by one in the same call. nil when there is none.
local function pick(keys, args)
  local now = now_ms(args[1])
  local ready = redis.call('ZRANGE', keys[4], 0, -1, 'WITHSCORES')
  for i = 1, #ready, 2 do
    local target, load = ready[i], tonumber(ready[i + 1])
    local deadline = redis.call('ZSCORE', keys[5], target)
    if not deadline or tonumber(deadline) <= now then
      -- heartbeat expired: out of the ready set until the next heartbeat brings it back
      redis.call('ZREM', keys[4], target)
    else
      local until_ms = redis.call('ZSCORE', keys[6], target)
      local cap = tonumber(redis.call('HGET', keys[9], target) or '0')
      if (not until_ms or tonumber(until_ms) <= now) and (cap <= 0 or load < cap) then
        redis.call('ZINCRBY', keys[4], 1, target)
        redis.call('HINCRBY', keys[8], target, 1)
        return target
      end
    end
  end
  return false
end

-- release(target, ok): one request finished; ok=1 also clears the target's strikes.
local function release(keys, args)
  local target = args[1]
  local n = redis.call('HINCRBY', keys[8], target, -1)
  if n < 0 then
    n = 0
    redis.call('HSET', keys[8], target, 0)
  end
  if redis.call('ZSCORE', keys[4], target) then
    redis.call('ZADD', keys[4], n, target)
  end
  if args[2] == '1' then
    redis.call('HDEL', keys[7], target)
  end
  return n
end

-- quarantine(target, base_ms, max_ms, [at]): backoff doubles with each consecutive strike
local function quarantine(keys, args)
  local target = args[1]
  local strikes = redis.call('HINCRBY', keys[7], target, 1)
  local backoff = math.min(tonumber(args[2]) * 2 ^ (strikes - 1), tonumber(args[3]))
  backoff = math.floor(backoff)
  redis.call('ZADD', keys[6], now_ms(args[4]) + backoff, target)
  return backoff
end

-- forget(target): remove every trace of a target
local function forget(keys, args)
  local n = 0
  for i = 1, 9 do
    if i == 4 or i == 5 or i == 6 then
      n = n + redis.call('ZREM', keys[i], args[1])
    else
      n = n + redis.call('HDEL', keys[i], args[1])
    end
  end
  return n
end

-- list([at]): target, state, inflight, heartbeat ms left, quarantine ms left, strikes, doc
local function list(keys, args)
  local now = now_ms(args[1])
  local out = {}
  local states = redis.call('HGETALL', keys[1])
  for i = 1, #states, 2 do
    local target = states[i]
    local hb = redis.call('ZSCORE', keys[5], target)
    local q = redis.call('ZSCORE', keys[6], target)
    table.insert(out, target)
    table.insert(out, states[i + 1])
    table.insert(out, inflight(keys, target))
    table.insert(out, hb and (tonumber(hb) - now) or -1)
    table.insert(out, q and math.max(0, tonumber(q) - now) or 0)
    table.insert(out, tonumber(redis.call('HGET', keys[7], target) or '0'))
    table.insert(out, redis.call('HGET', keys[3], target) or '{}')
  end
  return out
end

redis.register_function('coldstart_update', update)
redis.register_function('coldstart_heartbeat', heartbeat)
redis.register_function('coldstart_pick', pick)
redis.register_function('coldstart_release', release)
redis.register_function('coldstart_quarantine', quarantine)
redis.register_function('coldstart_forget', forget)
redis.register_function{function_name='coldstart_list', callback=list, flags={'no-writes'}}
"""


def _check_service(service: str) -> None:
    if not service or any(c in service for c in "{}\n\r ") or len(service) > 200:
        raise InvalidArgument(
            f"bad service name {service!r}: 1-200 characters, no braces, spaces or newlines"
        )


def keys(service: str) -> list[str]:
    """The nine keys of a service, in the order the library's functions expect.

    >>> keys("llama")[3]
    'coldstart:{llama}:ready'
    """
    _check_service(service)
    return [f"coldstart:{{{service}}}:{name}" for name in KEY_NAMES]


def channel(service: str) -> str:
    """The pub/sub channel that carries each change of a service's targets.

    >>> channel("llama")
    'coldstart:{llama}:changes'
    """
    _check_service(service)
    return f"coldstart:{{{service}}}:changes"


def load_library(client: Any) -> None:
    """``FUNCTION LOAD REPLACE`` the library with a sync redis-py client (idempotent).

    >>> # load_library(redis.Redis.from_url("redis://127.0.0.1:6379", socket_timeout=1))
    """
    import redis

    try:
        client.function_load(LIBRARY, replace=True)
    except redis.RedisError as exc:
        raise Unavailable(f"cannot load the coldstart functions into Redis: {exc}") from exc


def _at(at_ms: int | None) -> tuple[str, ...]:
    """The optional time argument of a library function: none, or ``at_ms`` as an integer."""
    return () if at_ms is None else (str(int(at_ms)),)


@dataclass(frozen=True)
class TargetView:
    """One target as ``list`` sees it. ``heartbeat_ms`` < 0: expired or never sent."""

    target: str
    state: str
    inflight: int
    heartbeat_ms: int
    quarantine_ms: int
    strikes: int
    doc: dict[str, Any]

    @property
    def alive(self) -> bool:
        return self.heartbeat_ms > 0


class Router:
    """Pick, release and quarantine the targets of one service (sync redis-py client).

    >>> # r = Router.connect("redis://127.0.0.1:6379/0", "llama")
    >>> # target = r.pick(); ...; r.release(target)
    """

    def __init__(self, client: Any, service: str, url: str | None = None) -> None:
        self.client = client
        self.service = service
        self.url = url                  # for error messages
        self.keys = keys(service)

    @classmethod
    def connect(cls, url: str, service: str, timeout: float = _T.router_timeout) -> Router:
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
        return cls(client, service, url)

    def _call(self, function: str, *args: object) -> Any:
        import redis

        for attempt in (0, 1):
            try:
                return self.client.fcall(function, len(self.keys), *self.keys, *args)
            except redis.ResponseError as exc:
                if attempt == 0 and "function not found" in str(exc).lower():
                    load_library(self.client)  # first use, or the server lost its functions
                    continue
                raise Unavailable(f"{function} failed: {exc}") from exc
            except redis.TimeoutError as exc:
                raise Unavailable(f"{function}: Redis did not answer in time: {exc}") from exc
            except redis.ConnectionError as exc:
                where = self.url or "Redis"
                raise Unavailable(f"{function}: cannot reach {where}: {exc} (is Valkey/Redis "
                                  "running there? see --redis or $COLDSTART_REDIS)") from exc
            except redis.RedisError as exc:
                raise Unavailable(f"{function}: {exc}") from exc
        raise AssertionError("unreachable")

    def pick(self, *, at_ms: int | None = None) -> str:
        """Take the least-loaded READY target (its in-flight count goes up by one).

        Raises :class:`NotFound` when no target can take the request. ``at_ms``: decide as if
        the store's clock read this (ms), for tests that drive time; by default the store's
        ``TIME``.
        """
        target = self._call("coldstart_pick", *_at(at_ms))
        if not target:
            raise NotFound(f"no READY target with room in service {self.service!r}")
        return str(target)

    def release(self, target: str, ok: bool = True) -> int:
        """One request to ``target`` is over; returns its in-flight count now."""
        return int(self._call("coldstart_release", target, "1" if ok else "0"))

    def quarantine(self, target: str, base: float = 1.0, limit: float = 60.0, *,
                   at_ms: int | None = None) -> float:
        """Keep ``target`` out of picks after a connection failure; returns the backoff (s).

        The backoff doubles with each consecutive strike (``base``, 2 * ``base``, … up to
        ``limit``); a successful :meth:`release` or the target turning READY again clears it.
        The quarantine runs from ``at_ms`` (as :meth:`pick`), by default from now.
        """
        if base <= 0 or limit < base:
            raise InvalidArgument("quarantine needs 0 < base <= limit")
        ms = self._call("coldstart_quarantine", target, int(base * 1000), int(limit * 1000),
                        *_at(at_ms))
        return int(ms) / 1000.0

    def forget(self, target: str) -> bool:
        """Remove a target entirely (gone for good). True if anything was removed."""
        return int(self._call("coldstart_forget", target)) > 0

    def list(self, *, at_ms: int | None = None) -> list[TargetView]:
        """Every target the service knows, sorted by name; times left as of ``at_ms`` (as
        :meth:`pick`), by default now."""
        flat = self._call("coldstart_list", *_at(at_ms))
        views = []
        for i in range(0, len(flat), 7):
            try:
                doc = json.loads(flat[i + 6])
            except ValueError:
                doc = {}
            views.append(TargetView(
                str(flat[i]), str(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]),
                int(flat[i + 4]), int(flat[i + 5]), doc if isinstance(doc, dict) else {},
            ))
        return sorted(views, key=lambda v: v.target)
