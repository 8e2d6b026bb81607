-- KEYS: conversation. ARGV: now, force ('1': the lingering bounds forget it early).

if redis.call('HEXISTS', KEYS[1], 'name') == 1 then return {'live'} end
if redis.call('HEXISTS', KEYS[1], 'fence') == 0 then return {'gone'} end
local forget = redis.call('HGET', KEYS[1], 'forget')
if ARGV[2] == '1' or (forget and tonumber(forget) <= tonumber(ARGV[1])) then
  redis.call('DEL', KEYS[1])
  return {'forgotten'}
end
return {'later', forget or ''}
