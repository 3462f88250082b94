"""Server-side scripts of :class:`kvindex.redis_index.RedisKVBlockIndex` (Lua, run with EVALSHA).

This module holds the helpers every script starts with and the write
scripts; the read scripts are in :mod:`kvindex.redis_lua_read`.

Each public operation of the Redis backend is one script: it runs atomically
on the server, so a reader never sees half of an event, and a script applied
twice leaves the same state (every size counter changes only on a state
transition the script itself observes, never by blind increments).

Data layout: see the module docstring of :mod:`kvindex.redis_index`.
Request and engine keys travel and are kept in binary
(:func:`kvindex.redis_batch.k8`; a list of them is one string, split by
``keys8``) and are never used in Lua arithmetic (Lua numbers are doubles);
tier masks fit in 31 bits and use the ``bit`` library.  ``ARGV[1]`` of every script is the key prefix, optionally
followed by NUL, a model name, NUL and the id the caller knows for it: the
script then refuses to run (error ``STALEMODEL``) unless the server still
gives that model that id.
"""

from __future__ import annotations

from kvindex.redis_lua_groups import GROUP_HELPERS, GROUP_SCRIPTS
from kvindex.redis_lua_read import READ_SCRIPTS

__all__ = ["SCRIPTS"]

# Helpers shared by the scripts (prepended to each).
_COMMON = r"""
local P = ARGV[1]
do
  -- ARGV[1] = prefix NUL model-name NUL model-id: the caller's id of that model must still be the
  -- server's (a server that lost its data hands the ids out again, to other models)
  local z = string.find(P, '\0', 1, true)
  if z then
    local name, mid = string.match(string.sub(P, z + 1), '^(.*)%z([0-9]+)$')
    P = string.sub(P, 1, z - 1)
    if redis.call('HGET', P .. 'mids', name) ~= mid then
      return redis.error_reply('STALEMODEL the model ids changed (the server lost its data)')
    end
  end
end
local LRUB = P .. 'lrub'
local LTOP = P .. 'ltop'
local LLOG = P .. 'llog'
local PK = P .. 'pk'
local N = P .. 'n'
local XPODS = P .. 'xpods'
local HPODS = P .. 'hpods'
local L2ORDER = P .. 'l2order'
local function bkey(rk) return P .. 'b:' .. rk end
local function skey(mid, rank, pod) return P .. 's:' .. mid .. ':' .. rank .. ':' .. pod end
local function pskey(pod) return P .. 'ps:' .. pod end
local EC = P .. 'ec'
local function xkey(pod) return P .. 'x:' .. pod end
local function hkey(pod) return P .. 'h:' .. pod end
local function hckey(pod) return P .. 'hc:' .. pod end

-- keys travel and are kept in binary (kvindex.redis_batch.k8): 8 bytes big-endian, or 10 bytes starting
-- with byte 255 (keys from 255 * 2**56 up, negative ones); the length of the key starting at byte i of s
local function klen(s, i)
  if string.byte(s, i or 1) == 255 then return 10 end
  return 8
end
-- a string of keys -> a list
local function keys8(s)
  local t, i, n = {}, 1, #s
  while i <= n do
    local w = klen(s, i)
    t[#t + 1] = string.sub(s, i, i + w - 1)
    i = i + w
  end
  return t
end

-- n (0 <= n < 2**24) as three bytes: a bucket's name (formatting a number costs ten times more)
local function id3(n) return string.char(math.floor(n / 65536), math.floor(n / 256) % 256, n % 256) end

-- "mask:mid:<ek>" of a level-1 rank entry (ek last) -> mask, ek, mid
local function parse_entry(v)
  local a = string.find(v, ':', 1, true)
  local b = string.find(v, ':', a + 1, true)
  return tonumber(string.sub(v, 1, a - 1)), string.sub(v, b + 1), string.sub(v, a + 1, b - 1)
end
local function entry(mask, ek, mid) return mask .. ':' .. mid .. ':' .. ek end

-- level 2 "<rk>:<holders>" (rk first)
local function l2_rk(v) return string.sub(v, 1, klen(v)) end
local function l2_count(v) return tonumber(string.sub(v, klen(v) + 2)) end

-- field 'r:<rank>:<pod>' -> rank, pod (nil for other fields)
local function parse_rfield(f)
  if string.sub(f, 1, 2) ~= 'r:' then return nil end
  local c = string.find(f, ':', 3, true)
  return string.sub(f, 3, c - 1), string.sub(f, c + 1)
end

local function now_arg(v)
  if v ~= nil and v ~= '' then return tonumber(v) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- drop expired speculative entries of every pod; returns how many
local function reap(now)
  local n = 0
  for _, pod in ipairs(redis.call('SMEMBERS', XPODS)) do
    n = n + redis.call('ZREMRANGEBYSCORE', xkey(pod), '-inf', now)
    if redis.call('EXISTS', xkey(pod)) == 0 then redis.call('SREM', XPODS, pod) end
  end
  return n
end

-- size counters (n: entries, engine keys, request keys): changed locally, written once at the end of a script (flush_n)
local dent, dek = 0, 0
local nkeys, dkeys = nil, 0
-- engine keys per model in level 2 (EC), read once per script; a model's map enters the level-2 order
-- when its first key comes and leaves it with its last
local ecount, ecdelta = {}, {}
-- PK's changes per pod (a pod whose count reaches 0 leaves it)
local dpk = {}
local function pk_add(pod, d) dpk[pod] = (dpk[pod] or 0) + d end
local function flush_n()
  if dent ~= 0 then redis.call('HINCRBY', N, 'entries', dent); dent = 0 end
  if dek ~= 0 then redis.call('HINCRBY', N, 'engine_keys', dek); dek = 0 end
  if dkeys ~= 0 then nkeys = redis.call('HINCRBY', N, 'keys', dkeys); dkeys = 0 end
  for mid, d in pairs(ecdelta) do
    if d ~= 0 and redis.call('HINCRBY', EC, mid, d) <= 0 then redis.call('HDEL', EC, mid) end
  end
  ecdelta = {}
  for pod, d in pairs(dpk) do
    if d ~= 0 and redis.call('HINCRBY', PK, pod, d) <= 0 then redis.call('HDEL', PK, pod) end
  end
  dpk = {}
end

-- LRU ticks: reserved from the shared counter 256 at a time (increasing across scripts)
local tick_at, tick_top = 0, 0
local function next_tick()
  if tick_at >= tick_top then
    tick_top = redis.call('INCRBY', P .. 'tick', 256)
    tick_at = tick_top - 256
  end
  tick_at = tick_at + 1
  return tick_at
end

-- a model's level-2 map gained (d > 0) or lost engine keys
local function ec_add(mid, d)
  local c = ecount[mid]
  if c == nil then c = tonumber(redis.call('HGET', EC, mid) or '0') end
  if c == 0 and d > 0 then redis.call('ZADD', L2ORDER, 'NX', next_tick(), mid) end
  ecount[mid] = c + d
  ecdelta[mid] = (ecdelta[mid] or 0) + d
  dek = dek + d
  if c + d <= 0 then redis.call('ZREM', L2ORDER, mid) end
end

-- The LRU: request keys in lru_buckets() small sorted sets 'l:<n>' (n in three bytes) by last use (kept as listpacks:
-- about 20 B per key where one big sorted set costs 110), n from the key's last three bytes. LTOP
-- holds every bucket with a lower bound of its oldest tick (0 at first; ticks only grow), so the
-- oldest key overall is the oldest of the bucket whose bound is exact and lowest. The bucket count
-- follows the capacity of the first writer (about 80 keys per bucket when full), fixed from then on.
-- A match does not refresh its keys itself: it appends them to the touch log LLOG (one string of
-- keys per match), which the next script that stores applies in order before its first tick
-- (lru_drain; a key's last use decides), as does a match that finds LOG_MAX matches waiting.
local LOG_MAX = 8
-- at most 2^18 buckets (ltop about 26 MiB): from about 21 M keys of capacity they hold more than 80 keys,
-- from 34 M more than the server's listpack limit of 128 (then each costs what one sorted set does)
local MAX_BUCKETS = 262144
local nbuckets = nil
local function lru_buckets(cap)
  if nbuckets == nil or (nbuckets == 0 and cap) then
    nbuckets = tonumber(redis.call('GET', LRUB) or '0')
    if nbuckets == 0 and cap then
      nbuckets = math.min(MAX_BUCKETS, math.max(1, math.ceil(cap / 80)))
      redis.call('SET', LRUB, nbuckets)
      local b = 0
      while b < nbuckets do
        local args = {}
        for q = b, math.min(nbuckets, b + 1000) - 1 do args[#args + 1] = 0; args[#args + 1] = id3(q) end
        redis.call('ZADD', LTOP, unpack(args))
        b = b + 1000
      end
    end
  end
  return nbuckets
end
local ID0 = id3(0)
-- the bucket of key rk (the count read first if this script has not yet)
local function lru_bucket(rk)
  if nbuckets == nil then lru_buckets(nil) end
  if nbuckets <= 1 then return ID0 end
  local a, b, c = string.byte(rk, -3, -1)
  if c == nil then return ID0 end  -- not a key ('' where a parent is none)
  return id3((a * 65536 + b * 256 + c) % nbuckets)
end
local function lkey(b) return P .. 'l:' .. b end
-- level 2 of model mid, in as many buckets as the LRU: the one holding engine key ek
local function ekey(mid, ek) return P .. 'e:' .. mid .. ':' .. lru_bucket(ek) end

-- request keys in the LRU (the count kept in n: 'keys')
local function lru_count()
  if nkeys == nil then nkeys = tonumber(redis.call('HGET', N, 'keys') or '0') end
  return nkeys + dkeys
end

-- apply the touch log: every key still in the LRU gets a new tick, in the order of its last use
local drained = false
local function lru_drain()
  if drained then return end
  drained = true
  local log = redis.call('LRANGE', LLOG, 0, -1)
  if #log == 0 then return end
  redis.call('DEL', LLOG)
  if lru_buckets(nil) == 0 then return end
  local last, order = {}, {}
  for _, chunk in ipairs(log) do
    for _, rk in ipairs(keys8(chunk)) do
      order[#order + 1] = rk
      last[rk] = #order
    end
  end
  for i, rk in ipairs(order) do
    if last[rk] == i then redis.call('ZADD', lkey(lru_bucket(rk)), 'XX', next_tick(), rk) end
  end
end

-- drop rk from the LRU (its block hash is gone)
local function lru_rem(rk)
  if redis.call('ZREM', lkey(lru_bucket(rk)), rk) == 1 then dkeys = dkeys - 1 end
end

-- rk used now: a new key joins the LRU (true); a known one is refreshed (false)
local function lru_add(rk, cap)
  lru_buckets(cap)
  lru_drain()
  if redis.call('ZADD', lkey(lru_bucket(rk)), next_tick(), rk) == 0 then return false end
  dkeys = dkeys + 1
  return true
end

-- take the least recently used request key out of the LRU (nil when it is empty)
local function lru_pop()
  if lru_count() <= 0 then return nil end
  local empty = 0
  while true do
    local top = redis.call('ZRANGE', LTOP, 0, 0, 'WITHSCORES')
    local b, bound = top[1], tonumber(top[2])
    local oldest = redis.call('ZRANGE', lkey(b), 0, 0, 'WITHSCORES')
    if #oldest == 0 then
      -- keys that join this bucket later get later ticks
      redis.call('ZADD', LTOP, next_tick(), b)
      empty = empty + 1
      if empty > nbuckets then return nil end  -- every bucket is empty (the count was off)
    elseif tonumber(oldest[2]) > bound then
      redis.call('ZADD', LTOP, oldest[2], b)
    else
      redis.call('ZREM', lkey(b), oldest[1])
      dkeys = dkeys - 1
      return oldest[1]
    end
  end
end

-- per pod within one script: does it have speculative entries; which of its streams are in ps:<pod>
local has_spec, in_ps = {}, {}
local function spec_of(pod)
  local v = has_spec[pod]
  if v == nil then v = redis.call('EXISTS', xkey(pod)) == 1; has_spec[pod] = v end
  return v
end
local function ps_add(pod, s)
  local t = in_ps[pod]
  if t == nil then t = {}; in_ps[pod] = t end
  if not t[s] then redis.call('SADD', pskey(pod), s); t[s] = true end
end
local function ps_rem(pod, s)
  redis.call('SREM', pskey(pod), s)
  in_ps[pod] = nil
end

local function unref(ek, mid, compat)
  if compat then return end
  local e = ekey(mid, ek)
  local v = redis.call('HGET', e, ek)
  if not v then return end
  local cnt = l2_count(v) - 1
  if cnt <= 0 then
    redis.call('HDEL', e, ek)
    ec_add(mid, -1)
  else
    redis.call('HSET', e, ek, l2_rk(v) .. ':' .. cnt)
  end
end

-- remove stream field ek (if it maps to rk); keeps the per-pod stream set current
local function unlink(pod, rank, mid, ek, rk, compat)
  local sk = skey(mid, rank, pod)
  if redis.call('HGET', sk, ek) == rk then
    redis.call('HDEL', sk, ek)
    dent = dent - 1
    unref(ek, mid, compat)
    if redis.call('EXISTS', sk) == 0 then ps_rem(pod, mid .. ':' .. rank) end
  end
end

-- OR of the masks of pod's rank entries in block hash bk, and how many there are
local function pod_ranks(bk, pod)
  local all = redis.call('HGETALL', bk)
  local m, n = 0, 0
  for i = 1, #all, 2 do
    local r, p = parse_rfield(all[i])
    if p == pod then
      local mask = parse_entry(all[i + 1])
      m = bit.bor(m, mask)
      n = n + 1
    end
  end
  return m, n
end

-- the read path's view of a block: field 'p:<pod>' of its block hash -> the pod's mask (OR over its
-- DP ranks); PK counts each pod's blocks
local function set_pod_mask(rk, pod, mask)
  if redis.call('HSET', bkey(rk), 'p:' .. pod, mask) == 1 then pk_add(pod, 1) end
end

local function drop_pod_mask(rk, pod)
  if redis.call('HDEL', bkey(rk), 'p:' .. pod) == 1 then pk_add(pod, -1) end
end

-- after a rank entry of pod left block rk: refresh or drop the pod's mask, drop an empty block
local function settle_pod(rk, pod)
  local bk = bkey(rk)
  local m, n = pod_ranks(bk, pod)
  if n > 0 then
    set_pod_mask(rk, pod, m)
  else
    drop_pod_mask(rk, pod)
    if redis.call('EXISTS', bk) == 0 then lru_rem(rk) end
  end
end

-- clear bit (-1: all) of (pod, rank)'s copy of rk; true if it held that tier
local function drop_copy(pod, rank, ek, rk, bitv, compat)
  local bk = bkey(rk)
  local rf = 'r:' .. rank .. ':' .. pod
  local v = redis.call('HGET', bk, rf)
  if not v then return false end
  local mask, eek, emid = parse_entry(v)
  if bit.band(mask, bitv) == 0 then return false end
  mask = bit.band(mask, bit.bnot(bitv))
  if mask == 0 then
    redis.call('HDEL', bk, rf)
    unlink(pod, rank, emid, ek, rk, compat)
    settle_pod(rk, pod)
    return true
  end
  redis.call('HSET', bk, rf, entry(mask, eek, emid))
  local m = pod_ranks(bk, pod)
  set_pod_mask(rk, pod, m)
  return true
end

local evictions = 0
local function evict_one(compat)
  local rk = lru_pop()
  if rk == nil then return end
  local bk = bkey(rk)
  local all = redis.call('HGETALL', bk)
  for i = 1, #all, 2 do
    local rank, pod = parse_rfield(all[i])
    if rank then
      drop_pod_mask(rk, pod)
      local _, ek, mid = parse_entry(all[i + 1])
      unlink(pod, rank, mid, ek, rk, compat)
    end
  end
  redis.call('DEL', bk)
  evictions = evictions + 1
end

local confirmed = 0
local stored = 0
-- map ek -> rk for the stream (and level 2), ``old`` being the stream's current rk of ek (placed: the
-- stream's table has the new entry already); count the store; confirm a speculative entry
local function link(pod, rank, mid, ek, rk, compat, old, placed)
  if old ~= rk then
    if not old then dent = dent + 1 end
    if not placed then redis.call('HSET', skey(mid, rank, pod), ek, rk) end
    ps_add(pod, mid .. ':' .. rank)
    if not compat then
      local e = ekey(mid, ek)
      if redis.call('HSETNX', e, ek, rk .. ':1') == 1 then
        ec_add(mid, 1)
      else
        redis.call('HSET', e, ek, rk .. ':' .. (l2_count(redis.call('HGET', e, ek)) + 1))
      end
    end
  end
  stored = stored + 1
  if spec_of(pod) and redis.call('ZREM', xkey(pod), rk) == 1 then
    confirmed = confirmed + 1
    if redis.call('EXISTS', xkey(pod)) == 0 then
      redis.call('SREM', XPODS, pod)
      has_spec[pod] = false
    end
  end
end

-- record that (pod, rank, mid) holds rk as ek in tier bitv
local function put(pod, rank, mid, ek, rk, bitv, cap, compat)
  local sk = skey(mid, rank, pod)
  -- a new engine key of the stream is placed at once (one call); a known one's request key is read
  local old, placed = nil, redis.call('HSETNX', sk, ek, rk) == 1
  if not placed then old = redis.call('HGET', sk, ek) end
  if old and old ~= rk then
    drop_copy(pod, rank, ek, old, -1, compat)
    old = redis.call('HGET', sk, ek)
  end
  local bk = bkey(rk)
  -- a request key is in the LRU exactly while its block hash exists: a new member is a new block
  local fresh = lru_add(rk, cap)
  if fresh and lru_count() > cap then evict_one(compat) end
  local rf = 'r:' .. rank .. ':' .. pod
  if fresh then
    redis.call('HSET', bk, rf, entry(bitv, ek, mid), 'p:' .. pod, bitv)
    pk_add(pod, 1)
    link(pod, rank, mid, ek, rk, compat, old, placed)
    return
  end
  local pf = 'p:' .. pod
  local got = redis.call('HMGET', bk, rf, pf)
  local v, e = got[1], entry(bitv, ek, mid)
  if v then
    local mask, eek, emid = parse_entry(v)
    mask = bit.bor(mask, bitv)
    if eek ~= ek then
      if redis.call('HGET', sk, eek) == rk then
        redis.call('HDEL', sk, eek)
        dent = dent - 1
        unref(eek, mid, compat)
      end
      eek = ek
    end
    e = entry(mask, eek, emid)
  end
  -- the rank's entry and the pod's mask (OR over its ranks) in one write
  redis.call('HSET', bk, rf, e, pf, bit.bor(tonumber(got[2] or '0'), bitv))
  if not got[2] then pk_add(pod, 1) end
  link(pod, rank, mid, ek, rk, compat, old, placed)
end

local function resolve(pod, rank, mid, ek)
  local rk = redis.call('HGET', skey(mid, rank, pod), ek)
  if rk then return rk end
  local v = redis.call('HGET', ekey(mid, ek), ek)
  if not v then return nil end
  return l2_rk(v)
end
""" + GROUP_HELPERS + r"""
-- forget what pod holds: rank ('' = every rank), mid ('' = every model, '-' = none);
-- returns the entries removed (rank entries + held keys + speculative entries when the whole pod goes)
local function clear_streams(pod, rank, mid, compat)
  local n = 0
  if mid ~= '-' then
    for _, s in ipairs(redis.call('SMEMBERS', pskey(pod))) do
      local c = string.find(s, ':', 1, true)
      local smid, srank = string.sub(s, 1, c - 1), string.sub(s, c + 1)
      if (rank == '' or srank == rank) and (mid == '' or smid == mid) then
        local sk = skey(smid, srank, pod)
        local m = redis.call('HGETALL', sk)
        redis.call('DEL', sk)
        ps_rem(pod, s)
        local rf = 'r:' .. srank .. ':' .. pod
        for i = 1, #m, 2 do
          local ek, rk = m[i], m[i + 1]
          dent = dent - 1
          unref(ek, smid, compat)
          if redis.call('HDEL', bkey(rk), rf) == 1 then
            n = n + 1
            settle_pod(rk, pod)
          end
        end
      end
    end
  end
  if mid ~= '-' then n = n + gclear_streams(pod, rank, mid, compat) end
  if rank == '' and mid == '' then
    n = n + redis.call('HLEN', hkey(pod)) + redis.call('ZCARD', xkey(pod))
    redis.call('DEL', hkey(pod), hckey(pod), xkey(pod))
    redis.call('SREM', HPODS, pod)
    redis.call('SREM', XPODS, pod)
    has_spec[pod] = false
  end
  return n
end

"""

