-- KEYS: node, held, lost. ARGV: incarnation ('' any), now, mode ('deregister' | 'expire').

local inc = redis.call('HGET', KEYS[1], 'inc')
if not inc then
  if ARGV[3] == 'deregister' then return {'err', 'NODE_NOT_FOUND'} end
  return {'gone', redis.call('HGETALL', KEYS[3])}
end
if ARGV[1] ~= '' and inc ~= ARGV[1] then return {'err', 'NODE_INCARNATION_MISMATCH', inc} end
if ARGV[3] == 'expire' then
  local exp = redis.call('HGET', KEYS[1], 'exp')
  if tonumber(exp) > tonumber(ARGV[2]) then return {'alive', exp} end
end
local snap = node_flat(KEYS[1], KEYS[2])
local lost = move_held(KEYS[2], KEYS[3])
redis.call('DEL', KEYS[1])
return {'removed', snap, lost}
