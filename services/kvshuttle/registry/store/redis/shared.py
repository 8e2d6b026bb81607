"""What every part of the Redis store (kvshuttle.registry.store.redis.store) holds: one RedisShared with
the client, the limits, the key layout, the registered scripts and this replica's view of the counts
and the next deadline; and the steps the parts share: reading a node or a retention, the deadline
hint, a committed retention's find_retention index entries, the NODE_LOST cascade of a removed
node, the retirement of a removed retention (its index steps, its transcript bytes freed with its
deadline member) and its fence's lingering, and the check that a committed retention's node still
holds it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Sequence
from typing import Any, cast

from redis.commands.core import AsyncScript

from kvshuttle.registry.model import ChangeKind, Node, Retention, RetentionChange, StoreCounts
from kvshuttle.registry.store.contract import FENCE_OVERHEAD, StoreLimits
from kvshuttle.registry.store.redis.codec import (
    REMOVED_KINDS,
    RedisClient,
    as_str,
    conversation_of,
    lookup_args,
    node_of,
    pairs,
    retention_of,
    scripting,
    time_arg,
)
from kvshuttle.registry.store.redis.keys import RedisKeys
from kvshuttle.registry.store.redis.scripts import SCRIPTS


class RedisShared:
    """The connection, keys and scripts every part uses, this replica's view (counts, next
    deadline: see kvshuttle.registry.store.redis.store) that every part moves, and the steps several
    parts take. `client` must be created with decode_responses=False."""

    def __init__(
        self, client: RedisClient, limits: StoreLimits, keys: RedisKeys, *, incarnation_base: int
    ) -> None:
        self.client = client
        self.limits = limits
        self.keys = keys
        self.incarnation_base = incarnation_base
        # The scripts by name, each run by EVALSHA (loaded on its first NOSCRIPT).
        self.scripts: dict[str, AsyncScript] = {
            name: scripting(client).register_script(body) for name, body in SCRIPTS.items()
        }
        self.counts = StoreCounts(0, 0, 0, 0)
        self.deadline: float | None = None

    async def run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        return await self.scripts[script](keys=keys, args=args)

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        return await cast("Awaitable[dict[bytes, bytes]]", self.client.hgetall(key))

    def forget_at(self, now: float) -> str:
        return time_arg(now + self.limits.fence_ttl)

    def idem_args(self, now: float) -> list[str]:
        ttl = self.limits.idempotency_ttl
        return [time_arg(now + ttl), str(max(1, math.ceil(ttl * 1000)))]

    # ---- this replica's view ---------------------------------------------------------------

    def soon(self, deadline: float) -> None:
        if self.deadline is None or deadline < self.deadline:
            self.deadline = deadline

    def account(self, changes: Sequence[RetentionChange], nodes: int = 0) -> None:
        c = self.counts
        retentions, claimed = c.retentions, c.claimed
        transcripts, transcript_bytes = c.transcripts, c.transcript_bytes
        for change in changes:
            transcript = change.retention.transcript
            if change.kind is ChangeKind.PUT:
                retentions += 1
                if transcript is not None:
                    transcripts += 1
                    transcript_bytes += transcript.nbytes
            elif change.kind in REMOVED_KINDS:
                retentions -= 1
                claimed -= change.retention.claim is not None
                if transcript is not None:
                    transcripts -= 1
                    transcript_bytes -= transcript.nbytes
            elif change.kind is ChangeKind.CLAIMED:
                claimed += 1
            elif change.kind in (ChangeKind.UNCLAIMED, ChangeKind.MOVED):
                claimed -= 1
        self.counts = dataclasses.replace(
            c,
            nodes=max(0, c.nodes + nodes),
            retentions=max(0, retentions),
            claimed=max(0, claimed),
            transcripts=max(0, transcripts),
            transcript_bytes=max(0, transcript_bytes),
        )

    # ---- steps several parts take ----------------------------------------------------------

    async def read_node(self, name: str) -> Node | None:
        base, held, _ = self.keys.node(name)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(base)
        pipe.hlen(held)
        raw, count = await pipe.execute()
        if not raw:
            return None
        h = {as_str(k): v for k, v in raw.items()}
        h["count"] = str(count).encode()
        return node_of(h)

    async def read_retention(self, name: str) -> Retention | None:
        """The retention `name` as its conversation holds it now, or None when it holds another
        or none."""
        raw = await self.hgetall(self.keys.conversation(conversation_of(name)))
        h = {as_str(k): v for k, v in raw.items()}
        if as_str(h.get("name", b"")) != name:
            return None
        return retention_of(h)

    async def index(self, record: Retention) -> None:
        """Make the committed `record` findable by its chain's end and its transcript's key (the
        latest put wins a shared field). The record and the indexes are in different slots, so:
        index, then check it is still held; removed in between, its retirement may have
        unindexed it before this index, so unindex it again."""
        keys, args = self.keys.lookup(record.tenant), lookup_args(record)
        if args[1:] == [b"", b""]:
            return
        await self.run("index", keys, args)
        held = await cast(
            "Awaitable[bytes | None]", self.client.hget(self.keys.conversation(record.conversation), "name")
        )
        if held is None or as_str(held) != record.name:
            await self.run("unindex", keys, args)

    async def hint(self, keys: list[str], member: str, deadline: float) -> None:
        await self.run("hint", keys, [member, time_arg(deadline)])
        self.soon(deadline)

    async def cascade(self, node: str, lost: Sequence[Any], now: float) -> list[RetentionChange]:
        """Drop a removed node's retentions (NODE_LOST), each only if still that retention there."""
        changes: list[RetentionChange] = []
        keys = self.keys.node(node)
        for name in sorted(as_str(n) for n in pairs(lost)):
            flat = await self.run(
                "drop_if", [self.keys.conversation(conversation_of(name))], [name, node, self.forget_at(now)]
            )
            if flat:
                record = retention_of(pairs(flat))
                await self.retired(record, now, detach=False)
                changes.append(RetentionChange(ChangeKind.NODE_LOST, record, now))
            await self.run("detach", keys, [name])
        return changes

    async def retired(
        self, record: Retention, now: float, *, detach: bool = True, linger: bool = True
    ) -> None:
        """The index steps after a retention's record was removed (each idempotent)."""
        if detach:
            await self.run("detach", self.keys.node(record.node), [record.name])
        await self.client.zrem(self.keys.tenant(record.tenant), record.name)
        await self.run("unindex", self.keys.lookup(record.tenant), lookup_args(record))
        if record.claim is not None:
            await self.client.zrem(self.keys.claimed, record.name)
        await self.run("drop", self.keys.retention_deadlines, [record.name])
        if linger:
            await self.linger(record.conversation, now)

    async def linger(self, conversation: str, now: float) -> None:
        limits = self.limits
        keys = self.keys
        forget_at = now + limits.fence_ttl
        evicted = await self.run(
            "linger",
            [keys.fdl, keys.fsz, keys.meta],
            [
                conversation,
                time_arg(forget_at),
                FENCE_OVERHEAD + len(conversation),
                limits.max_lingering_fences,
                limits.lingering_fence_max_bytes,
            ],
        )
        self.soon(forget_at)
        for raw in evicted:
            conv = as_str(raw)
            out = await self.run("forget_fence", [keys.conversation(conv)], [time_arg(now), "1"])
            if as_str(out[0]) == "forgotten":
                await cast("Awaitable[int]", self.client.hincrby(keys.meta, "early", 1))

    async def committed_on(self, record: Retention) -> bool:
        """Whether the conversation holds this retention's name on its node now."""
        held = await cast(
            "Awaitable[list[bytes | None]]",
            self.client.hmget(self.keys.conversation(record.conversation), ["name", "node"]),
        )
        return [None if v is None else as_str(v) for v in held] == [record.name, record.node]

    async def attached_while_held(self, record: Retention, node: Node) -> bool:
        """Attach a committed retention's name to its node again, where a refused put of the same
        name took it back. The conversation and the node are in different slots, so: check it is
        held, attach, check again; replaced in between, its retirement may have detached it
        before this attach, so detach it again. False when it is not held, or the node (that
        engine, that incarnation) went away."""
        if not await self.committed_on(record):
            return False
        args = [record.name, node.spec.engine_id, str(node.incarnation), record.kv_bytes]
        if not await self.run("hold", self.keys.node(record.node)[:2], args):
            return False
        if await self.committed_on(record):
            return True
        await self.run("detach", self.keys.node(record.node), [record.name])
        return False

    async def still_held(self, record: Retention, node: Node, now: float) -> list[RetentionChange]:
        """After a commit onto a node: if the node went away meanwhile (its cascade may have
        run before the commit), the retention goes as NODE_LOST now."""
        if await self.run("holds", self.keys.node(record.node)[:2], [record.name, node.spec.engine_id]):
            return []
        if await self.attached_while_held(record, node):
            return []
        lost = await self.run(
            "drop_if",
            [self.keys.conversation(record.conversation)],
            [record.name, record.node, self.forget_at(now)],
        )
        if not lost:  # replaced, moved or dropped meanwhile: not this step's to emit
            return []
        gone = retention_of(pairs(lost))
        await self.retired(gone, now)
        return [RetentionChange(ChangeKind.NODE_LOST, gone, now)]
