-- KEYS: conversation. ARGV: name, now, forget_at. Reply: {'expired', record}, {'alive', when to
-- look again: its lease, or past it the latest live shared claim's expiry}, or {'gone', node}.

if current(KEYS[1], ARGV[1]) then
  local now = tonumber(ARGV[2])
  local exp = redis.call('HGET', KEYS[1], 'exp')
  if tonumber(exp) > now then return {'alive', exp} end
  local live = live_shared(KEYS[1], now)  -- past its lease: its live readers hold it
  set_shared(KEYS[1], live)
  local last
  for _, c in ipairs(live) do
    if not last or tonumber(c[4]) > tonumber(last) then last = c[4] end
  end
  if last then return {'alive', last} end
  return {'expired', remove_ret(KEYS[1], ARGV[3])}
end
local tomb = redis.call('HMGET', KEYS[1], 'tomb_name', 'tomb_node')
if tomb[1] and tomb[1] == ARGV[1] then return {'gone', tomb[2]} end
return {'gone', ''}
