"""RegistryStore on Redis (redis-py asyncio): the same contract as the in-memory store
(kvshuttle.registry.memory_store), durable and shared by several registry replicas.

Every store operation's deciding step is ONE Lua script (kvshuttle.registry.redis_scripts, run by
EVALSHA through `register_script`), so the rule it enforces holds on the server no matter how
many replicas call at once: put-and-replace under the conversation's fence, the single-use
claim with its pin, release (and giving a claim back), renew, move, evict, node registration,
heartbeat and removal. No rule is read in Python and written back.

Keys (P is the configured prefix; the braces are Redis Cluster hash tags):

- `P:{tenants/t/conversations/c}`: the conversation: its fence and `forget` time, its retention
  (one at a time; the fields of the Retention and its claim), a tombstone of the last removed
  retention. `P:{tenants/t/conversations/c}:i:<op>:<target>:<request_id>`: a remembered first
  answer (AIP-155), in the same slot. So every retention script touches one slot.
- `P:{nodes/n}`: the node's lease record; `...:held` (retention name -> kv_bytes: its retentions,
  whose count and byte sum are the node's counts) and `...:lost` (retentions of a removed
  incarnation whose NODE_LOST cascade is not done yet), one slot per node.
- `P:{tenants/t}:names`: the tenant's retention names (a lexicographic ZSET), for listing.
- `{P}:...`, the global slot: `nodes` (node directory), `ndl`/`nver`, `rdl`/`rver` and `fdl`
  (node, retention and fence deadlines, with write versions), `fsz` (lingering fence sizes),
  `claimed` (claimed retention names), `meta` (incarnation counter, lingering bytes, fences
  forgotten early).

Operations that touch several slots run as per-slot scripts driven from Python, each step
idempotent and each index a hint that the deciding record overrides:

- put: node record read (validation), tenant-index add and expiry hint BEFORE the commit (so a
  replica dying after the commit still leaves a deadline that expires it), the conversation's
  commit script, then the node attach (a node gone meanwhile: the retention is dropped at once as
  NODE_LOST) and the replaced retention's clean-up. Capacity (max_retentions, per tenant) is
  read before the commit: concurrent puts into a full tenant may overshoot by their number.
- node removal (deregister, expiry, engine change): the node script moves `held` to `lost`
  atomically with the record's removal; Python then drops each lost retention with a
  conversation script that removes it only if it is still that retention on that node, and
  clears it from `lost`. A replica dying mid-cascade leaves `lost` non-empty and the node's
  deadline in place: the next sweep of that node finishes the cascade.
- move: the conversation's script, then detach from the old node and attach to the new one.
- expiry sweeps (`expire_due`): DUE reads the due members of a deadline set; for each, the
  record's own script decides (expired and removed, still alive, or gone), so with several
  replicas sweeping each expiry is removed, and emitted, exactly once: by the replica whose
  script removed it; the others see it gone. Deadlines only move earlier by the writers (ZADD
  LT plus a version bump); a sweeper resets a deadline later only if its version is unchanged
  since it read it, so no concurrent write is lost and a record is never swept late.
- listing: the ZSET index in name order, then each record read (a name whose record is gone or
  changed is skipped), until the page is full.

Time is the registry's clock, passed in as `now`; Redis's clock is used only to bound memory
(each remembered answer also gets a PEXPIRE of idempotency_ttl).

`counts()` and `next_deadline()` are sync in the protocol: they answer from a view held in this
process, refreshed from the server by every `expire_due` (the registry's expiry timer runs it
at least every `expiry_max_sleep` seconds) and moved by this replica's own operations in between.
So on one replica they are exact after each operation; with several, another replica's changes
show after this one's next sweep. `fenced_conversations` counts conversations with a retention
plus lingering fences; `remembered_requests` / `remembered_request_bytes` are not tracked (0):
Redis bounds them by TTL.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import uuid
from array import array
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar, cast

import redis.asyncio as aioredis
import redis.exceptions
from redis.commands.core import AsyncScript

from kvshuttle.core.errors import (
    Aborted,
    FailedPrecondition,
    KvshuttleError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvshuttle.core.fingerprint import request_id_reused
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.idempotency import claim_fingerprint, move_fingerprint, put_fingerprint
from kvshuttle.registry.memory_store import FENCE_OVERHEAD, StoreLimits
from kvshuttle.registry.model import (
    ChangeKind,
    Claim,
    Conversation,
    ExpiryResult,
    Holder,
    Move,
    Node,
    NodeExpiry,
    PutResult,
    Retention,
    RetentionChange,
    StoreCounts,
)
from kvshuttle.registry.redis_scripts import SCRIPTS

__all__ = ["RedisClient", "RedisStore"]

_BATCH = 256
_MAX_BATCHES = 64
_REMOVED_KINDS = {
    ChangeKind.RELEASED,
    ChangeKind.EXPIRED,
    ChangeKind.REPLACED,
    ChangeKind.NODE_LOST,
    ChangeKind.EVICTED,
}


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _t(value: float) -> str:
    """A time as the scripts store it: the shortest repr that reads back to the same float."""
    return repr(float(value))


def _pairs(flat: Sequence[Any]) -> dict[str, bytes]:
    return {_s(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}


def _holder_json(holder: Holder | None) -> str:
    if holder is None:
        return ""
    return json.dumps([holder.engine_id, holder.side_channel_host, holder.side_channel_port])


def _holder_of(raw: bytes | None) -> Holder | None:
    if not raw:
        return None
    engine, host, port = json.loads(raw)
    return Holder(engine, host, int(port))


def _spec_json(spec: NodeSpec) -> str:
    return json.dumps(
        {
            "name": spec.name,
            "role": spec.role.value,
            "engine_id": spec.engine_id,
            "http_endpoint": spec.http_endpoint,
            "side_channel_host": spec.side_channel_host,
            "side_channel_port": spec.side_channel_port,
            "agent_endpoint": spec.agent_endpoint,
            "model": spec.model,
            "block_size": spec.block_size,
            "kv_bytes_per_token": spec.kv_bytes_per_token,
            "labels": dict(spec.labels),
        }
    )


def _spec_of(raw: bytes) -> NodeSpec:
    d = json.loads(raw)
    d["role"] = NodeRole(d["role"])
    return NodeSpec(**d)


def _load_json(load: NodeLoad) -> str:
    return json.dumps(
        [load.running_requests, load.waiting_requests, load.kv_cache_usage, load.engine_healthy]
    )


def _load_of(raw: bytes) -> NodeLoad:
    running, waiting, usage, healthy = json.loads(raw)
    return NodeLoad(int(running), int(waiting), float(usage), bool(healthy))


def _node_of(h: dict[str, bytes]) -> Node:
    return Node(
        spec=_spec_of(h["spec"]),
        incarnation=int(h["inc"]),
        register_time=float(h["rt"]),
        expire_at=float(h["exp"]),
        load=_load_of(h["load"]),
        retained_bytes=int(h.get("rb", b"0")),
        retention_count=int(h.get("count", b"0")),
    )


def _retention_of(h: dict[str, bytes]) -> Retention:
    claim = None
    if "cid" in h:
        claim = Claim(
            _s(h["cid"]),
            _s(h["chold"]),
            float(h["ctime"]),
            float(h["cexp"]),
            lease_expire_at=float(h["clease"]),
        )
    hashes: array[int] = array("Q")
    hashes.frombytes(h["bh"])
    return Retention(
        name=_s(h["name"]),
        node=_s(h["node"]),
        generation=int(h["gen"]),
        model=_s(h["model"]),
        block_size=int(h["bs"]),
        num_tokens=int(h["nt"]),
        block_hashes=hashes,
        kv_transfer_params=bytes(h["kp"]),
        kv_bytes=int(h["kvb"]),
        pin_expire_at=float(h["pin"]) if "pin" in h else None,
        create_time=float(h["ct"]),
        expire_at=float(h["exp"]),
        claim=claim,
        holder=_holder_of(h.get("holder")),
    )


def _conversation_of(name: str) -> str:
    return name.rsplit("/", 2)[0]


def _tenant_of(name: str) -> str:
    return name.split("/", 2)[1]


def _not_found(name: str) -> NotFound:
    return NotFound(
        f"retention {name} not found",
        reason=ErrorReason.RETENTION_NOT_FOUND,
        metadata={"retention": name},
    )


def _node_not_found(name: str) -> NotFound:
    return NotFound(
        f"node {name} is not registered (or its lease lapsed)",
        reason=ErrorReason.NODE_NOT_FOUND,
        metadata={"node": name},
    )


def _incarnation_mismatch(name: str, have: str, wanted: int) -> FailedPrecondition:
    return FailedPrecondition(
        f"node {name} is at incarnation {have}, not {wanted}",
        reason=ErrorReason.NODE_INCARNATION_MISMATCH,
        metadata={"node": name, "incarnation": have},
    )


_P = ParamSpec("_P")
_T = TypeVar("_T")
# Redis not answering (down, restarting, loading its AOF, past the client's timeout): the
# registry is unavailable, which its callers degrade around, never an internal error.
_STORE_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def _reachable(method: Callable[_P, Coroutine[Any, Any, _T]]) -> Callable[_P, Coroutine[Any, Any, _T]]:
    """`method`, with Redis not answering raised as Unavailable (UNAVAILABLE): the operation's
    script either ran whole on the server or not at all; a retry under its request id is safe."""

    @functools.wraps(method)
    async def call(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await method(*args, **kwargs)
        except _STORE_DOWN as exc:
            raise Unavailable(
                f"the registry's Redis did not answer ({type(exc).__name__}): retry",
                reason=ErrorReason.UNAVAILABLE,
            ) from None

    return call


# A standalone or Sentinel-discovered master (aioredis.Redis) or a Cluster (every script and
# MULTI-less pipeline here is Cluster-safe: each script's keys share one hash slot).
RedisClient = aioredis.Redis | aioredis.RedisCluster


def _scripting(client: RedisClient) -> aioredis.Redis:
    """redis-py types register_script for Redis only; a RedisCluster's works the same (EVALSHA
    routed by its keys' slot)."""
    return cast("aioredis.Redis", client)


