"""The Redis store's bounds (kvshuttle.registry.store.redis.store): the capacity limits, held under
concurrency, and the remembered request answers, bounded by count and bytes as well as age.

Capacity. What counts against `max_retentions` (and `max_retentions_per_tenant`) is the members
of the retention deadline set `{P}:rdl`, and per tenant the count hash `{P}:rcount` that every
script adding or removing a member moves in the same step (redis_scripts COUNTED_LIB). A put
adds its name there BEFORE its commit, in one script on the global slot that decides the
verdict from the counts as they are (RESERVE): so the deadline hint a put always wrote is its
reservation, and concurrent puts cannot pass a limit by their number. The member is added even
over the limit: the conversation's commit script still lets a replacement in (it takes no
capacity: one retention per conversation) and refuses a new one; a put whose commit made
nothing (refused, replayed) takes its reservation back, only if no other put of that name
wrote it since (the version it got). Every removal path already drops the member (`_retired`,
the sweeper's clean-up of a name whose record is gone), each at most once because a ZREM of
an absent member changes no count. A replica dying between its reservation and its commit
leaves a member with the put's deadline: the sweeper finds the name gone when it is due and
drops it, so the count is back by then. Until then the count is high, never low: a crash can
refuse a put early, never let one past the limit.

Remembered answers. Each first answer is a key of its conversation's slot (with a PEXPIRE of
idempotency_ttl); a successful put, claim or move with a request id then indexes it in the
global slot, `{P}:idem` (keys in write order) and `{P}:isz` (key -> estimated bytes and write
time; the bytes' sum in `{P}:meta` "ib"), in one script that drops what aged out and, past
`idempotency_max_entries` or `..._max_bytes`, the oldest; Python deletes those keys (each in its
own slot). Global, not per conversation: the same bounds as the in-memory store's, whatever the
spread over conversations; it costs one script on the global slot per remembered answer. A
replica dying between the answer's write and its indexing leaves an unindexed answer that its
PEXPIRE still ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvshuttle.registry.store.redis.codec import _s, _t
from kvshuttle.registry.store.redis.keys import RedisStoreBase
from kvshuttle.registry.store.redis.scripts import COUNTED_LIB, SCRIPTS

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

BOUND_SCRIPTS: dict[str, str] = {"reserve": RESERVE, "unreserve": UNRESERVE, "remember": REMEMBER}

# Bytes one remembered answer costs in Redis beyond its key's characters (counted three times:
# the key, its index member, its size field) and its values': the hash, the key's expiry and the
# index entries (measured with MEMORY USAGE on Redis 7.0, 200 put answers with 84-character keys:
# 358 bytes the answer, 352 its index entries, a skiplist past 128 members; the estimate then
# says 746). tests/registry/test_redis_bounds.py checks it stays above what Redis reports.
REMEMBERED_OVERHEAD = 360


class RedisBounds(RedisStoreBase):
    """Capacity reservations and the remembered answers' index (see the module docstring)."""

    _SCRIPTS: ClassVar[dict[str, str]] = {**SCRIPTS, **BOUND_SCRIPTS}

    async def _reserve(self, name: str, deadline: float) -> tuple[bool, int, str]:
        """Reserve `name`'s place (its deadline member). Returns whether this added it, the
        version it got and the limit a NEW retention would pass ("" none)."""
        limits = self._limits
        added, version, limit = await self._run(
            "reserve",
            self._rdl,
            [name, _t(deadline), limits.max_retentions, limits.max_retentions_per_tenant],
        )
        self._soon(deadline)
        return bool(added), int(version), _s(limit)

    async def _unreserve(self, name: str, version: int | None) -> bool:
        """Take back the reservation that got `version`, unless a write of `name` came since
        (None: whatever wrote it, for a name that can no longer be committed)."""
        return bool(await self._run("unreserve", self._rdl, [name, "" if version is None else version]))

    async def _remember(self, key: str, values: Sequence[str | bytes], now: float) -> None:
        """Index the remembered answer `key` (just written), and delete what the bounds drop."""
        size = REMEMBERED_OVERHEAD + 3 * len(key) + sum(len(v) for v in values)
        await self._trim(now, key, size)

    async def _trim(self, now: float, key: str = "", size: int = 0) -> None:
        limits = self._limits
        dropped = await self._run(
            "remember",
            [self._k_idem, self._k_isz, self._k_meta],
            [
                _t(now),
                _t(now - limits.idempotency_ttl),
                limits.idempotency_max_entries,
                limits.idempotency_max_bytes,
                key,
                size,
            ],
        )
        if dropped:
            pipe = self._redis.pipeline(transaction=False)
            for raw in dropped:  # one key a command: a Cluster's keys lie in many slots
                pipe.execute_command("UNLINK", _s(raw))
            await pipe.execute()
