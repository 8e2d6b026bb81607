-- KEYS: node, held, lost. ARGV: retention name.

local old = redis.call('HGET', KEYS[2], ARGV[1])
if old then
  redis.call('HDEL', KEYS[2], ARGV[1])
  if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HINCRBY', KEYS[1], 'rb', -tonumber(old)) end
end
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
