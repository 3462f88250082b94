"""KV-cache groups in the Redis backend's scripts (hybrid models; Lua, run with EVALSHA).

``GROUP_HELPERS`` is part of the helpers every script starts with (see
:mod:`kvindex.redis_lua`); ``GROUP_SCRIPTS`` are the group reads and the
report window.  The semantics are the reference's (:mod:`kvindex.groups`):
per publisher stream the specs learned from stores, the primary group (the
first full-attention one; its blocks live in the main tables) and every
other group's blocks in a table of their own.  Data layout: see
docs/operations.md, "Hybrid models on Redis", and :mod:`kvindex.redis_groups`.
"""

from __future__ import annotations

__all__ = ["GROUP_HELPERS", "GROUP_SCRIPTS"]

# Needs bkey, skey, parse_entry, next_tick and resolve of the common helpers.
GROUP_HELPERS = r"""
local GL = P .. 'gl'
local GH = P .. 'gh'
local function gskey(mid, rank, pod) return P .. 'gs:' .. mid .. ':' .. rank .. ':' .. pod end
local function gpskey(pod) return P .. 'gps:' .. pod end
local function gdkey(mid, rank, pod) return P .. 'gd:' .. mid .. ':' .. rank .. ':' .. pod end
-- a non-primary group's table: gr (request key -> mask) and, in own-hash mode, ge (engine key -> rk:mask)
local function grkey(mid, rank, g, pod) return P .. 'gr:' .. mid .. ':' .. rank .. ':' .. g .. ':' .. pod end
local function gekey(mid, rank, g, pod) return P .. 'ge:' .. mid .. ':' .. rank .. ':' .. g .. ':' .. pod end
local function glmember(mid, rank, g, pod, ek) return ek .. ':' .. mid .. ':' .. rank .. ':' .. g .. ':' .. pod end

local gstored, gevictions, trimmed, newhybrid = 0, 0, 0, 0
local groutes = {}  -- per script: gskey NUL group -> spec NUL route (a learned route holds until a clear)

-- record group g's spec for the stream; true when its blocks go to the main tables (the primary group)
local function learn(mid, rank, pod, g, spec, full)
  local gk = gskey(mid, rank, pod)
  local ck = gk .. '\0' .. g
  local c = groutes[ck]
  if c and c[1] == spec then return c[2] end
  local cur = redis.call('HGET', gk, g)
  if cur ~= spec then
    if redis.call('EXISTS', gk) == 0 then redis.call('SADD', gpskey(pod), mid .. ':' .. rank) end
    redis.call('HSET', gk, g, spec)
    local n = redis.call('HLEN', gk) - redis.call('HEXISTS', gk, 'p')
    if (n > 1 or not full) and redis.call('SADD', GH, mid .. ':' .. rank .. ':' .. pod) == 1 then
      newhybrid = newhybrid + 1
    end
  end
  local p = redis.call('HGET', gk, 'p')
  if not p and full then redis.call('HSET', gk, 'p', g); p = g end
  local main = p == g
  groutes[ck] = {spec, main}
  return main
end

-- whether a removal of group g applies to the main tables (no group learned, or the primary one)
local function gmain(mid, rank, pod, g)
  local gk = gskey(mid, rank, pod)
  if redis.call('EXISTS', gk) == 0 then return true end
  return redis.call('HGET', gk, 'p') == g
end

-- the request key of group g's block ek, or nil
local function glookup(mid, rank, g, pod, ek, compat)
  if compat then
    if redis.call('HEXISTS', grkey(mid, rank, g, pod), ek) == 1 then return ek end
    return nil
  end
  local v = redis.call('HGET', gekey(mid, rank, g, pod), ek)
  if not v then return nil end
  return string.sub(v, 1, klen(v))
end

-- a non-primary store's parent: in its group, else the main tables
local function gresolve(mid, rank, g, pod, ek, compat)
  return glookup(mid, rank, g, pod, ek, compat) or resolve(pod, rank, mid, ek)
end

-- clear bit (-1: all) of group g's block ek; true if it held that tier
local function gdrop(mid, rank, g, pod, ek, bitv, compat)
  local gr = grkey(mid, rank, g, pod)
  local rk, mask
  if compat then
    rk, mask = ek, redis.call('HGET', gr, ek)
    if not mask then return false end
    mask = tonumber(mask)
  else
    local v = redis.call('HGET', gekey(mid, rank, g, pod), ek)
    if not v then return false end
    rk, mask = string.sub(v, 1, klen(v)), tonumber(string.sub(v, klen(v) + 2))
  end
  if bit.band(mask, bitv) == 0 then return false end
  mask = bit.band(mask, bit.bnot(bitv))
  if mask == 0 then
    if not compat then redis.call('HDEL', gekey(mid, rank, g, pod), ek) end
    redis.call('HDEL', gr, rk)
    redis.call('ZREM', GL, glmember(mid, rank, g, pod, ek))
  else
    if not compat then redis.call('HSET', gekey(mid, rank, g, pod), ek, rk .. ':' .. mask) end
    redis.call('HSET', gr, rk, mask)
  end
  return true
end

-- forget the oldest non-primary entry (every group's tables share the capacity)
local function gevict_one(compat)
  local popped = redis.call('ZPOPMIN', GL)
  if #popped == 0 then return end
  local w = klen(popped[1])
  local ek = string.sub(popped[1], 1, w)
  local mid, rank, g, pod = string.match(string.sub(popped[1], w + 2), '^([0-9]+):([0-9]+):([0-9]+):(.*)$')
  gdrop(mid, rank, g, pod, ek, -1, compat)
  gevictions = gevictions + 1
end

-- record that group g of (pod, rank, mid) holds rk as ek in tier bitv
local function gput(mid, rank, g, pod, ek, rk, bitv, cap, compat)
  local gr = grkey(mid, rank, g, pod)
  local mask
  if compat then
    mask = redis.call('HGET', gr, ek)
  else
    local ge = gekey(mid, rank, g, pod)
    local v = redis.call('HGET', ge, ek)
    if v then
      if string.sub(v, 1, klen(v)) ~= rk then  -- the engine reused the hash for other content
        gdrop(mid, rank, g, pod, ek, -1, compat)
      else
        mask = string.sub(v, klen(v) + 2)
      end
    end
    redis.call('HSET', ge, ek, rk .. ':' .. bit.bor(tonumber(mask or '0'), bitv))
  end
  redis.call('HSET', gr, rk, bit.bor(tonumber(redis.call('HGET', gr, rk) or '0'), bitv))
  if not mask then
    redis.call('ZADD', GL, next_tick(), glmember(mid, rank, g, pod, ek))
    if redis.call('ZCARD', GL) > cap then gevict_one(compat) end
  end
  gstored = gstored + 1
end

-- a store of a non-primary group: the blocks of eks / rks (lists) from index first on
local function gstore(mid, rank, g, pod, eks, rks, first, bitv, cap, compat)
  for k = first, #eks do gput(mid, rank, g, pod, eks[k], rks[k], bitv, cap, compat) end
end

-- forget the groups of pod's streams: rank ('' = every rank), mid ('' = every model);
-- returns the non-primary entries dropped
local function gclear_streams(pod, rank, mid, compat)
  local n = 0
  for _, s in ipairs(redis.call('SMEMBERS', gpskey(pod))) do
    local c = string.find(s, ':', 1, true)
    local smid, srank = string.sub(s, 1, c - 1), string.sub(s, c + 1)
    if (rank == '' or srank == rank) and (mid == '' or smid == mid) then
      local gk = gskey(smid, srank, pod)
      for _, g in ipairs(redis.call('HKEYS', gk)) do
        if g ~= 'p' then
          local gr, ge = grkey(smid, srank, g, pod), gekey(smid, srank, g, pod)
          local eks
          if compat then eks = redis.call('HKEYS', gr) else eks = redis.call('HKEYS', ge) end
          for _, ek in ipairs(eks) do redis.call('ZREM', GL, glmember(smid, srank, g, pod, ek)) end
          n = n + #eks
          redis.call('DEL', gr, ge)
        end
      end
      redis.call('DEL', gk)
      redis.call('SREM', GH, s .. ':' .. pod)
      redis.call('SREM', gpskey(pod), s)
    end
  end
  groutes = {}
  return n
end
"""

