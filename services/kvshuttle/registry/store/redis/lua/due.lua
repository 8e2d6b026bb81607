-- KEYS: deadlines, versions. ARGV: now, limit. Reply: flat member, score, version triples.

local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, ARGV[2])
local out = {}
for i = 1, #due, 2 do
  out[#out + 1] = due[i]
  out[#out + 1] = due[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[2], due[i]) or ''
end
return out
