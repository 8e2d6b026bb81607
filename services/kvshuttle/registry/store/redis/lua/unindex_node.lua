-- KEYS: directory, node deadlines, node versions. ARGV: name, version seen before the removal.

if (redis.call('HGET', KEYS[3], ARGV[1]) or '') ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