# ARGV: P, pod, rank, mid, g, spec, full (0/1), parent ek, compat
# -> {main 0/1, parent's request key or false, 1 if the stream became hybrid}
# (learns the spec first, as a store does)
_GLEARN = r"""
local pod, rank, mid, g = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local main = learn(mid, rank, pod, g, ARGV[6], ARGV[7] == '1')
local rk
if main then rk = resolve(pod, rank, mid, ARGV[8]) else rk = gresolve(mid, rank, g, pod, ARGV[8], ARGV[9] == '1') end
return {main and 1 or 0, rk or false, newhybrid}
"""

# ARGV: P, pod, rank, mid -> {field, value, ...} of the stream's specs ('p': the primary group)
_GROUP_SPECS = r"""
return redis.call('HGETALL', gskey(ARGV[4], ARGV[3], ARGV[2]))
"""

# ARGV: P, pod, rank, mid, keys (binary, one string) -> {g, {mask per key}, g, {...}, ...} for every learned group
_GROUP_MATCH = r"""
local pod, rank, mid = ARGV[2], ARGV[3], ARGV[4]
local gk = gskey(mid, rank, pod)
local p = redis.call('HGET', gk, 'p')
local K = keys8(ARGV[5])
local rf = 'r:' .. rank .. ':' .. pod
local out = {}
for _, g in ipairs(redis.call('HKEYS', gk)) do
  if g ~= 'p' then
    local ms = {}
    if g == p then
      for k = 1, #K do
        local v = redis.call('HGET', bkey(K[k]), rf)
        local m = 0
        if v then
          local mask, _, emid = parse_entry(v)
          if emid == mid then m = mask end
        end
        ms[k] = m
      end
    else
      local gr = grkey(mid, rank, g, pod)
      for s = 1, #K, 1000 do
        local vals = redis.call('HMGET', gr, unpack(K, s, math.min(#K, s + 999)))
        for j = 1, #vals do ms[#ms + 1] = tonumber(vals[j] or '0') end
      end
    end
    out[#out + 1] = g
    out[#out + 1] = ms
  end
end
return out
"""

# ARGV: P -> the hybrid streams '<mid>:<rank>:<pod>' (stores named several groups or a non-full one)
_GROUPED = r"""
return redis.call('SMEMBERS', GH)
"""

# ARGV: P, pod, rank, mid, ms (0: end the window) -> 0
_DISTRUST = r"""
local k = gdkey(ARGV[4], ARGV[3], ARGV[2])
local ms = tonumber(ARGV[5])
if ms > 0 then redis.call('SET', k, '1', 'PX', ms) else redis.call('DEL', k) end
return 0
"""

GROUP_SCRIPTS: dict[str, str] = {
    "glearn": _GLEARN,
    "group_specs": _GROUP_SPECS,
    "group_match": _GROUP_MATCH,
    "grouped": _GROUPED,
    "distrust": _DISTRUST,
}
