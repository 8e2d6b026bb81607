-- KEYS: meta. ARGV: base. The next incarnation, never below base + 1.

local v = tonumber(redis.call('HGET', KEYS[1], 'inc') or '0')
local base = tonumber(ARGV[1])
if v < base then v = base end
v = v + 1
redis.call('HSET', KEYS[1], 'inc', string.format('%d', v))
return v
