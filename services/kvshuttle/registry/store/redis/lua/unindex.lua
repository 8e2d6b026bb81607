-- KEYS: the tenant's chain ends, its transcript keys. ARGV: retention name, its chain-end field
-- ('' none), its transcript-key field ('' none), its prompt-end field ('' none; a chain end too).
-- Each removed only if it still names the retention (a later put may own it).

if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], ARGV[2]) == ARGV[1] then
  redis.call('HDEL', KEYS[1], ARGV[2])
end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[2], ARGV[3]) == ARGV[1] then
  redis.call('HDEL', KEYS[2], ARGV[3])
end
if ARGV[4] ~= '' and redis.call('HGET', KEYS[1], ARGV[4]) == ARGV[1] then
  redis.call('HDEL', KEYS[1], ARGV[4])
end
return 1
