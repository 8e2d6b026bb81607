"""The block index shared by registry replicas over one Redis (kvshuttle.registry.feeds.index):
each replica keeps its own in-memory index (kvshuttle.registry.block_index), fed from one Redis
Stream of accepted reports, so an agent may report to any replica and each answers LookupBlocks
with every node's blocks. Chosen over an index held in Redis by measurement
(bench/block_index.py): a lookup stays a walk of this process's dicts (microseconds, no round
trip), while the index in Redis costs a script per node per lookup and the hash chain can only
be computed in Python, so an ingest there is two round trips plus per-block Lua.

Keys (P the key prefix, as the hash tag: the global slot, so each script touches one slot):

- `{P}:blockseq`, a hash: `s:<node>` the seq the shared index expects next from the node (absent:
  no batch since its last removal), `f:<node>` the incarnation floor below which its reports are
  refused (set by a removal), `n` the entry counter.
- `{P}:blocks`, the stream: one entry per accepted report (`b`: the node and the batches the rule
  applies, a ReportBlockEventsRequest) or removal (`d`: the node), each with `n`, the counter's
  value, consecutive across entries. Bounded by `MAXLEN ~ maxlen` entries.
- `{P}:blockdrops`, a ZSET of removed nodes by the registry's time: floors older than
  `FLOOR_HORIZON` are forgotten (no report waits that long between its check and its script).

A report: the replica plans its batches with the sequence rule against the state its own index
has reached (`plan_batches`), and one script compares that with the shared `s:<node>`, refuses an
incarnation below the floor, and on agreement stores the new state and appends the batches the
plan applies, at once. When another replica moved the state meanwhile the script answers it and
the replica plans again. So every replica's index applies the same batches in the same order and
the answer (`next_seq`, `gap_detected`, `engine_restarted`) is the same whichever replica took
the report. The reporting replica waits (at most `read_your_writes` seconds) until its own index
has applied its entry, so the agent's next lookup there sees its blocks.

The reader (one task per replica): XREAD BLOCK from the last entry applied, from the stream's
start when the process starts. A replica that starts after the stream was trimmed knows only the
entries still held: a block stored before them is missing (or, chained from a missing one,
unkeyed), never wrong. A reader whose next entry's counter is not the last one's + 1 missed
entries (it fell behind by more than `maxlen`, or Redis restarted without persistence): a
removal may be among them, so it clears its whole index and carries on from there; what it
dropped comes back as the engines store blocks again. Missing blocks cost prefix hits, never
correctness: the index is a placement hint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, cast

import structlog

from kvshuttle.client.registry_convert import batch_to_pb
from kvshuttle.core.cancellation import raise_if_cancelled
from kvshuttle.core.errors import Aborted, FailedPrecondition
from kvshuttle.core.kv_events import ApplyResult, EventBatch
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.api import convert
from kvshuttle.registry.block_index import BlockIndex, plan_batches
from kvshuttle.registry.store.redis.codec import RedisClient, reachable, scripting
from kvshuttle.registry.v1 import registry_service_pb2 as pb

__all__ = ["FLOOR_HORIZON", "RedisIndexFeed"]

log = structlog.get_logger("kvshuttle.registry")

FLOOR_HORIZON = 600.0  # seconds a removed node's incarnation floor is kept
_PAGE = 1000
_ATTEMPTS = 8  # plans against a state other replicas keep moving (one agent per node: rare)

# KEYS: blockseq, stream. ARGV: node, incarnation, the state planned against ('' none), the new
# state, maxlen, the entry ('' when the plan applies nothing: a check only).
_ACCEPT = """
local floor = redis.call('HGET', KEYS[1], 'f:' .. ARGV[1])
if floor and tonumber(ARGV[2]) < tonumber(floor) then return {'stale', floor} end
local cur = redis.call('HGET', KEYS[1], 's:' .. ARGV[1]) or ''
if cur ~= ARGV[3] then return {'moved', cur} end
if ARGV[6] == '' then return {'ok', ''} end
redis.call('HSET', KEYS[1], 's:' .. ARGV[1], ARGV[4])
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
return {'ok', redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'n', n, 'b', ARGV[6])}
"""
# KEYS: blockseq, stream, drops. ARGV: node, floor, now, horizon (floors older are forgotten), maxlen.
_DROP = """
local old = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[4])
for _, name in ipairs(old) do redis.call('HDEL', KEYS[1], 'f:' .. name) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[4])
redis.call('HDEL', KEYS[1], 's:' .. ARGV[1])
local floor = redis.call('HGET', KEYS[1], 'f:' .. ARGV[1])
if not floor or tonumber(ARGV[2]) > tonumber(floor) then
  redis.call('HSET', KEYS[1], 'f:' .. ARGV[1], ARGV[2])
