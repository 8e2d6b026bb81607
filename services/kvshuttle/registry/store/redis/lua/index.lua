-- KEYS: the tenant's chain ends, its transcript keys. ARGV: retention name, its chain-end field
-- ('' none), its transcript-key field ('' none), its prompt-end field ('' none; a chain end too).
-- The latest put wins a shared field.

if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], ARGV[2], ARGV[1]) end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[2], ARGV[3], ARGV[1]) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], ARGV[4], ARGV[1]) end
return 1
