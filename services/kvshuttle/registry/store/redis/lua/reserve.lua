-- KEYS: retention deadlines, versions, counts, over. ARGV: name, deadline, max_retentions,
-- max_retentions_per_tenant. Reply: {1 if this added the member, its version, the limit a new
-- retention would pass ('' none)}. A member added past a limit keeps that limit (`over`) for
-- other puts of its name, until it is removed.

local limit = ''
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  limit = redis.call('HGET', KEYS[4], ARGV[1]) or ''
else
  local t = string.match(ARGV[1], '^tenants/([^/]+)/') or ''
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
    limit = 'max_retentions'
  elseif tonumber(redis.call('HGET', KEYS[3], t) or '0') >= tonumber(ARGV[4]) then
    limit = 'max_retentions_per_tenant'
  end
  if limit ~= '' then redis.call('HSET', KEYS[4], ARGV[1], limit) end
end
local added = redis.call('ZADD', KEYS[1], 'LT', ARGV[2], ARGV[1])
counted(ARGV[1], added)
return {added, redis.call('HINCRBY', KEYS[2], ARGV[1], 1), limit}
