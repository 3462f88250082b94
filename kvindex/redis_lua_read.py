"""Read scripts of :class:`kvindex.redis_index.RedisKVBlockIndex` (Lua, run with EVALSHA).

The read path's prefix match, lookups and sizes; each runs after the shared
helpers of :mod:`kvindex.redis_lua` (``_COMMON``), which builds the script
table.  Data layout: see the module docstring of :mod:`kvindex.redis_index`.
"""

from __future__ import annotations

__all__ = ["READ_SCRIPTS"]

# ARGV: P, now ('' = server time), gpu bit, touch (0/1), npods (-1 = every pod), pods..., keys (binary, one string)
# -> {expired, pod1, {mask, run length, mask, run length, ...}, pod2, {...}, ...} (the masks run-length coded)
_MATCH = r"""
local now = now_arg(ARGV[2])
local gpu = tonumber(ARGV[3])
local touch = ARGV[4] == '1'
local npods = tonumber(ARGV[5])
local expired = reap(now)
local cands = {}
local kstart
if npods < 0 then
  local seen = {}
  for _, p in ipairs(redis.call('HKEYS', PK)) do if not seen[p] then seen[p] = true; cands[#cands + 1] = p end end
  for _, p in ipairs(redis.call('SMEMBERS', XPODS)) do if not seen[p] then seen[p] = true; cands[#cands + 1] = p end end
  for _, p in ipairs(redis.call('SMEMBERS', HPODS)) do if not seen[p] then seen[p] = true; cands[#cands + 1] = p end end
  kstart = 6
else
  local seen = {}
  for i = 6, 5 + npods do
    local p = ARGV[i]
    if not seen[p] then seen[p] = true; cands[#cands + 1] = p end
  end
  kstart = 6 + npods
end
-- per candidate: does it have held or speculative entries?
local alive, held, spec, masks = {}, {}, {}, {}
for _, p in ipairs(cands) do
  local h = redis.call('EXISTS', hkey(p)) == 1
  local x = redis.call('EXISTS', xkey(p)) == 1
  if h or x or redis.call('HEXISTS', PK, p) == 1 then
    alive[#alive + 1] = p
    held[p] = h
    spec[p] = x
    masks[p] = {}
  end
end
local K = keys8(ARGV[kstart])
local nkeys = #K
local longest = 0
-- per key, one HMGET of the block hash's fields 'p:<pod>' for the pods still matching; a pod stops at
-- its first miss (held masks are read per pod in chunks of 64 keys)
local fields, hv, plain = {}, {}, true
for j, p in ipairs(alive) do
  fields[j] = 'p:' .. p
  if held[p] or spec[p] then plain = false end
end
local BP = P .. 'b:'
local i = 0
if plain then
  -- no held or speculative entries among the candidates: masks only
  local mt = {}
  for j, p in ipairs(alive) do mt[j] = masks[p] end
  local nf = #fields
  while nf > 0 and i < nkeys do
    i = i + 1
    local vals
    if nf == 1 then vals = {redis.call('HGET', BP .. K[i], fields[1])}
    else vals = redis.call('HMGET', BP .. K[i], unpack(fields)) end
    local miss = false
    for j = 1, nf do
      local m = vals[j]
      if m then local t = mt[j]; t[#t + 1] = tonumber(m) else miss = true end
    end
    if miss then
      local f2, m2 = {}, {}
      for j = 1, nf do
        if vals[j] then f2[#f2 + 1] = fields[j]; m2[#m2 + 1] = mt[j] end
      end
      fields, mt, nf = f2, m2, #f2
    end
    if nf > 0 then longest = i end
  end
  alive = {}
end
local got = {}
while #alive > 0 and i < nkeys do
  i = i + 1
  local vals = redis.call('HMGET', BP .. K[i], unpack(fields))
  local na = #alive
  local hits = 0
  for j = 1, na do
    local m = vals[j]
    if m then m = tonumber(m) else m = nil end
    if not plain then
      local p = alive[j]
      if held[p] then
        local c = hv[p]
        if c == nil or i > c.last then
          local n = math.min(64, nkeys - i + 1)
          c = {first = i, last = i + n - 1, v = redis.call('HMGET', hkey(p), unpack(K, i, i + n - 1))}
          hv[p] = c
        end
        local h = c.v[i - c.first + 1]
        if h then m = bit.bor(m or 0, tonumber(h)) end
      end
      if m == nil and spec[p] and redis.call('ZSCORE', xkey(p), K[i]) then m = gpu end
    end
    got[j] = m
    if m ~= nil then
      hits = hits + 1
      local ms = masks[alive[j]]
      ms[#ms + 1] = m
    end
  end
  if hits > 0 then longest = i end
  if hits < na then
    local a2, f2 = {}, {}
    for j = 1, na do
      if got[j] ~= nil then a2[#a2 + 1] = alive[j]; f2[#f2 + 1] = fields[j] end
    end
    alive, fields = a2, f2
  end
end
if touch and longest > 0 and lru_buckets(nil) > 0 then  -- (no buckets: the LRU holds nothing to refresh)
  if redis.call('RPUSH', LLOG, table.concat(K, '', 1, longest)) > LOG_MAX then lru_drain() end
end
local out = {expired}
for _, p in ipairs(cands) do
  local ms = masks[p]
  if ms and #ms > 0 then
    local rle = {}
    local cur, run = ms[1], 0
    for _, m in ipairs(ms) do
      if m == cur then run = run + 1 else
        rle[#rle + 1] = cur; rle[#rle + 1] = run
        cur, run = m, 1
      end
    end
    rle[#rle + 1] = cur; rle[#rle + 1] = run
    out[#out + 1] = p
    out[#out + 1] = rle
  end
end
return out
"""

