-- KEYS: fence deadlines, fence sizes, meta. ARGV: conversation, at most this deadline ('' any).

local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and (ARGV[2] == '' or tonumber(score) <= tonumber(ARGV[2])) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  local size = redis.call('HGET', KEYS[2], ARGV[1]) or '0'
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[3], 'lb', -tonumber(size))
end
return 1
