-- KEYS: conversation, idempotency entry. ARGV: name, now, request_id, fingerprint, claim_id,
-- holder, claim expire_at, idem_until, idem_px, shared ('1'/''), the node read as holding it and
-- whether that node is a pool node ('1'/''), both for a shared claim only, max shared claims.
-- Reply: {'ok', record} (a shared claim: in its `sh`), {'repeat', record, first claim id}, or
-- {'err', REASON}.

local now = tonumber(ARGV[2])
if ARGV[3] ~= '' then
  local h = idem_first(KEYS[2], now, 'claim', ARGV[4])
  if h then
    if h[1] == 'reused' then return h end
    if current(KEYS[1], ARGV[1]) then
      local held = redis.call('HGET', KEYS[1], 'cid') == h.cid
      for _, c in ipairs(live_shared(KEYS[1], now)) do held = held or c[1] == h.cid end
      if held then return {'repeat', ret_flat(KEYS[1]), h.cid} end
    end
    return {'err', 'CLAIM_ENDED'}
  end
end
if not current(KEYS[1], ARGV[1]) then return {'err', 'RETENTION_NOT_FOUND'} end
local shared = ARGV[10] == '1'
if shared then
  -- Held elsewhere than the node read: it changed hands meanwhile (a move takes a single-use
  -- claim); a retry reads it again.
  if redis.call('HGET', KEYS[1], 'node') ~= ARGV[11] then return {'err', 'RETENTION_ALREADY_CLAIMED'} end
  if ARGV[12] ~= '1' then return {'err', 'RETENTION_NOT_SHAREABLE'} end
end
local live = live_shared(KEYS[1], now)
if redis.call('HEXISTS', KEYS[1], 'cid') == 1 or #live >= (shared and tonumber(ARGV[13]) or 1) then
  return {'err', 'RETENTION_ALREADY_CLAIMED'}
end
local exp = redis.call('HGET', KEYS[1], 'exp')
if tonumber(exp) <= now then return {'err', 'RETENTION_EXPIRED'} end
if shared then  -- the lease stays the retention's own; the sweep keeps it for live readers
  live[#live + 1] = {ARGV[5], ARGV[6], ARGV[2], ARGV[7], exp}
  set_shared(KEYS[1], live)
else
  redis.call('HDEL', KEYS[1], 'sh')  -- only lapsed ones were left
  redis.call('HSET', KEYS[1], 'cid', ARGV[5], 'chold', ARGV[6], 'ctime', ARGV[2], 'cexp', ARGV[7],
    'clease', exp, 'exp', ARGV[7])
end
if ARGV[3] ~= '' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'op', 'claim', 'fp', ARGV[4], 'cid', ARGV[5], 'until', ARGV[8])
  redis.call('PEXPIRE', KEYS[2], ARGV[9])
end
return {'ok', ret_flat(KEYS[1])}
