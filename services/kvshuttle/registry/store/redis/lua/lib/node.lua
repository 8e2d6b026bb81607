-- The steps the node scripts share: moving held retentions to lost, and the node's record.

local function move_held(held, lost)
  local flat = redis.call('HGETALL', held)
  for i = 1, #flat, 2 do redis.call('HSET', lost, flat[i], flat[i + 1]) end
  redis.call('DEL', held)
  return redis.call('HGETALL', lost)
end
local function node_flat(k, held)
  local flat = redis.call('HGETALL', k)
  flat[#flat + 1] = 'count'
  flat[#flat + 1] = tostring(redis.call('HLEN', held))
  return flat
end
