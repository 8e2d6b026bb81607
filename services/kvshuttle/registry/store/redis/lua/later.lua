-- KEYS: deadlines. ARGV: member, deadline: move it later, if it is there.

redis.call('ZADD', KEYS[1], 'XX', 'GT', ARGV[2], ARGV[1])
return 1
