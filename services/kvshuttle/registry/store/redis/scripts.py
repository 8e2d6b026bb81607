"""The Lua scripts of the Redis store (kvshuttle.registry.store.redis.store), one per atomic step.

Every script touches the keys of ONE hash slot only: a conversation's (its record and its
idempotency entries), a node's (its record, its held and lost sets), a tenant's (its name
index) or the store's global slot (deadline sets, node directory, counters). Times and
expiries arrive as strings from Python (repr of a float) and are stored as given: Lua only
compares them (tonumber), never computes a time, so no precision is lost. Generations
(< 2**63, beyond a double's exact range) are compared as decimal strings.

Replies: {'ok', ...}, {'err', REASON, detail...}, or a step-specific tag.
"""

from __future__ import annotations

_LIB = r"""
local R_FIELDS = {'name','node','gen','model','bs','nt','bh','kp','kvb','pin','ct','exp','holder',
                  'cid','chold','ctime','cexp','clease'}
local C_FIELDS = {'cid','chold','ctime','cexp','clease'}
local function tohash(flat)
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  return h
end
local function int_le(a, b)  -- decimal integer strings without leading zeros
  if #a ~= #b then return #a < #b end
  return a <= b
end
local function ret_flat(k)
  local out = {}
  local vals = redis.call('HMGET', k, unpack(R_FIELDS))
  for i, f in ipairs(R_FIELDS) do
    if vals[i] then out[#out + 1] = f; out[#out + 1] = vals[i] end
  end
  return out
end
local function current(k, name)  -- the retention `name` if the conversation holds it
  local n = redis.call('HGET', k, 'name')
  return n and n == name
end
local function remove_ret(k, forget_at)
  local flat = ret_flat(k)
  local h = tohash(flat)
  redis.call('HDEL', k, unpack(R_FIELDS))
  redis.call('HSET', k, 'tomb_name', h.name, 'tomb_node', h.node)
  if forget_at ~= '' then redis.call('HSET', k, 'forget', forget_at) end
  return flat
end
local function idem_first(key, now, op, fp)
  local first = redis.call('HGETALL', key)
  if #first == 0 then return nil end
  local h = tohash(first)
  if tonumber(h['until']) <= now then
    redis.call('DEL', key)
    return nil
  end
  if h.op ~= op or h.fp ~= fp then return {'reused'} end
  return h
end
"""

# KEYS: conversation, idempotency entry. ARGV: now, request_id, fingerprint, generation,
# expire_at, pin ('' none), node_error, capacity_error, idem_until, idem_px, name, node, model,
# block_size, num_tokens, block_hashes, params, kv_bytes, holder ('' none). Reply: {'ok', ...}, or
# {'no', '1' when the name can no longer be committed, the refusal}.
PUT = (
    _LIB
    + r"""
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
-- the one held), so no put of it holds the place it reserved.
local fence = redis.call('HGET', KEYS[1], 'fence')
local dead = fence and int_le(ARGV[4], fence) and redis.call('HGET', KEYS[1], 'name') ~= ARGV[11]
return {'no', dead and '1' or '', reply}
"""
)

# KEYS: conversation. ARGV: name, now, candidate expire_at (now + min(ttl, max_ttl)).
RENEW = (
    _LIB
    + r"""
if not current(KEYS[1], ARGV[1]) then return {'err', 'RETENTION_NOT_FOUND'} end
if redis.call('HEXISTS', KEYS[1], 'cid') == 1 then return {'err', 'RETENTION_CLAIMED'} end
local exp = redis.call('HGET', KEYS[1], 'exp')
if tonumber(exp) <= tonumber(ARGV[2]) then return {'err', 'RETENTION_EXPIRED'} end
local e = ARGV[3]
local pin = redis.call('HGET', KEYS[1], 'pin')
if pin and tonumber(pin) < tonumber(e) then e = pin end
if tonumber(e) > tonumber(exp) then redis.call('HSET', KEYS[1], 'exp', e) end
return {'ok', ret_flat(KEYS[1])}
"""
)

