"""The Redis store's bounds (kvshuttle.registry.store.redis.store): the capacity limits, held under
concurrency, and the remembered request answers, bounded by count and bytes as well as age.

Capacity. What counts against `max_retentions` (and `max_retentions_per_tenant`) is the members
of the retention deadline set `{P}:rdl`, and per tenant the count hash `{P}:rcount` that every
script adding or removing a member moves in the same step (lua/lib/counted.lua). A put
adds its name there BEFORE its commit, in one script on the global slot that decides the
verdict from the counts as they are (RESERVE): so the deadline hint a put always wrote is its
reservation, and concurrent puts cannot pass a limit by their number. The member is added even
over the limit: the conversation's commit script still lets a replacement in (it takes no
capacity: one retention per conversation) and refuses a new one; a put whose commit made
nothing (refused, replayed) takes its reservation back, only if no other put of that name
wrote it since (the version it got). Every removal path already drops the member (`RedisShared.retired`,
the sweeper's clean-up of a name whose record is gone), each at most once because a ZREM of
an absent member changes no count. A replica dying between its reservation and its commit
leaves a member with the put's deadline: the sweeper finds the name gone when it is due and
drops it, so the count is back by then. Until then the count is high, never low: a crash can
refuse a put early, never let one past the limit.

Transcripts. Their bytes (Transcript.nbytes) are reserved in the same script, with the member:
`{P}:txsz` (name -> bytes), `{P}:txt` (tenant -> bytes) and `{P}:meta` "tb" (in all), checked
against transcript_max_bytes_per_tenant and transcript_max_bytes at once; a put that does not fit
commits its retention without the transcript. Whatever removes the member frees the bytes in the
same step (lua/lib/counted.lua), so they live exactly as long as the capacity reservation: given
back with a refused put's, freed by every removal path, and after a crash freed by the sweeper
when the member is due. The counters are exact while each name is put once. Another put of a
name (a replay, a retry after a crash, a race) shares its reservation, grown to the largest of
theirs; a replay whose first put dropped its transcript may so reserve bytes its record does not
use, until the retention goes: counted high, never low.

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

from kvshuttle.registry.store.redis.codec import as_str, raise_first_error, time_arg
from kvshuttle.registry.store.redis.shared import RedisShared

# Bytes one remembered answer costs in Redis beyond its key's characters (counted three times:
# the key, its index member, its size field) and its values': the hash, the key's expiry and the
# index entries (measured with MEMORY USAGE on Redis 7.0, 200 put answers with 84-character keys:
# 358 bytes the answer, 352 its index entries, a skiplist past 128 members; the estimate then
# says 746). tests/registry/test_redis_bounds.py checks it stays above what Redis reports.
REMEMBERED_OVERHEAD = 360


class RedisBounds:
    """Capacity reservations and the remembered answers' index (see the module docstring)."""

    def __init__(self, shared: RedisShared) -> None:
        self._shared = shared
        self._redis = shared.client
        self._limits = shared.limits
        self._keys = shared.keys
        self._run = shared.run

    async def reserve(self, name: str, deadline: float) -> tuple[bool, int, str]:
        """Reserve `name`'s place (its deadline member). Returns whether this added it, the
        version it got and the limit a NEW retention would pass ("" none)."""
        added, version, limit, _ = await self.reserve_put(name, deadline, 0)
        return added, version, limit

    async def reserve_put(
        self, name: str, deadline: float, transcript_bytes: int
    ) -> tuple[bool, int, str, bool]:
        """`reserve`, and with `transcript_bytes` (0: no transcript) their reservation under the
        transcript bounds, per tenant and in all: the last value is whether it fits (the put
        keeps its transcript). Its bytes go with the member (lua/lib/counted.lua)."""
        limits = self._limits
        added, version, limit, tx = await self._run(
            "reserve",
            self._keys.retention_deadlines,
            [
                name,
                time_arg(deadline),
                limits.max_retentions,
                limits.max_retentions_per_tenant,
                transcript_bytes,
                limits.transcript_max_bytes_per_tenant,
                limits.transcript_max_bytes,
            ],
        )
        self._shared.soon(deadline)
        return bool(added), int(version), as_str(limit), as_str(tx) == "1"

    async def unreserve(self, name: str, version: int | None) -> bool:
        """Take back the reservation that got `version`, unless a write of `name` came since
        (None: whatever wrote it, for a name that can no longer be committed)."""
        return bool(
            await self._run(
                "unreserve", self._keys.retention_deadlines, [name, "" if version is None else version]
            )
        )

    async def remember(self, key: str, values: Sequence[str | bytes], now: float) -> None:
        """Index the remembered answer `key` (just written), and delete what the bounds drop."""
        size = REMEMBERED_OVERHEAD + 3 * len(key) + sum(len(v) for v in values)
        await self.trim(now, key, size)

    async def trim(self, now: float, key: str = "", size: int = 0) -> None:
        limits = self._limits
        dropped = await self._run(
            "remember",
            [self._keys.idem, self._keys.isz, self._keys.meta],
            [
                time_arg(now),
                time_arg(now - limits.idempotency_ttl),
                limits.idempotency_max_entries,
                limits.idempotency_max_bytes,
                key,
                size,
            ],
        )
        if dropped:
            pipe = self._redis.pipeline(transaction=False)
            for raw in dropped:  # one key a command: a Cluster's keys lie in many slots
                pipe.execute_command("UNLINK", as_str(raw))
            raise_first_error(await pipe.execute(raise_on_error=False))
