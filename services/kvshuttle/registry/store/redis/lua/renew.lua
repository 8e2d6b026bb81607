-- KEYS: conversation. ARGV: name, now, candidate expire_at (now + min(ttl, max_ttl)).

if not current(KEYS[1], ARGV[1]) then return {'err', 'RETENTION_NOT_FOUND'} end
if redis.call('HEXISTS', KEYS[1], 'cid') == 1 then return {'err', 'RETENTION_CLAIMED'} end
local exp = redis.call('HGET', KEYS[1], 'exp')
if tonumber(exp) <= tonumber(ARGV[2]) then return {'err', 'RETENTION_EXPIRED'} end
local e = ARGV[3]
local pin = redis.call('HGET', KEYS[1], 'pin')
if pin and tonumber(pin) < tonumber(e) then e = pin end
if tonumber(e) > tonumber(exp) then redis.call('HSET', KEYS[1], 'exp', e) end
return {'ok', ret_flat(KEYS[1])}
