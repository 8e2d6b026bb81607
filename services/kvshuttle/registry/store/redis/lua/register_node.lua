-- KEYS: node, held, lost. ARGV: spec, engine_id, incarnation, now, expire_at, load.

local existed = redis.call('EXISTS', KEYS[1]) == 1
local changed = '0'
local lost = {}
local rb = '0'
if existed then
  if redis.call('HGET', KEYS[1], 'engine') ~= ARGV[2] then
    changed = '1'
    lost = move_held(KEYS[2], KEYS[3])
  else
    rb = redis.call('HGET', KEYS[1], 'rb') or '0'
  end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'spec', ARGV[1], 'engine', ARGV[2], 'inc', ARGV[3], 'rt', ARGV[4],
  'exp', ARGV[5], 'load', ARGV[6], 'rb', rb)
return {existed and '1' or '0', changed, node_flat(KEYS[1], KEYS[2]), lost}
