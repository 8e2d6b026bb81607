-- KEYS: retention deadlines, versions, counts, over. ARGV: name, the version its reservation got
-- ('' whatever wrote it since: its name can no longer be committed). Reply: 1 removed, 0 kept.

if ARGV[2] ~= '' and redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
counted(ARGV[1], -redis.call('ZREM', KEYS[1], ARGV[1]))
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
