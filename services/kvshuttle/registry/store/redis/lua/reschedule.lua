-- KEYS: deadlines, versions[, counts, over]. ARGV: member, version seen when due, deadline ('' :
-- remove). Unchanged since seen: set (or remove) it. Written meanwhile: only ever move it earlier.

local ver = redis.call('HGET', KEYS[2], ARGV[1]) or ''
if ver == ARGV[2] then
  if ARGV[3] == '' then
    counted(ARGV[1], -redis.call('ZREM', KEYS[1], ARGV[1]))
    redis.call('HDEL', KEYS[2], ARGV[1])
  else
    counted(ARGV[1], redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1]))
  end
elseif ARGV[3] ~= '' then
  counted(ARGV[1], redis.call('ZADD', KEYS[1], 'LT', ARGV[3], ARGV[1]))
end
return 1
