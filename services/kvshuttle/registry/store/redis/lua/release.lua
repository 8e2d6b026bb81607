-- KEYS: conversation. ARGV: name, claim_id, force ('1'/''), keep ('1'/''), now, forget_at.

if not current(KEYS[1], ARGV[1]) then return {'err', 'RETENTION_NOT_FOUND'} end
local now = tonumber(ARGV[5])
local cid = redis.call('HGET', KEYS[1], 'cid')
local live = live_shared(KEYS[1], now)
if ARGV[3] ~= '1' then
  for i, c in ipairs(live) do
    if c[1] == ARGV[2] then  -- that reader is done: the others, or the lease, keep it
      table.remove(live, i)
      set_shared(KEYS[1], live)
      if #live == 0 and tonumber(redis.call('HGET', KEYS[1], 'exp')) <= now then
        return {'expired', remove_ret(KEYS[1], ARGV[6])}
      end
      return {'unshared', ret_flat(KEYS[1])}
    end
  end
end
if ARGV[4] == '1' then
  if not cid or cid ~= ARGV[2] then
    return {'err', 'CLAIM_MISMATCH_KEEP', redis.call('HGET', KEYS[1], 'chold') or ''}
  end
  local lease = redis.call('HGET', KEYS[1], 'clease')
  if tonumber(lease) <= now then return {'expired', remove_ret(KEYS[1], ARGV[6])} end
  redis.call('HDEL', KEYS[1], unpack(C_FIELDS))
  redis.call('HSET', KEYS[1], 'exp', lease)
  return {'unclaimed', ret_flat(KEYS[1])}
end
if ARGV[3] ~= '1' and (cid or #live > 0) and ARGV[2] ~= cid then
  return {'err', 'CLAIM_MISMATCH', redis.call('HGET', KEYS[1], 'chold') or (#live .. ' shared readers')}
end
set_shared(KEYS[1], live)  -- it leaves with its live shared claims only
return {'removed', remove_ret(KEYS[1], ARGV[6])}
