-- The retention deadline set's members per tenant, moved by every script that adds or removes
-- one, so the count is exact (kvshuttle.registry.store.redis.bounds: it is what capacity counts).
-- KEYS[3] is that count hash and KEYS[4] the members reserved past a limit, given with the
-- retention deadline set only, as are KEYS[5..7]: the transcript bytes each member reserved
-- (name -> bytes), per tenant (tenant -> bytes) and meta (their sum, "tb"). A member's removal
-- frees its transcript bytes: they live exactly as long as the member does.

local function counted(member, delta)
  if not KEYS[3] or delta == 0 then return end
  local t = string.match(member, '^tenants/([^/]+)/') or ''
  if redis.call('HINCRBY', KEYS[3], t, delta) <= 0 then redis.call('HDEL', KEYS[3], t) end
  if delta > 0 then return end
  redis.call('HDEL', KEYS[4], member)
  local size = redis.call('HGET', KEYS[5], member)
  if size then
    redis.call('HDEL', KEYS[5], member)
    if redis.call('HINCRBY', KEYS[6], t, -tonumber(size)) <= 0 then redis.call('HDEL', KEYS[6], t) end
    redis.call('HINCRBY', KEYS[7], 'tb', -tonumber(size))
  end
end
