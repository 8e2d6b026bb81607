-- KEYS: retention deadlines, versions, counts, over, transcript sizes, tenant transcript bytes,
-- meta. ARGV: name, deadline, max_retentions, max_retentions_per_tenant, transcript bytes (0:
-- none), transcript_max_bytes_per_tenant, transcript_max_bytes. Reply: {1 if this added the
-- member, its version, the limit a new retention would pass ('' none), '1' if the transcript's
-- bytes are reserved}. A member added past a limit keeps that limit (`over`) for other puts of its
-- name, until it is removed. A name's transcript reservation only grows (another put of the name
-- may hold it): it is the most any put of the name reserved.

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
local tx = ''
local size = tonumber(ARGV[5])
if size > 0 then
  local t = string.match(ARGV[1], '^tenants/([^/]+)/') or ''
  local delta = size - tonumber(redis.call('HGET', KEYS[5], ARGV[1]) or '0')
  if delta <= 0 then
    tx = '1'
  elseif tonumber(redis.call('HGET', KEYS[6], t) or '0') + delta <= tonumber(ARGV[6])
      and tonumber(redis.call('HGET', KEYS[7], 'tb') or '0') + delta <= tonumber(ARGV[7]) then
    redis.call('HSET', KEYS[5], ARGV[1], size)
    redis.call('HINCRBY', KEYS[6], t, delta)
    redis.call('HINCRBY', KEYS[7], 'tb', delta)
    tx = '1'
  end
end
return {added, redis.call('HINCRBY', KEYS[2], ARGV[1], 1), limit, tx}