# ARGV: P, pod, rank, mid, bit, capacity, compat, then ek1, rk1, ek2, rk2, ...
# -> {stored, evictions, confirmed}
_STORE = r"""
local pod, rank, mid, bitv, cap = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local compat = ARGV[7] == '1'
for i = 8, #ARGV, 2 do put(pod, rank, mid, ARGV[i], ARGV[i + 1], bitv, cap, compat) end
flush_n()
return {stored, evictions, confirmed}
"""

# A token-less store: ARGV: P, pod, rank, mid, bit, capacity, compat, ek...
# -> {stored, evictions, confirmed, unknown}
_TOKENLESS = r"""
local pod, rank, mid, bitv, cap = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local compat = ARGV[7] == '1'
local unknown = 0
for i = 8, #ARGV do
  local ek = ARGV[i]
  local rk
  if compat then rk = ek else rk = resolve(pod, rank, mid, ek) end
  if rk then put(pod, rank, mid, ek, rk, bitv, cap, compat) else unknown = unknown + 1 end
end
flush_n()
return {stored, evictions, confirmed, unknown}
"""

# ARGV: P, pod, rank, mid, ek -> rk or false
_RESOLVE = r"""
return resolve(ARGV[2], ARGV[3], ARGV[4], ARGV[5]) or false
"""

