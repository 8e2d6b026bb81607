-- The retention record's fields (R_FIELDS, a claim's C_FIELDS) and the steps the conversation
-- scripts share: reading, matching and removing the record, its shared claims, and a remembered
-- first answer. `sh` holds the shared claims as JSON [[cid, holder, ctime, cexp, clease], ...]
-- (times as the strings Python sent), absent when there are none.

local R_FIELDS = {'name','node','gen','model','bs','nt','bh','kp','kvb','pin','ct','exp','holder',
                  'tx','pb','cid','chold','ctime','cexp','clease','sh'}
local C_FIELDS = {'cid','chold','ctime','cexp','clease'}
local function tohash(flat)
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  return h
end
local function int_le(a, b)  -- decimal integer strings without leading zeros
  if #a ~= #b then return #a < #b end
  return a <= b
end
local function ret_flat(k)
  local out = {}
  local vals = redis.call('HMGET', k, unpack(R_FIELDS))
  for i, f in ipairs(R_FIELDS) do
    if vals[i] then out[#out + 1] = f; out[#out + 1] = vals[i] end
  end
  return out
end
local function current(k, name)  -- the retention `name` if the conversation holds it
  local n = redis.call('HGET', k, 'name')
  return n and n == name
end
local function remove_ret(k, forget_at)
  local flat = ret_flat(k)
  local h = tohash(flat)
  redis.call('HDEL', k, unpack(R_FIELDS))
  redis.call('HSET', k, 'tomb_name', h.name, 'tomb_node', h.node)
  if forget_at ~= '' then redis.call('HSET', k, 'forget', forget_at) end
  return flat
end
local function idem_first(key, now, op, fp)
  local first = redis.call('HGETALL', key)
  if #first == 0 then return nil end
  local h = tohash(first)
  if tonumber(h['until']) <= now then
    redis.call('DEL', key)
    return nil
  end
  if h.op ~= op or h.fp ~= fp then return {'reused'} end
  return h
end
local function live_shared(k, now)  -- the shared claims, the lapsed ones left out
  local raw = redis.call('HGET', k, 'sh')
  local live = {}
  if raw then
    for _, c in ipairs(cjson.decode(raw)) do
      if tonumber(c[4]) > now then live[#live + 1] = c end
    end
  end
  return live
end
local function set_shared(k, claims)
  if #claims == 0 then
    redis.call('HDEL', k, 'sh')
  else
    redis.call('HSET', k, 'sh', cjson.encode(claims))
  end
end
