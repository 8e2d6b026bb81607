-- KEYS: node, held. ARGV: incarnation, expire_at, load.

local inc = redis.call('HGET', KEYS[1], 'inc')
if not inc then return {'err', 'NODE_NOT_FOUND'} end
if inc ~= ARGV[1] then return {'err', 'NODE_INCARNATION_MISMATCH', inc} end
redis.call('HSET', KEYS[1], 'exp', ARGV[2], 'load', ARGV[3])
return {'ok', node_flat(KEYS[1], KEYS[2])}