# KEYS: conversation, idempotency entry. ARGV: name, now, request_id, fingerprint, claim_id,
# holder, claim expire_at, idem_until, idem_px.
CLAIM = (
    _LIB
    + r"""
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
"""
)

# KEYS: conversation. ARGV: name, claim_id, force ('1'/''), keep ('1'/''), now, forget_at.
RELEASE = (
    _LIB
    + r"""
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
"""
)

# KEYS: conversation, idempotency entry. ARGV: name, claim_id, now, request_id, fingerprint,
# target_exists ('1'/''), target_model, target_block_size, holder_mismatch_field, node, params,
# kv_bytes, holder ('' none), expire_at, idem_until, idem_px.
MOVE = (
    _LIB
    + r"""
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
"""
)

# KEYS: conversation. ARGV: name, node, forget_at.
EVICT = (
    _LIB
    + r"""
if not current(KEYS[1], ARGV[1]) then return {'err', 'RETENTION_NOT_FOUND'} end
local node = redis.call('HGET', KEYS[1], 'node')
if node ~= ARGV[2] then return {'err', 'NODE_MISMATCH', node} end
if redis.call('HEXISTS', KEYS[1], 'cid') == 1 then
  return {'err', 'RETENTION_ALREADY_CLAIMED', redis.call('HGET', KEYS[1], 'chold')}
end
return {'ok', remove_ret(KEYS[1], ARGV[3])}
"""
)

# The node cascade's step, and a put's compensation when its node went away meanwhile.
# KEYS: conversation. ARGV: name, node, forget_at. Reply: the removed record, or {}.
DROP_IF = (
    _LIB
    + r"""
if current(KEYS[1], ARGV[1]) and redis.call('HGET', KEYS[1], 'node') == ARGV[2] then
  return remove_ret(KEYS[1], ARGV[3])
end
return {}
"""
)

# KEYS: conversation. ARGV: name, now, forget_at.
EXPIRE_RETENTION = (
    _LIB
    + r"""
if current(KEYS[1], ARGV[1]) then
  local exp = redis.call('HGET', KEYS[1], 'exp')
  if tonumber(exp) <= tonumber(ARGV[2]) then return {'expired', remove_ret(KEYS[1], ARGV[3])} end
  return {'alive', exp}
end
local tomb = redis.call('HMGET', KEYS[1], 'tomb_name', 'tomb_node')
if tomb[1] and tomb[1] == ARGV[1] then return {'gone', tomb[2]} end
return {'gone', ''}
"""
)

# KEYS: conversation. ARGV: now, force ('1': the lingering bounds forget it early).
FORGET_FENCE = r"""
if redis.call('HEXISTS', KEYS[1], 'name') == 1 then return {'live'} end
if redis.call('HEXISTS', KEYS[1], 'fence') == 0 then return {'gone'} end
local forget = redis.call('HGET', KEYS[1], 'forget')
if ARGV[2] == '1' or (forget and tonumber(forget) <= tonumber(ARGV[1])) then
  redis.call('DEL', KEYS[1])
  return {'forgotten'}
end
return {'later', forget or ''}
"""

_NODE_LIB = r"""
local function move_held(held, lost)
  local flat = redis.call('HGETALL', held)
  for i = 1, #flat, 2 do redis.call('HSET', lost, flat[i], flat[i + 1]) end
  redis.call('DEL', held)
  return redis.call('HGETALL', lost)
end
local function node_flat(k, held)
  local flat = redis.call('HGETALL', k)
  flat[#flat + 1] = 'count'
  flat[#flat + 1] = tostring(redis.call('HLEN', held))
  return flat
end
"""

