-- KEYS: conversation. ARGV: name, claim_id, force ('1'/''), keep ('1'/''), now, forget_at.

if not current(KEYS[1], ARGV[1]) then return {'err', 'RETENTION_NOT_FOUND'} end
local cid = redis.call('HGET', KEYS[1], 'cid')
if ARGV[4] == '1' then
  if not cid or cid ~= ARGV[2] then
    return {'err', 'CLAIM_MISMATCH_KEEP', redis.call('HGET', KEYS[1], 'chold') or ''}
  end
  local lease = redis.call('HGET', KEYS[1], 'clease')
  if tonumber(lease) <= tonumber(ARGV[5]) then return {'expired', remove_ret(KEYS[1], ARGV[6])} end
  redis.call('HDEL', KEYS[1], unpack(C_FIELDS))
  redis.call('HSET', KEYS[1], 'exp', lease)
  return {'unclaimed', ret_flat(KEYS[1])}
end
if cid and ARGV[3] ~= '1' and ARGV[2] ~= cid then
  return {'err', 'CLAIM_MISMATCH', redis.call('HGET', KEYS[1], 'chold')}
end
return {'removed', remove_ret(KEYS[1], ARGV[6])}
