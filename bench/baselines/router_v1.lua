#!lua name=coldstart_v1
-- The router library before issue 52 (coldstart/probe/router.py at bcee90c), kept verbatim as
-- the baseline of bench/bench_router.py. Not loaded by coldstart itself.
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
