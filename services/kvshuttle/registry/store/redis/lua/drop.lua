-- KEYS: deadlines, versions[, counts, over]. ARGV: member. For a member whose record is gone for good.

counted(ARGV[1], -redis.call('ZREM', KEYS[1], ARGV[1]))
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