# ARGV: P, now, keys... -> {expired, per key {{pod, rank, mask, ...}, {held pod, mask, ...}, {spec pods}}}
_LOOKUP = r"""
local now = now_arg(ARGV[2])
local expired = reap(now)
local hpods = redis.call('SMEMBERS', HPODS)
local xpods = redis.call('SMEMBERS', XPODS)
local out = {expired}
for i = 3, #ARGV do
  local rk = ARGV[i]
  local all = redis.call('HGETALL', bkey(rk))
  local r = {}
  for j = 1, #all, 2 do
    local rank, pod = parse_rfield(all[j])
    if rank then
      local mask = parse_entry(all[j + 1])
      r[#r + 1] = pod
      r[#r + 1] = rank
      r[#r + 1] = mask
    end
  end
  local h = {}
  for _, pod in ipairs(hpods) do
    local m = redis.call('HGET', hkey(pod), rk)
    if m then h[#h + 1] = pod; h[#h + 1] = m end
  end
  local x = {}
  for _, pod in ipairs(xpods) do
    if redis.call('ZSCORE', xkey(pod), rk) then x[#x + 1] = pod end
  end
  out[#out + 1] = {r, h, x}
end
return out
"""

# ARGV: P, pod, keys (binary, one string) -> best rank (string) or false
_BEST_RANK = r"""
local pod = ARGV[2]
local ranks, seen = {}, {}
for _, s in ipairs(redis.call('SMEMBERS', pskey(pod))) do
  local r = string.sub(s, string.find(s, ':', 1, true) + 1)
  if not seen[r] then seen[r] = true; ranks[#ranks + 1] = r end
end
local K = keys8(ARGV[3])
local first = K[1]
if #ranks == 0 or not first then return false end
if #ranks == 1 then
  -- one rank holds every block of the pod: the first key answers
  if redis.call('HEXISTS', bkey(first), 'r:' .. ranks[1] .. ':' .. pod) == 1 then return ranks[1] end
  return false
end
local alive = ranks
local best = false
for i = 1, #K do
  local fl = {}
  for j, r in ipairs(alive) do fl[j] = 'r:' .. r .. ':' .. pod end
  local vals = redis.call('HMGET', bkey(K[i]), unpack(fl))
  local nxt = {}
  for j, r in ipairs(alive) do if vals[j] then nxt[#nxt + 1] = r end end
  if #nxt == 0 then break end
  alive = nxt
  local b = nil
  for _, r in ipairs(alive) do
    if b == nil or tonumber(r) < tonumber(b) then b = r end
  end
  best = b
end
return best
"""

# ARGV: P, mid ('' = every model in level-2 order), compat, ek -> rk or false
_REQUEST_KEY_OF = r"""
local mid, compat, ek = ARGV[2], ARGV[3] == '1', ARGV[4]
if compat then
  for _, pod in ipairs(redis.call('HKEYS', PK)) do
    for _, s in ipairs(redis.call('SMEMBERS', pskey(pod))) do
      local c = string.find(s, ':', 1, true)
      local smid, srank = string.sub(s, 1, c - 1), string.sub(s, c + 1)
      if (mid == '' or smid == mid) and redis.call('HEXISTS', skey(smid, srank, pod), ek) == 1 then return ek end
    end
  end
  return false
end
local mids
if mid == '' then mids = redis.call('ZRANGE', L2ORDER, 0, -1) else mids = {mid} end
for _, m in ipairs(mids) do
  local v = redis.call('HGET', ekey(m, ek), ek)
  if v then return l2_rk(v) end
end
return false
"""

# ARGV: P, pod, rank ('' = every rank) -> request keys
_POD_KEYS = r"""
local pod, rank = ARGV[2], ARGV[3]
local out, seen = {}, {}
for _, s in ipairs(redis.call('SMEMBERS', pskey(pod))) do
  local c = string.find(s, ':', 1, true)
  local smid, srank = string.sub(s, 1, c - 1), string.sub(s, c + 1)
  if rank == '' or srank == rank then
    for _, rk in ipairs(redis.call('HVALS', skey(smid, srank, pod))) do
      if not seen[rk] then seen[rk] = true; out[#out + 1] = rk end
    end
  end
end
return out
"""

# ARGV: P -> {{pods with blocks...}, {held pods...}, {pods with speculative entries...}}
# (three lists: a pod id may be any string, the empty one included)
_PODS = r"""
local held, spec = {}, {}
for _, p in ipairs(redis.call('SMEMBERS', HPODS)) do
  -- held entries expire with the key (held_ttl): the set member outlives them
  if redis.call('EXISTS', hkey(p)) == 1 then held[#held + 1] = p else redis.call('SREM', HPODS, p) end
end
for _, p in ipairs(redis.call('SMEMBERS', XPODS)) do
  if redis.call('EXISTS', xkey(p)) == 1 then spec[#spec + 1] = p end
end
return {redis.call('HKEYS', PK), held, spec}
"""

# ARGV: P -> {keys, entries, engine_keys, pods, speculative, non-primary KV-cache group entries}
_STATS = r"""
local spec = 0
for _, p in ipairs(redis.call('SMEMBERS', XPODS)) do spec = spec + redis.call('ZCARD', xkey(p)) end
return {lru_count(), tonumber(redis.call('HGET', N, 'entries') or '0'),
        tonumber(redis.call('HGET', N, 'engine_keys') or '0'), redis.call('HLEN', PK), spec,
        redis.call('ZCARD', P .. 'gl')}
"""

READ_SCRIPTS: dict[str, str] = {
    "match": _MATCH,
    "lookup": _LOOKUP,
    "best_rank": _BEST_RANK,
    "request_key_of": _REQUEST_KEY_OF,
    "pod_keys": _POD_KEYS,
    "pods": _PODS,
    "stats": _STATS,
}