end
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'n', n, 'd', ARGV[1])
"""


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = as_str(entry_id).partition("-")
    return int(ms), int(seq)


class RedisIndexFeed:
    """See the module docstring. `client` must be created with decode_responses=False."""

    def __init__(
        self,
        client: RedisClient,
        index: BlockIndex,
        *,
        prefix: str = "kvshuttle",
        maxlen: int = 100_000,
        block_ms: int = 1000,
        read_your_writes: float = 0.5,
    ) -> None:
        if not prefix or any(c in prefix for c in "{}"):
            raise ValueError("the key prefix must be non-empty and without braces")
        if maxlen <= 0:
            raise ValueError("maxlen must be positive")
        self._redis = client
        self._index = index
        g = f"{{{prefix}}}"
        self._k_seq, self.key, self._k_drops = f"{g}:blockseq", f"{g}:blocks", f"{g}:blockdrops"
        self._maxlen = maxlen
        self._block_ms = block_ms
        self._wait = read_your_writes
        self._accept = scripting(client).register_script(_ACCEPT)
        self._drop = scripting(client).register_script(_DROP)
        self._applied = (0, 0)  # the id of the last entry this replica's index applied
        self._counter: int | None = None  # that entry's `n`
        self._moved = asyncio.Condition()
        self.gaps = 0  # times the reader missed entries and cleared the index

    @reachable  # Redis not answering: UNAVAILABLE, which the agent retries
    async def report(self, node: str, incarnation: int, batches: Sequence[EventBatch]) -> ApplyResult:
        seqs = [b.seq for b in batches]
        known = self._index.next_seq(node)
        state = "" if known is None else str(known)
        for _ in range(_ATTEMPTS):
            plan = plan_batches(int(state) if state else None, seqs)
            entry = b""
            if plan.apply:
                request = pb.ReportBlockEventsRequest(
                    node=node, batches=[batch_to_pb(batches[i]) for i, _ in plan.apply]
                )
                entry = request.SerializeToString()
            new = "" if plan.next_seq is None else str(plan.next_seq)
            args: list[str | int | bytes] = [node, incarnation, state, new, self._maxlen, entry]
            tag, value = await cast(
                "Awaitable[list[Any]]", self._accept(keys=[self._k_seq, self.key], args=args)
            )
            if as_str(tag) == "stale":
                raise FailedPrecondition(
                    f"node {node} was removed at or after incarnation {incarnation}",
                    reason=ErrorReason.NODE_INCARNATION_MISMATCH,
                    metadata={"node": node, "incarnation": str(int(value) - 1)},
                )
            if as_str(tag) == "moved":
                state = as_str(value)
                continue
            if value:
                await self._until_applied(_id(value))
            return plan.result()
        raise Aborted(
            f"node {node}'s event sequence kept moving under concurrent reports: retry",
            reason=ErrorReason.ABORTED,
        )

    @reachable
    async def drop(self, node: str, floor: int, now: float) -> None:
        args: list[str | int] = [node, floor, repr(now), repr(now - FLOOR_HORIZON), self._maxlen]
        entry_id = await cast(
            "Awaitable[bytes]", self._drop(keys=[self._k_seq, self.key, self._k_drops], args=args)
        )
        await self._until_applied(_id(entry_id))

    async def _until_applied(self, entry: tuple[int, int]) -> None:
        """Wait (bounded) until this replica's index has applied `entry`: read your writes."""
        async with self._moved:
            try:
                await asyncio.wait_for(self._moved.wait_for(lambda: self._applied >= entry), self._wait)
            except TimeoutError:
                log.warning("index_feed.lagging", entry=entry, applied=self._applied)

    def _apply(self, entries: Sequence[Any]) -> None:
        for raw_id, fields in entries:
            counter = int(fields[b"n"])
            if self._counter is not None and counter != self._counter + 1:
                # Entries were trimmed before this replica read them (or Redis lost them).
                log.warning("index_feed.gap", last=self._counter, next=counter)
                self.gaps += 1
                self._index.clear()
            self._counter = counter
            self._applied = _id(raw_id)
            try:
                if b"d" in fields:
                    self._index.drop_node(as_str(fields[b"d"]))
                else:
                    request = pb.ReportBlockEventsRequest.FromString(bytes(fields[b"b"]))
                    self._index.apply(request.node, convert.event_batches_from_pb(request.batches))
            except Exception as exc:  # not ours: skipped, never fatal to the reader
                log.warning("index_feed.bad_entry", id=as_str(raw_id), error=repr(exc))

    async def run(self) -> None:
        """The reader: see the module docstring. Runs until cancelled."""
        last: str = "0-0"
        delay = 0.1
        while True:
            raise_if_cancelled()  # a cancel redis-py swallowed (kvshuttle.core.cancellation)
            try:
                found = await self._redis.xread({self.key: last}, count=_PAGE, block=self._block_ms)
                delay = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("index_feed.read_failed", error=repr(exc), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            for _key, entries in found or ():
                if entries:
                    self._apply(entries)
                    last = as_str(entries[-1][0])
            async with self._moved:
                self._moved.notify_all()