# One publisher's run of events, in order (the write path's batch).
# ARGV: P, pod, rank, mid, capacity, compat, then per event one op (engine / request keys as one
# string of binary keys each, see keys8):
#   'S', bit, parent ek ('' = none), its request key, eks, rks   a store; applied only if the stream
#                                                               still resolves the parent to that key
#   'T', bit, eks                                               a token-less store
#   'R', bit, eks                                               a removal
#   'C'                                                         a clear of the stream (rank, mid)
#   'G', g, spec, full, keep, kind, bit, parent ek, its rk, eks, rks
#        a store of KV-cache group g (spec 'kind|block size|window', full 0/1); kind 'S' (as 'S'; parent
#        rk '*': not checked), 'T' (token-less) or 'L' (learn the spec only); in a non-primary group a
#        parent-nil store keeps its last ``keep`` blocks (-1: all) while the stream's report window is open
#   'Q', g, bit, eks                                            a removal of group g
# -> {ops applied (stops before a store whose parent resolves otherwise), stored, evictions, confirmed,
#     unknown (token-less), clears that removed something, {hit 0/1 per removed ek, in order},
#     {1 main tables / 0 a group's table, per 'G' and 'Q' op}, group evictions, trimmed blocks,
#     streams that became hybrid}
_BATCH = r"""
local pod, rank, mid, cap = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local compat = ARGV[6] == '1'
local done, unknown, clears = 0, 0, 0
local hits, routes = {}, {}
local i = 7
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' then
    local bitv, pek = tonumber(ARGV[i + 1]), ARGV[i + 2]
    if pek ~= '' and resolve(pod, rank, mid, pek) ~= ARGV[i + 3] then break end
    local eks, rks = keys8(ARGV[i + 4]), keys8(ARGV[i + 5])
    for k = 1, #eks do put(pod, rank, mid, eks[k], rks[k], bitv, cap, compat) end
    i = i + 6
  elseif op == 'T' then
    local bitv = tonumber(ARGV[i + 1])
    for _, ek in ipairs(keys8(ARGV[i + 2])) do
      local rk
      if compat then rk = ek else rk = resolve(pod, rank, mid, ek) end
      if rk then put(pod, rank, mid, ek, rk, bitv, cap, compat) else unknown = unknown + 1 end
    end
    i = i + 3
  elseif op == 'R' then
    local bitv = tonumber(ARGV[i + 1])
    local sk = skey(mid, rank, pod)
    for _, ek in ipairs(keys8(ARGV[i + 2])) do
      local rk = redis.call('HGET', sk, ek)
      if rk and drop_copy(pod, rank, ek, rk, bitv, compat) then hits[#hits + 1] = 1 else hits[#hits + 1] = 0 end
    end
    i = i + 3
  elseif op == 'G' then
    local g, full, keep, kind = ARGV[i + 1], ARGV[i + 3] == '1', tonumber(ARGV[i + 4]), ARGV[i + 5]
    local bitv, pek, prk = tonumber(ARGV[i + 6]), ARGV[i + 7], ARGV[i + 8]
    local main = learn(mid, rank, pod, g, ARGV[i + 2], full)
    if kind == 'S' and pek ~= '' and prk ~= '*' then
      local got
      if main then got = resolve(pod, rank, mid, pek) else got = gresolve(mid, rank, g, pod, pek, compat) end
      if got ~= prk then break end
    end
    local eks, rks = keys8(ARGV[i + 9]), {}
    if kind == 'S' then
      rks = keys8(ARGV[i + 10])
      if main then
        for k = 1, #eks do put(pod, rank, mid, eks[k], rks[k], bitv, cap, compat) end
      else
        local first = 1
        if pek == '' and keep >= 0 and #eks > keep and redis.call('EXISTS', gdkey(mid, rank, pod)) == 1 then
          first = #eks - keep + 1
          trimmed = trimmed + first - 1
        end
        gstore(mid, rank, g, pod, eks, rks, first, bitv, cap, compat)
      end
    elseif kind == 'T' then
      for _, ek in ipairs(eks) do
        local rk
        if main then
          if compat then rk = ek else rk = resolve(pod, rank, mid, ek) end
          if rk then put(pod, rank, mid, ek, rk, bitv, cap, compat) else unknown = unknown + 1 end
        else
          rk = glookup(mid, rank, g, pod, ek, compat)
          if rk then gput(mid, rank, g, pod, ek, rk, bitv, cap, compat) else unknown = unknown + 1 end
        end
      end
    end
    routes[#routes + 1] = main and 1 or 0
    i = i + 11
  elseif op == 'Q' then
    local g, bitv = ARGV[i + 1], tonumber(ARGV[i + 2])
    local main = gmain(mid, rank, pod, g)
    local sk = skey(mid, rank, pod)
    for _, ek in ipairs(keys8(ARGV[i + 3])) do
      local hit
      if main then
        local rk = redis.call('HGET', sk, ek)
        hit = rk and drop_copy(pod, rank, ek, rk, bitv, compat)
      else
        hit = gdrop(mid, rank, g, pod, ek, bitv, compat)
      end
      if hit then hits[#hits + 1] = 1 else hits[#hits + 1] = 0 end
    end
    routes[#routes + 1] = main and 1 or 0
    i = i + 4
  else
    if clear_streams(pod, rank, mid, compat) > 0 then clears = clears + 1 end
    i = i + 1
  end
  done = done + 1
end
flush_n()
return {done, stored + gstored, evictions, confirmed, unknown, clears, hits, routes, gevictions, trimmed, newhybrid}
"""

