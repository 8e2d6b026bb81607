-- KEYS: conversation. ARGV: name, now, forget_at.

if current(KEYS[1], ARGV[1]) then
  local exp = redis.call('HGET', KEYS[1], 'exp')
  if tonumber(exp) <= tonumber(ARGV[2]) then return {'expired', remove_ret(KEYS[1], ARGV[3])} end
  return {'alive', exp}
end
local tomb = redis.call('HMGET', KEYS[1], 'tomb_name', 'tomb_node')
if tomb[1] and tomb[1] == ARGV[1] then return {'gone', tomb[2]} end
return {'gone', ''}
