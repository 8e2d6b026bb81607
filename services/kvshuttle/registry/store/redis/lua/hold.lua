-- KEYS: node, held. ARGV: retention name, engine_id, incarnation, kv_bytes. Reply: 1 while the
-- node (that engine, that incarnation) is there, the name attached to it (again, if a refused put
-- of the same name took its attachment back); 0 when the node went away.

if redis.call('HGET', KEYS[1], 'engine') ~= ARGV[2] or redis.call('HGET', KEYS[1], 'inc') ~= ARGV[3] then
  return 0
end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[4]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'rb', tonumber(ARGV[4]))
end
return 1