# ARGV: P, pod, rank, mid ('' = model unknown here), bit, compat, ek... -> {hit 0/1 per ek}
_REMOVE = r"""
local pod, rank, mid, bitv = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local compat = ARGV[6] == '1'
local out = {}
for i = 7, #ARGV do
  local ek = ARGV[i]
  local hit = 0
  if mid ~= '' then
    local rk = redis.call('HGET', skey(mid, rank, pod), ek)
    if rk and drop_copy(pod, rank, ek, rk, bitv, compat) then hit = 1 end
  end
  out[#out + 1] = hit
end
flush_n()
return out
"""

# ARGV: P, pod, rank ('' = every rank), mid ('' = every model, '-' = none), compat
# -> entries removed (rank entries + held keys + speculative entries when the whole pod goes)
_CLEAR = r"""
local n = clear_streams(ARGV[2], ARGV[3], ARGV[4], ARGV[5] == '1')
flush_n()
return n
"""

# ARGV: P, pod, now ('' = server time), ttl, expiry ('' = now + ttl), keep (ms, 0 = no key TTL), rk...
# -> speculative entries expired by the reaping
_SPECULATIVE = r"""
local pod = ARGV[2]
local now = now_arg(ARGV[3])
local expiry = ARGV[5]
if expiry == '' then expiry = now + tonumber(ARGV[4]) end
local expired = reap(now)
local xk = xkey(pod)
local added = false
for i = 7, #ARGV do
  local rk = ARGV[i]
  if redis.call('HEXISTS', bkey(rk), 'p:' .. pod) == 0 then
    redis.call('ZADD', xk, expiry, rk)
    added = true
  end
end
if added then
  redis.call('SADD', XPODS, pod)
  local keep = tonumber(ARGV[6])
  if keep > 0 then
    if redis.call('PTTL', xk) < keep then redis.call('PEXPIRE', xk, keep) end
  end
end
return expired
"""

