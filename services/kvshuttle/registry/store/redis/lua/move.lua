-- KEYS: conversation, idempotency entry. ARGV: name, claim_id, now, request_id, fingerprint,
-- target_exists ('1'/''), target_model, target_block_size, holder_mismatch_field, node, params,
-- kv_bytes, holder ('' none), expire_at, idem_until, idem_px.

local now = tonumber(ARGV[3])
if ARGV[4] ~= '' then
  local h = idem_first(KEYS[2], now, 'move', ARGV[5])
  if h then
    if h[1] == 'reused' then return h end
    if current(KEYS[1], ARGV[1]) then return {'repeat', ret_flat(KEYS[1]), h.exp} end
    return {'err', 'MOVE_ENDED'}
  end
end
if not current(KEYS[1], ARGV[1]) then return {'err', 'RETENTION_NOT_FOUND'} end
local r = tohash(ret_flat(KEYS[1]))
if not r.cid or r.cid ~= ARGV[2] then return {'err', 'CLAIM_MISMATCH', r.chold or ''} end
if tonumber(r.exp) <= now then return {'err', 'RETENTION_EXPIRED'} end
if ARGV[6] ~= '1' then return {'err', 'NODE_NOT_FOUND'} end
if ARGV[7] ~= r.model or ARGV[8] ~= r.bs then return {'err', 'NODE_MISMATCH', r.model, r.bs} end
if ARGV[9] ~= '' then return {'err', 'HOLDER_MISMATCH', ARGV[9]} end
redis.call('HDEL', KEYS[1], 'pin', 'holder', unpack(C_FIELDS))
redis.call('HSET', KEYS[1], 'node', ARGV[10], 'kp', ARGV[11], 'kvb', ARGV[12], 'exp', ARGV[14])
if ARGV[13] ~= '' then redis.call('HSET', KEYS[1], 'holder', ARGV[13]) end
if ARGV[4] ~= '' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'op', 'move', 'fp', ARGV[5], 'exp', ARGV[14], 'until', ARGV[15])
  redis.call('PEXPIRE', KEYS[2], ARGV[16])
end
return {'ok', r.node, r.kvb, ret_flat(KEYS[1])}