# KEYS: node, held, lost. ARGV: spec, engine_id, incarnation, now, expire_at, load.
REGISTER_NODE = (
    _NODE_LIB
    + r"""
local existed = redis.call('EXISTS', KEYS[1]) == 1
local changed = '0'
local lost = {}
local rb = '0'
if existed then
  if redis.call('HGET', KEYS[1], 'engine') ~= ARGV[2] then
    changed = '1'
    lost = move_held(KEYS[2], KEYS[3])
  else
    rb = redis.call('HGET', KEYS[1], 'rb') or '0'
  end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'spec', ARGV[1], 'engine', ARGV[2], 'inc', ARGV[3], 'rt', ARGV[4],
  'exp', ARGV[5], 'load', ARGV[6], 'rb', rb)
return {existed and '1' or '0', changed, node_flat(KEYS[1], KEYS[2]), lost}
"""
)

# KEYS: node, held. ARGV: incarnation, expire_at, load.
HEARTBEAT_NODE = (
    _NODE_LIB
    + r"""
local inc = redis.call('HGET', KEYS[1], 'inc')
if not inc then return {'err', 'NODE_NOT_FOUND'} end
if inc ~= ARGV[1] then return {'err', 'NODE_INCARNATION_MISMATCH', inc} end
redis.call('HSET', KEYS[1], 'exp', ARGV[2], 'load', ARGV[3])
return {'ok', node_flat(KEYS[1], KEYS[2])}
"""
)

# KEYS: node, held, lost. ARGV: incarnation ('' any), now, mode ('deregister' | 'expire').
REMOVE_NODE = (
    _NODE_LIB
    + r"""
local inc = redis.call('HGET', KEYS[1], 'inc')
if not inc then
  if ARGV[3] == 'deregister' then return {'err', 'NODE_NOT_FOUND'} end
  return {'gone', redis.call('HGETALL', KEYS[3])}
end
if ARGV[1] ~= '' and inc ~= ARGV[1] then return {'err', 'NODE_INCARNATION_MISMATCH', inc} end
if ARGV[3] == 'expire' then
  local exp = redis.call('HGET', KEYS[1], 'exp')
  if tonumber(exp) > tonumber(ARGV[2]) then return {'alive', exp} end
end
local snap = node_flat(KEYS[1], KEYS[2])
local lost = move_held(KEYS[2], KEYS[3])
redis.call('DEL', KEYS[1])
return {'removed', snap, lost}
"""
)

# KEYS: node, held. ARGV: retention name, kv_bytes, engine_id, '1' to set the bytes of one
# attached already. Reply: 0 no such node (that engine), 1 attached anew, 2 attached already.
ATTACH = r"""
if redis.call('HGET', KEYS[1], 'engine') ~= ARGV[3] then return 0 end
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old and ARGV[4] ~= '1' then return 2 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'rb', tonumber(ARGV[2]) - tonumber(old or '0'))
if old then return 2 end
return 1
"""

# KEYS: node, held. ARGV: retention name, engine_id. Reply: 1 while the node (that engine)
# still holds it.
HOLDS = r"""
if redis.call('HGET', KEYS[1], 'engine') ~= ARGV[2] then return 0 end
return redis.call('HEXISTS', KEYS[2], ARGV[1])
"""

# KEYS: node, held, lost. ARGV: retention name.
DETACH = r"""
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old then
  redis.call('HDEL', KEYS[2], ARGV[1])
  if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HINCRBY', KEYS[1], 'rb', -tonumber(old)) end
end
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""

# ---- the global slot ------------------------------------------------------------------------

# The retention deadline set's members per tenant, moved by every script that adds or removes
# one, so the count is exact (kvshuttle.registry.store.redis.bounds: it is what capacity counts).
# KEYS[3] is that count hash and KEYS[4] the members reserved past a limit, given with the
# retention deadline set only.
COUNTED_LIB = r"""
local function counted(member, delta)
  if not KEYS[3] or delta == 0 then return end
  local t = string.match(member, '^tenants/([^/]+)/') or ''
  if redis.call('HINCRBY', KEYS[3], t, delta) <= 0 then redis.call('HDEL', KEYS[3], t) end
  if delta < 0 then redis.call('HDEL', KEYS[4], member) end
