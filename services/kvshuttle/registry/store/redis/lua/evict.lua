-- KEYS: conversation. ARGV: name, node, forget_at, now.

if not current(KEYS[1], ARGV[1]) then return {'err', 'RETENTION_NOT_FOUND'} end
local node = redis.call('HGET', KEYS[1], 'node')
if node ~= ARGV[2] then return {'err', 'NODE_MISMATCH', node} end
if redis.call('HEXISTS', KEYS[1], 'cid') == 1 then
  return {'err', 'RETENTION_ALREADY_CLAIMED', redis.call('HGET', KEYS[1], 'chold')}
end
if #live_shared(KEYS[1], tonumber(ARGV[4])) > 0 then
  return {'err', 'RETENTION_ALREADY_CLAIMED', 'shared readers'}
end
redis.call('HDEL', KEYS[1], 'sh')  -- only lapsed ones were left
return {'ok', remove_ret(KEYS[1], ARGV[3])}
