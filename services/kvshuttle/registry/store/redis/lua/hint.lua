-- KEYS: deadlines, versions[, counts, over]. ARGV: member, deadline. A deadline only ever moves earlier
-- here (LT); each write bumps the member's version, so a sweeper knows its view went stale.

counted(ARGV[1], redis.call('ZADD', KEYS[1], 'LT', ARGV[2], ARGV[1]))
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
return 1
