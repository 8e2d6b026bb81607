-- KEYS: fence deadlines, fence sizes, meta. ARGV: conversation, forget_at, size, max count,
-- max bytes. Reply: the conversations pushed out by the bounds, oldest first.

redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[3]) == 1 then
  redis.call('HINCRBY', KEYS[3], 'lb', tonumber(ARGV[3]))
end
local out = {}
while redis.call('ZCARD', KEYS[1]) > 0 and (redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[4])
    or tonumber(redis.call('HGET', KEYS[3], 'lb') or '0') > tonumber(ARGV[5])) do
  local oldest = redis.call('ZPOPMIN', KEYS[1])[1]
  local size = redis.call('HGET', KEYS[2], oldest) or '0'
  redis.call('HDEL', KEYS[2], oldest)
  redis.call('HINCRBY', KEYS[3], 'lb', -tonumber(size))
  out[#out + 1] = oldest
end
return out
