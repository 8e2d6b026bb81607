-- The node cascade's step, and a put's compensation when its node went away meanwhile.
-- KEYS: conversation. ARGV: name, node, forget_at. Reply: the removed record, or {}.

if current(KEYS[1], ARGV[1]) and redis.call('HGET', KEYS[1], 'node') == ARGV[2] then
  return remove_ret(KEYS[1], ARGV[3])
end
return {}