# ARGV: P, pod, bit, keep (ms, 0 = no key TTL), rk...
_ADD_HELD = r"""
local pod, bitv = ARGV[2], tonumber(ARGV[3])
local hk, hc = hkey(pod), hckey(pod)
for i = 5, #ARGV do
  local rk = ARGV[i]
  redis.call('HINCRBY', hc, rk .. ':' .. bitv, 1)
  local m = tonumber(redis.call('HGET', hk, rk) or '0')
  redis.call('HSET', hk, rk, bit.bor(m, bitv))
end
if #ARGV >= 5 then
  redis.call('SADD', HPODS, pod)
  local keep = tonumber(ARGV[4])
  if keep > 0 then redis.call('PEXPIRE', hk, keep); redis.call('PEXPIRE', hc, keep) end
end
return 0
"""

# ARGV: P, pod, bit, rk... -> entries that ended
_REMOVE_HELD = r"""
local pod, bitv = ARGV[2], tonumber(ARGV[3])
local hk, hc = hkey(pod), hckey(pod)
local ended = 0
for i = 4, #ARGV do
  local rk = ARGV[i]
  local f = rk .. ':' .. bitv
  local c = redis.call('HGET', hc, f)
  if c then
    if tonumber(c) > 1 then
      redis.call('HINCRBY', hc, f, -1)
    else
      redis.call('HDEL', hc, f)
      ended = ended + 1
      local m = bit.band(tonumber(redis.call('HGET', hk, rk) or '0'), bit.bnot(bitv))
      if m == 0 then redis.call('HDEL', hk, rk) else redis.call('HSET', hk, rk, m) end
    end
  end
end
if redis.call('EXISTS', hk) == 0 then
  redis.call('DEL', hc)
  redis.call('SREM', HPODS, pod)
end
return ended
"""

# ARGV: P, model name -> the model's id (assigned on first use; 0 is reserved for no model)
_MODEL_ID = r"""
local v = redis.call('HGET', P .. 'mids', ARGV[2])
if v then return tonumber(v) end
local id = redis.call('INCR', P .. 'mid_seq')
redis.call('HSET', P .. 'mids', ARGV[2], id)
redis.call('HSET', P .. 'mnames', id, ARGV[2])
return id
"""

SCRIPTS: dict[str, str] = {
    name: _COMMON + body
    for name, body in {
        "store": _STORE,
        "batch": _BATCH,
        "tokenless": _TOKENLESS,
        "resolve": _RESOLVE,
        "remove": _REMOVE,
        "clear": _CLEAR,
        "speculative": _SPECULATIVE,
        "add_held": _ADD_HELD,
        "remove_held": _REMOVE_HELD,
        "model_id": _MODEL_ID,
    }.items()
} | {name: _COMMON + body for name, body in (READ_SCRIPTS | GROUP_SCRIPTS).items()}
