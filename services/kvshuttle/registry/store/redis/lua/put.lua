-- KEYS: conversation, idempotency entry. ARGV: now, request_id, fingerprint, generation,
-- expire_at, pin ('' none), node_error, capacity_error, idem_until, idem_px, name, node, model,
-- block_size, num_tokens, block_hashes, params, kv_bytes, holder ('' none), transcript ('' none:
-- none, or past its bounds). Reply: {'ok', ...}, or {'no', '1' when the name can no longer be
-- committed, the refusal}.

local function attempt()
  local now = tonumber(ARGV[1])
  if ARGV[2] ~= '' then
    local h = idem_first(KEYS[2], now, 'put', ARGV[3])
    if h then
      if h[1] == 'reused' then return h end
      return {'repeat', h.name, h.ct, h.exp, h.pin or '', h.rep}
    end
  end
  if ARGV[7] ~= '' then return {'err', ARGV[7]} end
  local fence = redis.call('HGET', KEYS[1], 'fence')
  if fence and int_le(ARGV[4], fence) then return {'err', 'FENCING_GENERATION_STALE', fence} end
  if ARGV[6] ~= '' and tonumber(ARGV[6]) <= now then return {'err', 'PIN_EXPIRED'} end
  local old = {}
  local oldname = ''
  if redis.call('HEXISTS', KEYS[1], 'name') == 1 then
    oldname = redis.call('HGET', KEYS[1], 'name')
    old = remove_ret(KEYS[1], '')
  elseif ARGV[8] ~= '' then
    return {'err', 'CAPACITY_EXCEEDED', ARGV[8]}
  end
  redis.call('HDEL', KEYS[1], 'forget', 'tomb_name', 'tomb_node')
  redis.call('HSET', KEYS[1], 'fence', ARGV[4], 'name', ARGV[11], 'node', ARGV[12], 'gen', ARGV[4],
    'model', ARGV[13], 'bs', ARGV[14], 'nt', ARGV[15], 'bh', ARGV[16], 'kp', ARGV[17], 'kvb', ARGV[18],
    'ct', ARGV[1], 'exp', ARGV[5])
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'pin', ARGV[6]) end
  if ARGV[19] ~= '' then redis.call('HSET', KEYS[1], 'holder', ARGV[19]) end
  if ARGV[20] ~= '' then redis.call('HSET', KEYS[1], 'tx', ARGV[20]) end
  if ARGV[21] ~= '0' then redis.call('HSET', KEYS[1], 'pb', ARGV[21]) end
  if ARGV[2] ~= '' then
    redis.call('DEL', KEYS[2])
    redis.call('HSET', KEYS[2], 'op', 'put', 'fp', ARGV[3], 'name', ARGV[11], 'ct', ARGV[1],
      'exp', ARGV[5], 'rep', oldname, 'until', ARGV[9])
    if ARGV[6] ~= '' then redis.call('HSET', KEYS[2], 'pin', ARGV[6]) end
    redis.call('PEXPIRE', KEYS[2], ARGV[10])
  end
  return {'ok', oldname, old}
end
local reply = attempt()
if reply[1] == 'ok' then return reply end
-- Failed: whether this name can never be committed now (the fence passed it, and it is not
-- the one held), so no put of it holds the place it reserved; and whether it is the one held
-- (another put of the name committed it: that put owns its index steps and its place).
local fence = redis.call('HGET', KEYS[1], 'fence')
local held = redis.call('HGET', KEYS[1], 'name') == ARGV[11]
local dead = fence and int_le(ARGV[4], fence) and not held
return {'no', dead and '1' or '', reply, held and '1' or ''}
