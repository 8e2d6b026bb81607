-- KEYS: node, held. ARGV: retention name, kv_bytes, engine_id, '1' to set the bytes of one
-- attached already. Reply: 0 no such node (that engine), 1 attached anew, 2 attached already.

if redis.call('HGET', KEYS[1], 'engine') ~= ARGV[3] then return 0 end
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old and ARGV[4] ~= '1' then return 2 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'rb', tonumber(ARGV[2]) - tonumber(old or '0'))
if old then return 2 end
return 1
