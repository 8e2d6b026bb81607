-- KEYS: index, sizes, meta. ARGV: now, aged-out cutoff (now - ttl), max entries, max bytes,
-- key ('' only trims), its estimated bytes. The index is in write order (a sequence in meta
-- "iseq"); `sizes` holds each key's "bytes time". Reply: the keys the bounds dropped, to delete.

local out = {}
local function pop(k)
  local v = redis.call('HGET', KEYS[2], k)
  redis.call('ZREM', KEYS[1], k)
  redis.call('HDEL', KEYS[2], k)
  if v then redis.call('HINCRBY', KEYS[3], 'ib', -tonumber(string.match(v, '^%d+'))) end
  out[#out + 1] = k
end
local cutoff = tonumber(ARGV[2])
for _ = 1, 256 do  -- aged out, from the oldest (a bounded batch a call)
  local first = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not first then break end
  local v = redis.call('HGET', KEYS[2], first) or ''
  local t = tonumber(string.match(v, ' (.+)$') or '0')
  if t > cutoff then break end
  pop(first)
end
if ARGV[5] ~= '' then
  if redis.call('ZSCORE', KEYS[1], ARGV[5]) then pop(ARGV[5]); out[#out] = nil end
  redis.call('ZADD', KEYS[1], redis.call('HINCRBY', KEYS[3], 'iseq', 1), ARGV[5])
  redis.call('HSET', KEYS[2], ARGV[5], ARGV[6] .. ' ' .. ARGV[1])
  redis.call('HINCRBY', KEYS[3], 'ib', tonumber(ARGV[6]))
end
while redis.call('ZCARD', KEYS[1]) > 0 and (redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[3])
    or tonumber(redis.call('HGET', KEYS[3], 'ib') or '0') > tonumber(ARGV[4])) do
  pop(redis.call('ZRANGE', KEYS[1], 0, 0)[1])
end
return out
