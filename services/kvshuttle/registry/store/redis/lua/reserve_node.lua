-- KEYS: directory, node deadlines, node versions. ARGV: name, max_nodes, expire_at.

if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], 0, ARGV[1])
redis.call('ZADD', KEYS[2], 'LT', ARGV[3], ARGV[1])
redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
return 1
