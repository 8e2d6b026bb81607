"""The Redis store's expiry (kvshuttle.registry.store.redis.store): sweeps of the deadline sets, each
expiry removed and emitted once across replicas, and the view refreshed from the server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvshuttle.registry.model import (
    ChangeKind,
    ExpiryResult,
    NodeExpiry,
    RetentionChange,
    StoreCounts,
)
from kvshuttle.registry.store.redis.bounds import RedisBounds
from kvshuttle.registry.store.redis.codec import (
    BATCH,
    MAX_BATCHES,
    as_str,
    conversation_of,
    node_of,
    pairs,
    reachable,
    retention_of,
    tenant_of,
    time_arg,
)
from kvshuttle.registry.store.redis.shared import RedisShared


class RedisExpiry:
    """Expiry sweeps, each refreshing this replica's view of the counts and the next deadline."""

    def __init__(self, shared: RedisShared, bounds: RedisBounds) -> None:
        self._shared = shared
        self._redis = shared.client
        self._limits = shared.limits
        self._keys = shared.keys
        self._run = shared.run
        self._bounds = bounds

    async def _due(self, dl: str, ver: str, now: float) -> list[tuple[str, float, str]]:
        flat = await self._run("due", [dl, ver], [time_arg(now), BATCH])
        return [(as_str(flat[i]), float(flat[i + 1]), as_str(flat[i + 2])) for i in range(0, len(flat), 3)]

    @reachable
    async def expire_due(self, now: float) -> ExpiryResult:
        nodes: list[NodeExpiry] = []
        retentions: list[RetentionChange] = []
        await self._sweep(
            self._keys.ndl, self._keys.nver, now, lambda d: self._expire_node(d, now, nodes, retentions)
        )
        await self._sweep(
            self._keys.rdl, self._keys.rver, now, lambda d: self._expire_retention(d, now, retentions)
        )
        await self._sweep(self._keys.fdl, self._keys.fsz, now, lambda d: self._forget_fence(d, now))
        await self._bounds.trim(now)
        await self._refresh()
        return ExpiryResult(tuple(nodes), tuple(retentions))

    async def _sweep(
        self, dl: str, ver: str, now: float, step: Callable[[tuple[str, float, str]], Awaitable[None]]
    ) -> None:
        """Every due member of one deadline set, a bounded number of batches per call (a member
        whose deadline a concurrent writer moved stays due and is seen again next time)."""
        for _ in range(MAX_BATCHES):
            due = await self._due(dl, ver, now)
            for member in due:
                await step(member)
            if len(due) < BATCH:
                return

    async def _expire_node(
        self,
        due: tuple[str, float, str],
        now: float,
        nodes: list[NodeExpiry],
        retentions: list[RetentionChange],
    ) -> None:
        name, _, version = due
        out = await self._run("remove_node", self._keys.node(name), ["", time_arg(now), "expire"])
        tag = as_str(out[0])
        if tag == "alive":
            await self._run("reschedule", [self._keys.ndl, self._keys.nver], [name, version, as_str(out[1])])
            return
        if tag == "removed":
            changes = await self._shared.cascade(name, out[2], now)
            nodes.append(NodeExpiry(node_of(pairs(out[1])), tuple(changes)))
            self._shared.account(changes, nodes=-1)
        else:  # gone: finish a cascade that another replica has not finished (or died in)
            changes = await self._shared.cascade(name, out[1], now)
            retentions.extend(changes)
            self._shared.account(changes)
        await self._run("unindex_node", [self._keys.nodes, self._keys.ndl, self._keys.nver], [name, version])

    async def _expire_retention(
        self, due: tuple[str, float, str], now: float, retentions: list[RetentionChange]
    ) -> None:
        name, _, version = due
        out = await self._run(
            "expire_retention",
            [self._keys.conversation(conversation_of(name))],
            [name, time_arg(now), self._shared.forget_at(now)],
        )
        tag = as_str(out[0])
        if tag == "alive":
            await self._run("reschedule", self._keys.retention_deadlines, [name, version, as_str(out[1])])
        elif tag == "expired":
            record = retention_of(pairs(out[1]))
            await self._shared.retired(record, now)
            change = RetentionChange(ChangeKind.EXPIRED, record, now)
            retentions.append(change)
            self._shared.account([change])
        else:  # gone: its index steps, again (idempotent), for a remover that died before them
            tomb_node = as_str(out[1])
            if tomb_node:
                await self._run("detach", self._keys.node(tomb_node), [name])
            await self._redis.zrem(self._keys.tenant(tenant_of(name)), name)
            await self._redis.zrem(self._keys.claimed, name)
            await self._run("reschedule", self._keys.retention_deadlines, [name, version, ""])

    async def _forget_fence(self, due: tuple[str, float, str], now: float) -> None:
        conversation, score, _ = due
        out = await self._run("forget_fence", [self._keys.conversation(conversation)], [time_arg(now), ""])
        tag = as_str(out[0])
        if tag == "later" and out[1]:
            await self._run("later", [self._keys.fdl], [conversation, as_str(out[1])])
        else:
            keys = [self._keys.fdl, self._keys.fsz, self._keys.meta]
            await self._run("unlinger", keys, [conversation, "" if tag == "live" else time_arg(score)])

    async def _refresh(self) -> None:
        """This replica's view of the counts and the next deadline, from the server."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.zcard(self._keys.nodes)
        pipe.zcard(self._keys.rdl)
        pipe.zcard(self._keys.claimed)
        pipe.zcard(self._keys.fdl)
        pipe.zcard(self._keys.idem)
        pipe.hlen(self._keys.txsz)
        pipe.hmget(self._keys.meta, ["lb", "early", "ib", "tb"])
        for dl in (self._keys.ndl, self._keys.rdl, self._keys.fdl):
            pipe.zrange(dl, 0, 0, withscores=True)
        (
            nodes,
            retentions,
            claimed,
            lingering,
            remembered,
            transcripts,
            (lb, early, ib, tb),
            *firsts,
        ) = await pipe.execute()
        self._shared.counts = StoreCounts(
            nodes=nodes,
            retentions=retentions,
            claimed=claimed,
            fenced_conversations=retentions + lingering,
            lingering_fences=lingering,
            lingering_fence_bytes=int(lb or 0),
            fences_forgotten_early=int(early or 0),
            remembered_requests=remembered,
            remembered_request_bytes=int(ib or 0),
            transcripts=transcripts,
            transcript_bytes=int(tb or 0),
        )
        deadlines = [float(first[0][1]) for first in firsts if first]
        self._shared.deadline = min(deadlines) if deadlines else None