end
"""

# KEYS: deadlines, versions[, counts, over]. ARGV: member, deadline. A deadline only ever moves earlier
# here (LT); each write bumps the member's version, so a sweeper knows its view went stale.
HINT = (
    COUNTED_LIB
    + r"""
counted(ARGV[1], redis.call('ZADD', KEYS[1], 'LT', ARGV[2], ARGV[1]))
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
return 1
"""
)

# KEYS: deadlines, versions. ARGV: now, limit. Reply: flat member, score, version triples.
DUE = r"""
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, ARGV[2])
local out = {}
for i = 1, #due, 2 do
  out[#out + 1] = due[i]
  out[#out + 1] = due[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[2], due[i]) or ''
end
return out
"""

# KEYS: deadlines, versions[, counts, over]. ARGV: member, version seen when due, deadline ('' :
# remove). Unchanged since seen: set (or remove) it. Written meanwhile: only ever move it earlier.
RESCHEDULE = (
    COUNTED_LIB
    + r"""
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
"""
)

# KEYS: deadlines, versions[, counts, over]. ARGV: member. For a member whose record is gone for good.
DROP = (
    COUNTED_LIB
    + r"""
counted(ARGV[1], -redis.call('ZREM', KEYS[1], ARGV[1]))
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""
)

# KEYS: directory, node deadlines, node versions. ARGV: name, max_nodes, expire_at.
RESERVE_NODE = r"""
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], 0, ARGV[1])
redis.call('ZADD', KEYS[2], 'LT', ARGV[3], ARGV[1])
redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
return 1
"""

# KEYS: directory, node deadlines, node versions. ARGV: name, version seen before the removal.
UNINDEX_NODE = r"""
if (redis.call('HGET', KEYS[3], ARGV[1]) or '') ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""

# KEYS: meta. ARGV: base. The next incarnation, never below base + 1.
NEXT_INCARNATION = r"""
local v = tonumber(redis.call('HGET', KEYS[1], 'inc') or '0')
local base = tonumber(ARGV[1])
if v < base then v = base end
v = v + 1
redis.call('HSET', KEYS[1], 'inc', string.format('%d', v))
return v
"""

# KEYS: fence deadlines, fence sizes, meta. ARGV: conversation, forget_at, size, max count,
# max bytes. Reply: the conversations pushed out by the bounds, oldest first.
LINGER = r"""
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[3]) == 1 then
  redis.call('HINCRBY', KEYS[3], 'lb', tonumber(ARGV[3]))
end
local out = {}
while redis.call('ZCARD', KEYS[1]) > 0 and (redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[4])
    or tonumber(redis.call('HGET', KEYS[3], 'lb') or '0') > tonumber(ARGV[5])) do
  local oldest = redis.call('ZPOPMIN', KEYS[1])[1]
  local size = redis.call('HGET', KEYS[2], oldest) or '0'
  redis.call('HDEL', KEYS[2], oldest)
  redis.call('HINCRBY', KEYS[3], 'lb', -tonumber(size))
  out[#out + 1] = oldest
end
return out
"""

# KEYS: fence deadlines, fence sizes, meta. ARGV: conversation, at most this deadline ('' any).
UNLINGER = r"""
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and (ARGV[2] == '' or tonumber(score) <= tonumber(ARGV[2])) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  local size = redis.call('HGET', KEYS[2], ARGV[1]) or '0'
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[3], 'lb', -tonumber(size))
end
return 1
"""

# KEYS: deadlines. ARGV: member, deadline: move it later, if it is there.
LATER = r"""
redis.call('ZADD', KEYS[1], 'XX', 'GT', ARGV[2], ARGV[1])
return 1
"""

# ---- the bounds (kvshuttle.registry.store.redis.bounds) ---------------------------------------

# KEYS: retention deadlines, versions, counts, over. ARGV: name, deadline, max_retentions,
# max_retentions_per_tenant. Reply: {1 if this added the member, its version, the limit a new
# retention would pass ('' none)}. A member added past a limit keeps that limit (`over`) for
# other puts of its name, until it is removed.
RESERVE = (
    COUNTED_LIB
    + r"""
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
return {added, redis.call('HINCRBY', KEYS[2], ARGV[1], 1), limit}
"""
)

# KEYS: retention deadlines, versions, counts, over. ARGV: name, the version its reservation got
# ('' whatever wrote it since: its name can no longer be committed). Reply: 1 removed, 0 kept.
UNRESERVE = (
    COUNTED_LIB
    + r"""
