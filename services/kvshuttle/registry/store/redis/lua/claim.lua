-- KEYS: conversation, idempotency entry. ARGV: name, now, request_id, fingerprint, claim_id,
-- holder, claim expire_at, idem_until, idem_px.

local now = tonumber(ARGV[2])
if ARGV[3] ~= '' then
  local h = idem_first(KEYS[2], now, 'claim', ARGV[4])
  if h then
    if h[1] == 'reused' then return h end
    if current(KEYS[1], ARGV[1]) and redis.call('HGET', KEYS[1], 'cid') == h.cid then
      return {'repeat', ret_flat(KEYS[1])}
    end
    return {'err', 'CLAIM_ENDED'}
  end
end
if not current(KEYS[1], ARGV[1]) then return {'err', 'RETENTION_NOT_FOUND'} end
if redis.call('HEXISTS', KEYS[1], 'cid') == 1 then return {'err', 'RETENTION_ALREADY_CLAIMED'} end
local exp = redis.call('HGET', KEYS[1], 'exp')
if tonumber(exp) <= now then return {'err', 'RETENTION_EXPIRED'} end
redis.call('HSET', KEYS[1], 'cid', ARGV[5], 'chold', ARGV[6], 'ctime', ARGV[2], 'cexp', ARGV[7],
  'clease', exp, 'exp', ARGV[7])
if ARGV[3] ~= '' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'op', 'claim', 'fp', ARGV[4], 'cid', ARGV[5], 'until', ARGV[8])
  redis.call('PEXPIRE', KEYS[2], ARGV[9])
end
return {'ok', ret_flat(KEYS[1])}
