-- KEYS: node, held. ARGV: retention name, engine_id. Reply: 1 while the node (that engine)
-- still holds it.

if redis.call('HGET', KEYS[1], 'engine') ~= ARGV[2] then return 0 end
return redis.call('HEXISTS', KEYS[2], ARGV[1])
