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
from kvshuttle.registry.store.redis.claims import RedisClaims
from kvshuttle.registry.store.redis.codec import (
    _BATCH,
    _MAX_BATCHES,
    _conversation_of,
    _node_of,
    _pairs,
    _reachable,
    _retention_of,
    _s,
    _t,
    _tenant_of,
)


class RedisExpiry(RedisClaims):
    """Expiry sweeps, and this replica's view of the counts and the next deadline."""

    async def _due(self, dl: str, ver: str, now: float) -> list[tuple[str, float, str]]:
        flat = await self._run("due", [dl, ver], [_t(now), _BATCH])
        return [(_s(flat[i]), float(flat[i + 1]), _s(flat[i + 2])) for i in range(0, len(flat), 3)]

    @_reachable
    async def expire_due(self, now: float) -> ExpiryResult:
        nodes: list[NodeExpiry] = []
        retentions: list[RetentionChange] = []
        await self._sweep(
            self._k_ndl, self._k_nver, now, lambda d: self._expire_node(d, now, nodes, retentions)
        )
        await self._sweep(
            self._k_rdl, self._k_rver, now, lambda d: self._expire_retention(d, now, retentions)
        )
        await self._sweep(self._k_fdl, self._k_fsz, now, lambda d: self._forget_fence(d, now))
        await self._trim(now)
        await self._refresh()
        return ExpiryResult(tuple(nodes), tuple(retentions))

    async def _sweep(
        self, dl: str, ver: str, now: float, step: Callable[[tuple[str, float, str]], Awaitable[None]]
    ) -> None:
        """Every due member of one deadline set, a bounded number of batches per call (a member
        whose deadline a concurrent writer moved stays due and is seen again next time)."""
        for _ in range(_MAX_BATCHES):
            due = await self._due(dl, ver, now)
            for member in due:
                await step(member)
            if len(due) < _BATCH:
                return

    async def _expire_node(
        self,
        due: tuple[str, float, str],
        now: float,
        nodes: list[NodeExpiry],
        retentions: list[RetentionChange],
    ) -> None:
        name, _, version = due
        out = await self._run("remove_node", self._node_keys(name), ["", _t(now), "expire"])
        tag = _s(out[0])
        if tag == "alive":
            await self._run("reschedule", [self._k_ndl, self._k_nver], [name, version, _s(out[1])])
            return
        if tag == "removed":
            changes = await self._cascade(name, out[2], now)
            nodes.append(NodeExpiry(_node_of(_pairs(out[1])), tuple(changes)))
            self._account(changes, nodes=-1)
        else:  # gone: finish a cascade that another replica has not finished (or died in)
            changes = await self._cascade(name, out[1], now)
            retentions.extend(changes)
            self._account(changes)
        await self._run("unindex_node", [self._k_nodes, self._k_ndl, self._k_nver], [name, version])

    async def _expire_retention(
        self, due: tuple[str, float, str], now: float, retentions: list[RetentionChange]
    ) -> None:
        name, _, version = due
        out = await self._run(
            "expire_retention",
            [self._conv_key(_conversation_of(name))],
            [name, _t(now), self._forget_at(now)],
        )
        tag = _s(out[0])
        if tag == "alive":
            await self._run("reschedule", self._rdl, [name, version, _s(out[1])])
        elif tag == "expired":
            record = _retention_of(_pairs(out[1]))
            await self._retired(record, now)
            change = RetentionChange(ChangeKind.EXPIRED, record, now)
            retentions.append(change)
            self._account([change])
        else:  # gone: its index steps, again (idempotent), for a remover that died before them
            tomb_node = _s(out[1])
            if tomb_node:
                await self._run("detach", self._node_keys(tomb_node), [name])
            await self._redis.zrem(self._tenant_key(_tenant_of(name)), name)
            await self._redis.zrem(self._k_claimed, name)
            await self._run("reschedule", self._rdl, [name, version, ""])

    async def _forget_fence(self, due: tuple[str, float, str], now: float) -> None:
        conversation, score, _ = due
        out = await self._run("forget_fence", [self._conv_key(conversation)], [_t(now), ""])
        tag = _s(out[0])
        if tag == "later" and out[1]:
            await self._run("later", [self._k_fdl], [conversation, _s(out[1])])
        else:
            keys = [self._k_fdl, self._k_fsz, self._k_meta]
            await self._run("unlinger", keys, [conversation, "" if tag == "live" else _t(score)])

    async def _refresh(self) -> None:
        """This replica's view of the counts and the next deadline, from the server."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.zcard(self._k_nodes)
        pipe.zcard(self._k_rdl)
        pipe.zcard(self._k_claimed)
        pipe.zcard(self._k_fdl)
        pipe.zcard(self._k_idem)
        pipe.hmget(self._k_meta, ["lb", "early", "ib"])
        for dl in (self._k_ndl, self._k_rdl, self._k_fdl):
            pipe.zrange(dl, 0, 0, withscores=True)
        nodes, retentions, claimed, lingering, remembered, (lb, early, ib), *firsts = await pipe.execute()
        self._counts = StoreCounts(
            nodes=nodes,
            retentions=retentions,
            claimed=claimed,
            fenced_conversations=retentions + lingering,
            lingering_fences=lingering,
            lingering_fence_bytes=int(lb or 0),
            fences_forgotten_early=int(early or 0),
            remembered_requests=remembered,
            remembered_request_bytes=int(ib or 0),
        )
        deadlines = [float(first[0][1]) for first in firsts if first]
        self._deadline = min(deadlines) if deadlines else None

    def next_deadline(self) -> float | None:
        return self._deadline

    def counts(self) -> StoreCounts:
        return self._counts