class RedisStore:
    """See the module docstring. `client` must be created with decode_responses=False."""

    def __init__(
        self,
        client: RedisClient,
        limits: StoreLimits | None = None,
        *,
        prefix: str = "kvshuttle",
        incarnation_base: int = 0,
    ) -> None:
        if not prefix or any(c in prefix for c in "{}"):
            raise ValueError("the key prefix must be non-empty and without braces")
        self._redis = client
        self._limits = limits or StoreLimits()
        self._p = prefix
        self._incarnation_base = incarnation_base
        self._scripts: dict[str, AsyncScript] = {
            name: _scripting(client).register_script(body) for name, body in SCRIPTS.items()
        }
        g = f"{{{prefix}}}"
        self._k_nodes = f"{g}:nodes"
        self._k_ndl, self._k_nver = f"{g}:ndl", f"{g}:nver"
        self._k_rdl, self._k_rver = f"{g}:rdl", f"{g}:rver"
        self._k_fdl, self._k_fsz = f"{g}:fdl", f"{g}:fsz"
        self._k_claimed, self._k_meta = f"{g}:claimed", f"{g}:meta"
        self._counts = StoreCounts(0, 0, 0, 0)
        self._deadline: float | None = None

    # ---- keys and plumbing -----------------------------------------------------------------

    def _conv_key(self, conversation: str) -> str:
        return f"{self._p}:{{{conversation}}}"

    def _idem_key(self, conversation: str, op: str, target: str, request_id: str) -> str:
        return f"{self._p}:{{{conversation}}}:i:{op}:{target}:{request_id}"

    def _node_keys(self, node: str) -> list[str]:
        base = f"{self._p}:{{{node}}}"
        return [base, f"{base}:held", f"{base}:lost"]

    def _tenant_key(self, tenant: str) -> str:
        return f"{self._p}:{{tenants/{tenant}}}:names"

    async def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        return await self._scripts[script](keys=keys, args=args)

    async def _hgetall(self, key: str) -> dict[bytes, bytes]:
        return await cast("Awaitable[dict[bytes, bytes]]", self._redis.hgetall(key))

    def _forget_at(self, now: float) -> str:
        return _t(now + self._limits.fence_ttl)

    def _idem_args(self, now: float) -> list[str]:
        ttl = self._limits.idempotency_ttl
        return [_t(now + ttl), str(max(1, math.ceil(ttl * 1000)))]

    def _soon(self, deadline: float) -> None:
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline

    def _account(self, changes: Sequence[RetentionChange], nodes: int = 0) -> None:
        c = self._counts
        retentions, claimed = c.retentions, c.claimed
        for change in changes:
            if change.kind is ChangeKind.PUT:
                retentions += 1
            elif change.kind in _REMOVED_KINDS:
                retentions -= 1
                claimed -= change.retention.claim is not None
            elif change.kind is ChangeKind.CLAIMED:
                claimed += 1
            elif change.kind in (ChangeKind.UNCLAIMED, ChangeKind.MOVED):
                claimed -= 1
        self._counts = StoreCounts(
            nodes=max(0, c.nodes + nodes),
            retentions=max(0, retentions),
            claimed=max(0, claimed),
            fenced_conversations=c.fenced_conversations,
            lingering_fences=c.lingering_fences,
            lingering_fence_bytes=c.lingering_fence_bytes,
            fences_forgotten_early=c.fences_forgotten_early,
        )

    async def _hint(self, dl: str, ver: str, member: str, deadline: float) -> None:
        await self._run("hint", [dl, ver], [member, _t(deadline)])
        self._soon(deadline)

    # ---- nodes -----------------------------------------------------------------------------

    async def _read_node(self, name: str) -> Node | None:
        base, held, _ = self._node_keys(name)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(base)
        pipe.hlen(held)
        raw, count = await pipe.execute()
        if not raw:
            return None
        h = {_s(k): v for k, v in raw.items()}
        h["count"] = str(count).encode()
        return _node_of(h)

    @_reachable
    async def register_node(
        self, spec: NodeSpec, ttl: float, now: float
    ) -> tuple[Node, list[RetentionChange], bool]:
        expire_at = now + ttl
        reserved = await self._run(
            "reserve_node",
            [self._k_nodes, self._k_ndl, self._k_nver],
            [spec.name, self._limits.max_nodes, _t(expire_at)],
        )
        if not reserved:
            raise ResourceExhausted(
                f"at most {self._limits.max_nodes} nodes",
                reason=ErrorReason.CAPACITY_EXCEEDED,
                metadata={"limit": "max_nodes"},
            )
        self._soon(expire_at)
        incarnation = int(await self._run("next_incarnation", [self._k_meta], [self._incarnation_base]))
        existed, changed, flat, lost = await self._run(
            "register_node",
            self._node_keys(spec.name),
            [_spec_json(spec), spec.engine_id, incarnation, _t(now), _t(expire_at), _load_json(NodeLoad())],
        )
        engine_changed = _s(changed) == "1"
        changes = await self._cascade(spec.name, lost, now) if engine_changed else []
        self._account(changes, nodes=0 if _s(existed) == "1" else 1)
        return _node_of(_pairs(flat)), changes, engine_changed

    @_reachable
    async def heartbeat_node(
        self, name: str, incarnation: int, ttl: float, load: NodeLoad, now: float
    ) -> Node:
        keys = self._node_keys(name)[:2]
        out = await self._run("heartbeat_node", keys, [incarnation, _t(now + ttl), _load_json(load)])
        if _s(out[0]) == "err":
            if _s(out[1]) == "NODE_NOT_FOUND":
                raise _node_not_found(name)
            raise _incarnation_mismatch(name, _s(out[2]), incarnation)
        await self._hint(self._k_ndl, self._k_nver, name, now + ttl)
        return _node_of(_pairs(out[1]))

    @_reachable
    async def deregister_node(self, name: str, incarnation: int | None, now: float) -> list[RetentionChange]:
        version = _s(await cast("Awaitable[bytes | None]", self._redis.hget(self._k_nver, name)) or b"")
        out = await self._run(
            "remove_node",
            self._node_keys(name),
            ["" if incarnation is None else incarnation, _t(now), "deregister"],
        )
        if _s(out[0]) == "err":
            if _s(out[1]) == "NODE_NOT_FOUND":
                raise _node_not_found(name)
            raise _incarnation_mismatch(name, _s(out[2]), cast(int, incarnation))
        changes = await self._cascade(name, out[2], now)
        await self._run("unindex_node", [self._k_nodes, self._k_ndl, self._k_nver], [name, version])
        self._account(changes, nodes=-1)
        return changes

    @_reachable
    async def get_node(self, name: str) -> Node:
        node = await self._read_node(name)
        if node is None:
            raise _node_not_found(name)
        return node

    @_reachable
    async def list_nodes(
        self, *, role: NodeRole | None, model: str | None, after: str, limit: int
    ) -> list[Node]:
        out: list[Node] = []
        start = f"({after}" if after else "-"
        while len(out) < limit:
            names = [_s(n) for n in await self._redis.zrangebylex(self._k_nodes, start, "+", 0, _BATCH)]
            if not names:
                break
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                base, held, _ = self._node_keys(name)
                pipe.hgetall(base)
                pipe.hlen(held)
            replies = await pipe.execute()
            for i in range(len(names)):
                raw, count = replies[2 * i], replies[2 * i + 1]
                if not raw:
                    continue
                h = {_s(k): v for k, v in raw.items()}
                h["count"] = str(count).encode()
                node = _node_of(h)
                if node.spec.role.serves(role) and (not model or node.spec.model == model):
                    out.append(node)
                    if len(out) >= limit:
                        break
            if len(names) < _BATCH:
                break
            start = f"({names[-1]}"
        return out

    async def _cascade(self, node: str, lost: Sequence[Any], now: float) -> list[RetentionChange]:
        """Drop a removed node's retentions (NODE_LOST), each only if still that retention there."""
        changes: list[RetentionChange] = []
        keys = self._node_keys(node)
        for name in sorted(_s(n) for n in _pairs(lost)):
            flat = await self._run(
                "drop_if", [self._conv_key(_conversation_of(name))], [name, node, self._forget_at(now)]
            )
            if flat:
                record = _retention_of(_pairs(flat))
                await self._retired(record, now, detach=False)
                changes.append(RetentionChange(ChangeKind.NODE_LOST, record, now))
            await self._run("detach", keys, [name])
        return changes

    # ---- retentions ------------------------------------------------------------------------

    async def _retired(
        self, record: Retention, now: float, *, detach: bool = True, linger: bool = True
    ) -> None:
        """The index steps after a retention's record was removed (each idempotent)."""
        if detach:
            await self._run("detach", self._node_keys(record.node), [record.name])
        await self._redis.zrem(self._tenant_key(record.tenant), record.name)
        if record.claim is not None:
            await self._redis.zrem(self._k_claimed, record.name)
        await self._run("drop", [self._k_rdl, self._k_rver], [record.name])
        if linger:
            await self._linger(record.conversation, now)

    async def _linger(self, conversation: str, now: float) -> None:
        limits = self._limits
        forget_at = now + limits.fence_ttl
        evicted = await self._run(
            "linger",
            [self._k_fdl, self._k_fsz, self._k_meta],
            [
                conversation,
                _t(forget_at),
                FENCE_OVERHEAD + len(conversation),
                limits.max_lingering_fences,
                limits.lingering_fence_max_bytes,
            ],
        )
        self._soon(forget_at)
        for raw in evicted:
            conv = _s(raw)
            out = await self._run("forget_fence", [self._conv_key(conv)], [_t(now), "1"])
            if _s(out[0]) == "forgotten":
                await cast("Awaitable[int]", self._redis.hincrby(self._k_meta, "early", 1))

    async def _holding_node(self, retention: Retention) -> tuple[NodeSpec | None, KvshuttleError | None]:
        node = await self._read_node(retention.node)
        if node is None:
            return None, FailedPrecondition(
                f"node {retention.node} is not registered",
                reason=ErrorReason.NODE_NOT_FOUND,
                metadata={"node": retention.node},
            )
        spec = node.spec
        if spec.model != retention.model or spec.block_size != retention.block_size:
            return spec, FailedPrecondition(
                f"node {retention.node} serves model {spec.model!r} with block size "
                f"{spec.block_size}, not {retention.model!r} / {retention.block_size}",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": retention.node},
            )
        mismatch = Holder.mismatch(retention.holder, spec)
        if mismatch is not None:
            return spec, FailedPrecondition(
                f"retention.kv_transfer_params do not name node {retention.node} as registered "
                f"({mismatch.rsplit('.', 1)[-1]} differs)",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": retention.node, "field": mismatch},
            )
        return spec, None

    @_reachable
    async def put_retention(
        self, retention: Retention, ttl: float, now: float, *, request_id: str
    ) -> tuple[PutResult, list[RetentionChange]]:
        conversation = retention.conversation
        tenant = retention.tenant
        name = retention.name
        fingerprint = put_fingerprint(retention).hex() if request_id else ""
        spec, node_error = await self._holding_node(retention)
        capacity = await self._capacity(tenant)
        expire_at = now + ttl
        if retention.pin_expire_at is not None and retention.pin_expire_at > now:
            expire_at = min(expire_at, retention.pin_expire_at)
        # Index steps first: a replica dying right after the commit still leaves the deadline
        # that expires it, and a replacement's detach always comes after this attach.
        added = attached = 0
        if node_error is None:
            assert spec is not None
            attached, node_error = await self._attach_for_put(retention, spec)
        if node_error is None:
            added = await self._redis.zadd(self._tenant_key(tenant), {name: 0})
            await self._hint(self._k_rdl, self._k_rver, name, expire_at)
        out = await self._run(
            "put",
            [self._conv_key(conversation), self._idem_key(conversation, "put", conversation, request_id)],
            [
                _t(now),
                request_id,
                fingerprint,
                str(retention.generation),
                _t(expire_at),
                "" if retention.pin_expire_at is None else _t(retention.pin_expire_at),
                "" if node_error is None else "NODE",
                capacity,
                *self._idem_args(now),
                name,
                retention.node,
                retention.model,
                str(retention.block_size),
                str(retention.num_tokens),
                retention.block_hashes.tobytes(),
                retention.kv_transfer_params,
                str(retention.kv_bytes),
                _holder_json(retention.holder),
            ],
        )
        tag = _s(out[0])
        if tag != "ok":
            if attached == 1:  # the name was not live: take its index steps back
                await self._run("detach", self._node_keys(retention.node), [name])
            if added:
                await self._redis.zrem(self._tenant_key(tenant), name)
                await self._run("drop", [self._k_rdl, self._k_rver], [name])
            if tag == "reused":
                raise request_id_reused()
            if tag == "repeat":
                return self._first_put(retention, out), []
            raise self._put_error(out, retention, node_error)
        old_name, old_flat = _s(out[1]), out[2]
        changes: list[RetentionChange] = []
        if old_name:
            old = _retention_of(_pairs(old_flat))
            await self._retired(old, now, linger=False)
            changes.append(RetentionChange(ChangeKind.REPLACED, old, now))
        await self._run("unlinger", [self._k_fdl, self._k_fsz, self._k_meta], [conversation, ""])
        record = copy_retention(retention)
        record.create_time = now
        record.expire_at = expire_at
        record.claim = None
        result = PutResult(record, old_name)
        changes.append(RetentionChange(ChangeKind.PUT, copy_retention(record), now))
        assert spec is not None
        changes += await self._still_held(record, spec.engine_id, now)
        self._account(changes)
        return result, changes

    async def _capacity(self, tenant: str) -> str:
        """The capacity bound a new conversation's put would break ("" none), as read now."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.zcard(self._k_rdl)
        pipe.zcard(self._tenant_key(tenant))
        total, in_tenant = await pipe.execute()
        if total >= self._limits.max_retentions:
            return "max_retentions"
        if in_tenant >= self._limits.max_retentions_per_tenant:
            return "max_retentions_per_tenant"
        return ""

    async def _attach_for_put(
        self, retention: Retention, spec: NodeSpec
    ) -> tuple[int, KvshuttleError | None]:
        attached = int(
            await self._run(
                "attach",
                self._node_keys(retention.node)[:2],
                [retention.name, retention.kv_bytes, spec.engine_id, ""],
            )
        )
        if attached:
            return attached, None
        # The node went away since it was read.
        return 0, FailedPrecondition(
            f"node {retention.node} is not registered",
            reason=ErrorReason.NODE_NOT_FOUND,
            metadata={"node": retention.node},
        )

    @staticmethod
    def _first_put(retention: Retention, out: Sequence[Any]) -> PutResult:
        """The first response to a repeated put, rebuilt from the repeat and what the first set."""
        record = copy_retention(retention)
        record.name = _s(out[1])
        record.create_time = float(out[2])
        record.expire_at = float(out[3])
        record.pin_expire_at = float(out[4]) if out[4] else None
        record.claim = None
        return PutResult(record, _s(out[5]))

    async def _still_held(self, record: Retention, engine_id: str, now: float) -> list[RetentionChange]:
        """After a commit onto a node: if the node went away meanwhile (its cascade may have
        run before the commit), the retention goes as NODE_LOST now."""
        if await self._run("holds", self._node_keys(record.node)[:2], [record.name, engine_id]):
            return []
        lost = await self._run(
            "drop_if",
            [self._conv_key(record.conversation)],
            [record.name, record.node, self._forget_at(now)],
        )
        if not lost:  # replaced, moved or dropped meanwhile: not this step's to emit
            return []
        gone = _retention_of(_pairs(lost))
        await self._retired(gone, now)
        return [RetentionChange(ChangeKind.NODE_LOST, gone, now)]

    def _put_error(
        self, out: Sequence[Any], retention: Retention, node_error: KvshuttleError | None
    ) -> KvshuttleError:
        reason = _s(out[1])
        if reason == "NODE" and node_error is not None:
            return node_error
        if reason == "FENCING_GENERATION_STALE":
            fence = _s(out[2])
            return Aborted(
                f"generation {retention.generation} is not newer than {fence} for {retention.conversation}",
                reason=ErrorReason.FENCING_GENERATION_STALE,
                metadata={"fence_generation": fence},
            )
        if reason == "PIN_EXPIRED":
            return FailedPrecondition(
                "pin_expire_time has already passed: the blocks are gone", reason=ErrorReason.PIN_EXPIRED
            )
        limit = _s(out[2])
        if limit == "max_retentions":
            return ResourceExhausted(
                f"at most {self._limits.max_retentions} retentions",
                reason=ErrorReason.CAPACITY_EXCEEDED,
                metadata={"limit": "max_retentions"},
            )
        return ResourceExhausted(
            f"tenant {retention.tenant} holds {self._limits.max_retentions_per_tenant} retentions",
            reason=ErrorReason.CAPACITY_EXCEEDED,
            metadata={"limit": "max_retentions_per_tenant"},
        )

    async def _read_retention(self, name: str) -> Retention | None:
        raw = await self._hgetall(self._conv_key(_conversation_of(name)))
        h = {_s(k): v for k, v in raw.items()}
        if _s(h.get("name", b"")) != name:
            return None
        return _retention_of(h)

    @_reachable
    async def get_retention(self, name: str) -> Retention:
        record = await self._read_retention(name)
        if record is None:
            raise _not_found(name)
        return record

    @_reachable
    async def get_conversation(self, name: str) -> Conversation:
        raw = await self._hgetall(self._conv_key(name))
        h = {_s(k): v for k, v in raw.items()}
        if "fence" not in h:
            raise NotFound(
                f"conversation {name} has no retention and no fencing generation",
                reason=ErrorReason.CONVERSATION_NOT_FOUND,
                metadata={"conversation": name},
            )
        return Conversation(name, int(h["fence"]), _retention_of(h) if "name" in h else None)

    @staticmethod
    def _claim_error(name: str, out: Sequence[Any]) -> KvshuttleError:
        reason = _s(out[1])
        if reason == "RETENTION_NOT_FOUND":
            return _not_found(name)
        if reason == "RETENTION_CLAIMED":
            return FailedPrecondition(
                f"retention {name} is claimed; a claim is never renewed",
                reason=ErrorReason.RETENTION_CLAIMED,
                metadata={"retention": name},
            )
        if reason == "RETENTION_ALREADY_CLAIMED":
            return Aborted(
                f"retention {name} is already claimed",
                reason=ErrorReason.RETENTION_ALREADY_CLAIMED,
                metadata={"retention": name},
            )
        return FailedPrecondition(
            f"retention {name} expired",
            reason=ErrorReason.RETENTION_EXPIRED,
            metadata={"retention": name},
        )

    @_reachable
    async def renew_retention(
        self, name: str, ttl: float, max_ttl: float, now: float
    ) -> tuple[Retention, list[RetentionChange]]:
        out = await self._run(
            "renew", [self._conv_key(_conversation_of(name))], [name, _t(now), _t(now + min(ttl, max_ttl))]
        )
        if _s(out[0]) == "err":
            raise self._claim_error(name, out)
        record = _retention_of(_pairs(out[1]))
        # Only ever later: the deadline set may keep the earlier one (the sweep reschedules it).
        return record, [RetentionChange(ChangeKind.RENEWED, record, now)]

    @_reachable
    async def claim_retention(
        self, name: str, holder: str, claim_ttl: float, now: float, *, request_id: str
    ) -> tuple[Retention, list[RetentionChange]]:
        conversation = _conversation_of(name)
        fingerprint = claim_fingerprint(holder).hex() if request_id else ""
        out = await self._run(
            "claim",
            [self._conv_key(conversation), self._idem_key(conversation, "claim", name, request_id)],
            [
                name,
                _t(now),
                request_id,
                fingerprint,
                uuid.uuid4().hex,
                holder,
                _t(now + claim_ttl),
                *self._idem_args(now),
            ],
        )
        tag = _s(out[0])
        if tag == "reused":
            raise request_id_reused()
        if tag == "repeat":
            return _retention_of(_pairs(out[1])), []
        if tag == "err":
            if _s(out[1]) == "CLAIM_ENDED":
                raise NotFound(
                    f"retention {name} is gone: the claim request {request_id} made has ended",
                    reason=ErrorReason.RETENTION_NOT_FOUND,
                    metadata={"retention": name},
                )
            raise self._claim_error(name, out)
        record = _retention_of(_pairs(out[1]))
        await self._redis.zadd(self._k_claimed, {name: 0})
        await self._hint(self._k_rdl, self._k_rver, name, record.expire_at)
        changes = [RetentionChange(ChangeKind.CLAIMED, record, now)]
        self._account(changes)
        return record, changes

    @_reachable
    async def release_retention(
        self, name: str, claim_id: str, force: bool, now: float, *, keep: bool = False
    ) -> list[RetentionChange]:
        out = await self._run(
            "release",
            [self._conv_key(_conversation_of(name))],
            [name, claim_id, "1" if force else "", "1" if keep else "", _t(now), self._forget_at(now)],
        )
        tag = _s(out[0])
        if tag == "err":
            reason = _s(out[1])
            if reason == "RETENTION_NOT_FOUND":
                raise _not_found(name)
            held_by = _s(out[2]) if len(out) > 2 else ""
            if reason == "CLAIM_MISMATCH_KEEP":
                held = f"is claimed by {held_by}" if held_by else "is not claimed"
                raise FailedPrecondition(
                    f"retention {name} {held}: only its claim's holder gives the claim back",
                    reason=ErrorReason.CLAIM_MISMATCH,
                    metadata={"retention": name, "field": "claim_id"},
                )
            raise FailedPrecondition(
                f"retention {name} is claimed by {held_by}",
                reason=ErrorReason.CLAIM_MISMATCH,
                metadata={"retention": name},
            )
        record = _retention_of(_pairs(out[1]))
        if tag == "unclaimed":
            await self._redis.zrem(self._k_claimed, name)
            await self._hint(self._k_rdl, self._k_rver, name, record.expire_at)
            changes = [RetentionChange(ChangeKind.UNCLAIMED, record, now)]
        else:
            await self._retired(record, now)
            kind = ChangeKind.EXPIRED if tag == "expired" else ChangeKind.RELEASED
            changes = [RetentionChange(kind, record, now)]
        self._account(changes)
        return changes

    @_reachable
    async def move_retention(
        self, move: Move, ttl: float, now: float, *, request_id: str
    ) -> tuple[Retention, list[RetentionChange]]:
        name = move.name
        conversation = _conversation_of(name)
        fingerprint = move_fingerprint(move).hex() if request_id else ""
        target = await self._read_node(move.node)
        mismatch = "" if target is None else Holder.mismatch(move.holder, target.spec, "kv_transfer_params")
        expire_at = now + ttl
        attached = 0
        if target is not None and not mismatch:
            attached = await self._run(
                "attach", self._node_keys(move.node)[:2], [name, move.kv_bytes, target.spec.engine_id, ""]
            )
            if not attached:
                target = None
        out = await self._run(
            "move",
            [self._conv_key(conversation), self._idem_key(conversation, "move", name, request_id)],
            [
                name,
                move.claim_id,
                _t(now),
                request_id,
                fingerprint,
                "" if target is None else "1",
                "" if target is None else target.spec.model,
                "" if target is None else str(target.spec.block_size),
                mismatch or "",
                move.node,
                move.kv_transfer_params,
                str(move.kv_bytes),
                _holder_json(move.holder),
                _t(expire_at),
                *self._idem_args(now),
            ],
        )
        tag = _s(out[0])
        if tag != "ok" and attached == 1:
            await self._run("detach", self._node_keys(move.node), [name])
        if tag == "reused":
            raise request_id_reused()
        if tag == "repeat":
            first = _retention_of(_pairs(out[1]))
            move.apply_to(first, float(out[2]))
            return first, []
        if tag == "err":
            raise self._move_error(move, out, target, request_id)
        previous = _s(out[1])
        record = _retention_of(_pairs(out[3]))
        assert target is not None
        if previous != move.node:
            await self._run("detach", self._node_keys(previous), [name])
        if attached == 2:  # it was there already (a move onto its own node): its new bytes
            await self._run(
                "attach", self._node_keys(move.node)[:2], [name, move.kv_bytes, target.spec.engine_id, "1"]
            )
        await self._redis.zrem(self._k_claimed, name)
        await self._hint(self._k_rdl, self._k_rver, name, expire_at)
        changes = [RetentionChange(ChangeKind.MOVED, record, now, previous_node=previous)]
        changes += await self._still_held(record, target.spec.engine_id, now)
        self._account(changes)
        return record, changes

    @staticmethod
    def _move_error(move: Move, out: Sequence[Any], target: Node | None, request_id: str) -> KvshuttleError:
        name = move.name
        reason = _s(out[1])
        if reason == "MOVE_ENDED":
            return NotFound(
                f"retention {name} is gone: the move request {request_id} made has ended",
                reason=ErrorReason.RETENTION_NOT_FOUND,
                metadata={"retention": name},
            )
        if reason == "RETENTION_NOT_FOUND":
            return _not_found(name)
        if reason == "CLAIM_MISMATCH":
            held_by = _s(out[2])
            held = f"is claimed by {held_by}" if held_by else "is not claimed"
            return FailedPrecondition(
                f"retention {name} {held}: only its claim's holder moves it",
                reason=ErrorReason.CLAIM_MISMATCH,
                metadata={"retention": name, "field": "claim_id"},
            )
        if reason == "RETENTION_EXPIRED":
            return FailedPrecondition(
                f"retention {name}'s claim lapsed",
                reason=ErrorReason.RETENTION_EXPIRED,
                metadata={"retention": name},
            )
        if reason == "NODE_NOT_FOUND" or target is None:
            return _node_not_found(move.node)
        if reason == "NODE_MISMATCH":
            return FailedPrecondition(
                f"node {move.node} serves model {target.spec.model!r} with block size "
                f"{target.spec.block_size}, not {_s(out[2])!r} / {_s(out[3])}",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": move.node, "field": "node"},
            )
        field = _s(out[2])
        return FailedPrecondition(
            f"kv_transfer_params do not name node {move.node} as registered "
            f"({field.rsplit('.', 1)[-1]} differs)",
            reason=ErrorReason.NODE_MISMATCH,
            metadata={"node": move.node, "field": field},
        )

    @_reachable
    async def evict_retention(self, name: str, node: str, now: float) -> list[RetentionChange]:
        out = await self._run(
            "evict", [self._conv_key(_conversation_of(name))], [name, node, self._forget_at(now)]
        )
        if _s(out[0]) == "err":
            reason = _s(out[1])
            if reason == "RETENTION_NOT_FOUND":
                raise _not_found(name)
            if reason == "NODE_MISMATCH":
                raise FailedPrecondition(
                    f"retention {name} is held by {_s(out[2])}, not {node}",
                    reason=ErrorReason.NODE_MISMATCH,
                    metadata={"retention": name, "node": node, "field": "node"},
                )
            raise FailedPrecondition(
                f"retention {name} is claimed by {_s(out[2])}: a reader may be reading it",
                reason=ErrorReason.RETENTION_ALREADY_CLAIMED,
                metadata={"retention": name},
            )
        record = _retention_of(_pairs(out[1]))
        await self._retired(record, now)
        changes = [RetentionChange(ChangeKind.EVICTED, record, now)]
        self._account(changes)
        return changes

    @_reachable
    async def list_retentions(
        self, *, tenant: str, conversation: str | None, node: str | None, after: str, limit: int
    ) -> list[Retention]:
        prefix = f"{conversation}/" if conversation else ""
        begin = max(after, prefix)
        start = f"({begin}" if begin else "-"
        key = self._tenant_key(tenant)
        out: list[Retention] = []
        while len(out) < limit:
            names = [_s(n) for n in await self._redis.zrangebylex(key, start, "+", 0, _BATCH)]
            if not names:
                break
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                pipe.hgetall(self._conv_key(_conversation_of(name)))
            replies = await pipe.execute()
            for name, raw in zip(names, replies, strict=True):
                if prefix and not name.startswith(prefix):
                    return out
                h = {_s(k): v for k, v in raw.items()}
                if _s(h.get("name", b"")) != name:
                    continue
                record = _retention_of(h)
                if node and record.node != node:
                    continue
                out.append(record)
                if len(out) >= limit:
                    return out
            if len(names) < _BATCH:
                break
            start = f"({names[-1]}"
        return out

    # ---- expiry ----------------------------------------------------------------------------

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
            await self._run("reschedule", [self._k_rdl, self._k_rver], [name, version, _s(out[1])])
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
            await self._run("reschedule", [self._k_rdl, self._k_rver], [name, version, ""])

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
        pipe.hmget(self._k_meta, ["lb", "early"])
        for dl in (self._k_ndl, self._k_rdl, self._k_fdl):
            pipe.zrange(dl, 0, 0, withscores=True)
        nodes, retentions, claimed, lingering, (lb, early), *firsts = await pipe.execute()
        self._counts = StoreCounts(
            nodes=nodes,
            retentions=retentions,
            claimed=claimed,
            fenced_conversations=retentions + lingering,
            lingering_fences=lingering,
            lingering_fence_bytes=int(lb or 0),
            fences_forgotten_early=int(early or 0),
        )
        deadlines = [float(first[0][1]) for first in firsts if first]
        self._deadline = min(deadlines) if deadlines else None

    def next_deadline(self) -> float | None:
        return self._deadline

    def counts(self) -> StoreCounts:
        return self._counts


def copy_retention(retention: Retention) -> Retention:
    """A snapshot callers may keep (the store never mutates a record it handed out)."""
    return copy.copy(retention)