if ARGV[2] ~= '' and redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
counted(ARGV[1], -redis.call('ZREM', KEYS[1], ARGV[1]))
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""
)

# KEYS: index, sizes, meta. ARGV: now, aged-out cutoff (now - ttl), max entries, max bytes,
# key ('' only trims), its estimated bytes. The index is in write order (a sequence in meta
# "iseq"); `sizes` holds each key's "bytes time". Reply: the keys the bounds dropped, to delete.
REMEMBER = r"""
local out = {}
local function pop(k)
  local v = redis.call('HGET', KEYS[2], k)
  redis.call('ZREM', KEYS[1], k)
  redis.call('HDEL', KEYS[2], k)
  if v then redis.call('HINCRBY', KEYS[3], 'ib', -tonumber(string.match(v, '^%d+'))) end
  out[#out + 1] = k
end
local cutoff = tonumber(ARGV[2])
for _ = 1, 256 do  -- aged out, from the oldest (a bounded batch a call)
  local first = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not first then break end
  local v = redis.call('HGET', KEYS[2], first) or ''
  local t = tonumber(string.match(v, ' (.+)$') or '0')
  if t > cutoff then break end
  pop(first)
end
if ARGV[5] ~= '' then
  if redis.call('ZSCORE', KEYS[1], ARGV[5]) then pop(ARGV[5]); out[#out] = nil end
  redis.call('ZADD', KEYS[1], redis.call('HINCRBY', KEYS[3], 'iseq', 1), ARGV[5])
  redis.call('HSET', KEYS[2], ARGV[5], ARGV[6] .. ' ' .. ARGV[1])
  redis.call('HINCRBY', KEYS[3], 'ib', tonumber(ARGV[6]))
end
while redis.call('ZCARD', KEYS[1]) > 0 and (redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[3])
    or tonumber(redis.call('HGET', KEYS[3], 'ib') or '0') > tonumber(ARGV[4])) do
  pop(redis.call('ZRANGE', KEYS[1], 0, 0)[1])
end
return out
"""

SCRIPTS: dict[str, str] = {
    "put": PUT,
    "renew": RENEW,
    "claim": CLAIM,
    "release": RELEASE,
    "move": MOVE,
    "evict": EVICT,
    "drop_if": DROP_IF,
    "expire_retention": EXPIRE_RETENTION,
    "forget_fence": FORGET_FENCE,
    "register_node": REGISTER_NODE,
    "heartbeat_node": HEARTBEAT_NODE,
    "remove_node": REMOVE_NODE,
    "attach": ATTACH,
    "detach": DETACH,
    "holds": HOLDS,
    "hint": HINT,
    "due": DUE,
    "reschedule": RESCHEDULE,
    "drop": DROP,
    "reserve_node": RESERVE_NODE,
    "unindex_node": UNINDEX_NODE,
    "next_incarnation": NEXT_INCARNATION,
    "linger": LINGER,
    "unlinger": UNLINGER,
    "later": LATER,
    "reserve": RESERVE,
    "unreserve": UNRESERVE,
    "remember": REMEMBER,
}
