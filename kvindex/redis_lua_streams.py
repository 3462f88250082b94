"""The Redis backend's stream tables (Lua, part of every script; see :mod:`kvindex.redis_lua`).

One publisher stream ``<mid>:<rank>:<pod>`` maps its engine keys to request
keys.  A stream holds from one entry to millions, so its table grows by
linear hashing over the engine key's last six bytes, bits reversed, ``h``
(48 bits; the key's low bits, which differ even between consecutive keys,
choose the bucket): bucket
``i`` of level ``L`` holds the ``h`` in ``[i * 2**(48-L), (i+1) * 2**(48-L))``
and is named by that range's start; ``p`` buckets of level ``L`` are split
already.  A bucket is a small sorted set (a listpack: about 26 B per entry,
where a field of one big hash cost 64): member ``<ek><rk>``, score ``h``.  A
split halves one bucket's range: the upper half moves to a new bucket in two
server commands (ZRANGESTORE, ZREMRANGEBYSCORE), nothing passes through Lua.
The state ``L:p:n`` (``n`` entries) of each stream is a field of ``sm``, read
once per script and written by ``flush_n``.
"""

from __future__ import annotations

__all__ = ["STREAM_HELPERS"]

# Needs P, klen and flush_n's call of st_flush.
STREAM_HELPERS = r"""
local SM = P .. 'sm'
local ST_FILL = 48   -- entries per bucket on average before one more bucket is split
local POW = {}
do local v = 1; for i = 0, 48 do POW[i] = v; v = v * 2 end end
local sstate = {}    -- stream -> {L, p, n, changed}
local function sid(mid, rank, pod) return mid .. ':' .. rank .. ':' .. pod end
local function st_state(s)
  local t = sstate[s]
  if t == nil then
    local v = redis.call('HGET', SM, s)
    if v then
      local L, p, n = string.match(v, '^(%d+):(%d+):(%d+)$')
      t = {tonumber(L), tonumber(p), tonumber(n), false}
    else
      t = {0, 0, 0, false}
    end
    sstate[s] = t
  end
  return t
end
local function fmt(x) return string.format('%.0f', x) end
-- key k's last six bytes as a 48-bit number, bits reversed: the low bits of the key (which vary even
-- between small consecutive keys) choose the bucket
local REV = {}
for i = 0, 255 do
  local r, x = 0, i
  for _ = 1, 8 do r = r * 2 + x % 2; x = math.floor(x / 2) end
  REV[i] = r
end
local function h48(k)
  local a, b, c, d, e, f = string.byte(k, -6, -1)
  if f == nil then return 0 end  -- not a key ('' where a parent is none)
  return ((((REV[f] * 256 + REV[e]) * 256 + REV[d]) * 256 + REV[c]) * 256 + REV[b]) * 256 + REV[a]
end
local function st_bkey(s, start) return P .. 's:' .. s .. ':' .. fmt(start) end
-- the bucket of h in state t
local function st_bucket(s, t, h)
  local w = POW[48 - t[1]]
  local i = math.floor(h / w)
  if i < t[2] then w = w / 2; i = math.floor(h / w) end
  return st_bkey(s, i * w)
end
-- the member of ek in bucket bk (score hs), and its request key
local function st_find(bk, hs, ek)
  for _, m in ipairs(redis.call('ZRANGE', bk, hs, hs, 'BYSCORE')) do
    local w = klen(m)
    if string.sub(m, 1, w) == ek then return m, string.sub(m, w + 1) end
  end
  return nil, nil
end

-- the request key stream s maps ek to, or nil
local function st_get(s, ek)
  local t = st_state(s)
  if t[3] == 0 then return nil end
  local h = h48(ek)
  local _, rk = st_find(st_bucket(s, t, h), fmt(h), ek)
  return rk
end

-- split the next bucket: the upper half of its range becomes a bucket of its own
local function st_split(s, t)
  local L, p = t[1], t[2]
  local w = POW[48 - L]
  local src = st_bkey(s, p * w)
  local lo, hi = fmt(p * w + w / 2), fmt((p + 1) * w - 1)
  redis.call('ZRANGESTORE', st_bkey(s, p * w + w / 2), src, lo, hi, 'BYSCORE')
  redis.call('ZREMRANGEBYSCORE', src, lo, hi)
  p = p + 1
  if p == POW[L] then L = L + 1; p = 0 end
  t[1], t[2] = L, p
end

-- map ek -> rk in stream s; old: its current request key (nil: none)
local function st_set(s, ek, rk, old)
  local t = st_state(s)
  local h = h48(ek)
  local bk, hs = st_bucket(s, t, h), fmt(h)
  if old then redis.call('ZREM', bk, ek .. old) else t[3] = t[3] + 1 end
  redis.call('ZADD', bk, hs, ek .. rk)
  t[4] = true
  while t[3] > ST_FILL * (POW[t[1]] + t[2]) and t[1] < 40 do st_split(s, t) end
end

-- forget ek -> rk in stream s; true if it was there
local function st_del(s, ek, rk)
  local t = st_state(s)
  if t[3] == 0 then return false end
  if redis.call('ZREM', st_bucket(s, t, h48(ek)), ek .. rk) == 0 then return false end
  t[3] = t[3] - 1
  t[4] = true
  if t[3] == 0 then t[1], t[2] = 0, 0 end  -- every bucket is empty, so gone
  return true
end

-- stream s's entries {ek, rk, ek, rk, ...}; with drop, the stream is emptied
local function st_all(s, drop)
  local t = st_state(s)
  local out = {}
  if t[3] == 0 then return out end
  local L, p = t[1], t[2]
  local w = POW[48 - L]
  for i = 0, POW[L] - 1 do
    local starts = {i * w}
    if i < p then starts[2] = i * w + w / 2 end
    for _, start in ipairs(starts) do
      local bk = st_bkey(s, start)
      for _, m in ipairs(redis.call('ZRANGE', bk, 0, -1)) do
        local kw = klen(m)
        out[#out + 1] = string.sub(m, 1, kw)
        out[#out + 1] = string.sub(m, kw + 1)
      end
      if drop then redis.call('DEL', bk) end
    end
  end
  if drop then t[1], t[2], t[3], t[4] = 0, 0, 0, true end
  return out
end

local function st_count(s) return st_state(s)[3] end

-- write the changed states (flush_n)
local function st_flush()
  for s, t in pairs(sstate) do
    if t[4] then
      if t[3] == 0 then redis.call('HDEL', SM, s) else redis.call('HSET', SM, s, t[1] .. ':' .. t[2] .. ':' .. t[3]) end
      t[4] = false
    end
  end
end
"""
