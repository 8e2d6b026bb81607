"""The mover: ParkRetention, Prefetch and PullBlocks as one domain operation. No grpc here.

A move reads the blocks a retention's params (`source`, addressed to their holder as the
registry lists it) describe into fresh pool slots with one READ of the pool's data plane
(kvshuttle.agent.pool.data_plane: NIXL's, kvshuttle.agent.pool.park),
seals them until `ttl` + the pool's serve grace from receipt, publishes them on the agent's pool
server under a fresh read id (kvshuttle.agent.pool.serve), and answers the `pooled` params that read
them from the agent's pool node. The caller (the router) holds the retention's registry claim
meanwhile and re-points the retention at the pool node afterwards (MoveRetention): the agent
never writes retentions.

* park: from the agent's own engine (the source must name its engine id: NODE_MISMATCH), the
  engine notified (it frees its blocks).
* prefetch: from any holder's side channel (a decode engine or another agent's pool server),
  notified; only into the pool of the node expected to run the next prefill, i.e. asked of that
  node's own agent (target_node: NODE_MISMATCH otherwise).
* pull: like prefetch, held as `pull/{request_id}`, notified only when asked; never evicted
  (nothing in the registry names it), freed by expiry or a reader's read-done.

A holder other than the own engine is checked as the engine was at start: its handshake's
compatibility hash must be the own engine's, its block size and KV layout the same, and its
blocks must mirror the pool's slots.

Room: when the pool is short of slots, parked allocations (park and prefetch only; none a
reader is on) are evicted by least value, oldest idle first (the conversation least likely to
come back), then most bytes, and each only once the registry dropped it from the pool node
(RegistryPort.evict_retention: gone already counts as dropped; claimed or not moved there yet
keeps it). An unreachable registry evicts nothing: the move is refused RESOURCE_EXHAUSTED and
the retention stays where it is.

Idempotency: a repeated request_id gets the first answer (a move still running is awaited, not
started again); the same id with another request is REQUEST_ID_REUSED. Failed moves are not
remembered (a retry tries again: a failed READ sent no notification). At most `remembered`
answers are kept, the oldest dropped first.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

import structlog
import zmq.asyncio

from kvshuttle.agent.pool.blocks import Allocation, BlockPool, SlotState
from kvshuttle.agent.pool.data_plane import HolderFetch, ReadServer, RetainedBlocks, SlotReader
from kvshuttle.agent.pool.side_channel import Handshake, fetch_handshake
from kvshuttle.agent.ports import RegistryPort, RegistryRefused
from kvshuttle.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvshuttleError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvshuttle.core.fingerprint import fingerprint, request_id_reused
from kvshuttle.core.limits import MAX_ID_LENGTH
from kvshuttle.core.names import check_id, parse_node, parse_retention
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.vllm.kv_transfer_params import from_vllm
from kvshuttle.vllm.nixl_wire import NixlIncompatible
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

__all__ = ["PULL_PREFIX", "READ_SECONDS_BUCKETS", "MoveKind", "MoveStats", "Moved", "Mover"]

log = structlog.get_logger("kvshuttle.agent")

PULL_PREFIX: Final = "pull/"
READ_SECONDS_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_PERSON: Final = b"kvshuttle-move"


class MoveKind(StrEnum):
    PARK = "park"
    PREFETCH = "prefetch"
    PULL = "pull"


@dataclass(frozen=True, slots=True)
class Moved:
    """A move's answer."""

    name: str  # the retention (park, prefetch) or pull/{request_id}
    node: str  # the pool node `pooled` reads from
    pooled: KvTransferParams
    bytes: int
    read_seconds: float  # the READ
    expire_time: float  # wall clock: the pool frees the slots then unless read first


@dataclass(slots=True)
class MoveStats:
    """Counters since the agent started, for its metrics."""

    # (kind, outcome): "moved", or the refusal's reason in lower case ("pin_expired", ...).
    moves: Counter[tuple[str, str]] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)  # by kind
    # Cumulative counts per READ_SECONDS_BUCKETS upper bound (+Inf last), their sum and count.
    read_buckets: list[int] = field(default_factory=lambda: [0] * (len(READ_SECONDS_BUCKETS) + 1))
    read_seconds_sum: float = 0.0
    reads: int = 0
    # Allocations freed to make room or by expiry, by why: "pool_full", "expired".
    evictions: Counter[str] = field(default_factory=Counter)
    # Eviction candidates the registry kept (claimed, not moved there), or could not be asked about.
    evictions_refused: Counter[str] = field(default_factory=Counter)

    def observe_read(self, seconds: float) -> None:
        self.reads += 1
        self.read_seconds_sum += seconds
        for i, bound in enumerate(READ_SECONDS_BUCKETS):
            if seconds <= bound:
                self.read_buckets[i] += 1
        self.read_buckets[-1] += 1


@dataclass(frozen=True, slots=True)
class _Held:
    kind: MoveKind
    idle_since: float  # time.monotonic() at receipt of the move
    slots: tuple[int, ...]


@dataclass(slots=True)
class _Remembered:
    fingerprint: bytes
    task: asyncio.Task[Moved]


class Mover:
    """Moves KV into the pool of one agent. Built once the pool server started."""

    def __init__(
        self,
        *,
        pool: BlockPool,
        parker: SlotReader[Any],
        server: ReadServer,
        registry: RegistryPort,
        engine: Handshake,
        context: zmq.asyncio.Context,
        node: str,
        pool_node: str,
        serve_grace: float,
        max_ttl: float,
        handshake_timeout: float = 5.0,
        remembered: int = 1024,
        fetch: HolderFetch = fetch_handshake,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`engine`: the own engine's handshake (checked at start); `node`, `pool_node`: the
        engine's node and the pool's node names. `parker`, `server` and `fetch` are the data plane's
        (kvshuttle.agent.pool.data_plane); `fetch` defaults to NIXL's."""
        if max_ttl <= 0 or serve_grace < 0 or remembered < 1:
            raise ValueError("max_ttl and remembered must be positive, serve_grace not negative")
        self._pool = pool
        self._parker = parker
        self._server = server
        self._registry = registry
        self._engine = engine
        self._context = context
        self.node = node
        self.pool_node = pool_node
        self._grace = serve_grace
        self._max_ttl = max_ttl
        self._handshake_timeout = handshake_timeout
        self._max_remembered = remembered
        self._fetch = fetch
        self._wall = wall_clock
        self._monotonic = monotonic
        self._held: dict[str, _Held] = {}  # the moves' allocations, while live
        self._remembered: OrderedDict[str, _Remembered] = OrderedDict()
        self._room = asyncio.Lock()  # making room and allocating, one move at a time
        self.stats = MoveStats()

    # -- the three moves ------------------------------------------------------------------------

    async def park(
        self, retention: str, source: KvTransferParams, *, ttl: float, request_id: str = ""
    ) -> Moved:
        """Park `retention` from the own engine. Raises InvalidArgument, FailedPrecondition
        (NODE_MISMATCH, PIN_EXPIRED, a slot layout the engine's blocks do not fill, the
        retention already in the pool), ResourceExhausted (CAPACITY_EXCEEDED), Unavailable
        (the READ failed: the engine keeps its blocks)."""
        parse_retention(retention, "retention")
        return await self._remembering(
            MoveKind.PARK, request_id, retention, source, ttl, notify=True, target=""
        )

    async def prefetch(
        self, retention: str, target_node: str, source: KvTransferParams, *, ttl: float, request_id: str = ""
    ) -> Moved:
        """Prefetch `retention` from its holder into this pool: `target_node` must be this
        agent's node (NODE_MISMATCH). Raises what park() raises, and Unavailable when the
        holder's side channel does not answer, FailedPrecondition when it is incompatible."""
        parse_retention(retention, "retention")
        parse_node(target_node, "target_node")
        if target_node != self.node:
            raise FailedPrecondition(
                f"this agent prefetches for {self.node}, not {target_node}",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": self.node},
            )
        return await self._remembering(
            MoveKind.PREFETCH, request_id, retention, source, ttl, notify=True, target=target_node
        )

    async def pull(
        self, source: KvTransferParams, *, ttl: float, notify_holder: bool, request_id: str
    ) -> Moved:
        """Pull `source`'s blocks from any holder into this pool as `pull/{request_id}`."""
        check_id(request_id, "request_id", max_length=MAX_ID_LENGTH)
        return await self._remembering(
            MoveKind.PULL,
            request_id,
            f"{PULL_PREFIX}{request_id}",
            source,
            ttl,
            notify=notify_holder,
            target="",
        )

    # -- the pool's side ------------------------------------------------------------------------

    def expired(self, allocations: list[Allocation]) -> None:
        """The expiry sweep freed `allocations`: count the moved ones."""
        for allocation in allocations:
            held = self._held.get(allocation.name)
            if held is not None and held.slots == allocation.slots:
                del self._held[allocation.name]
                if allocation.state is SlotState.PARKED:
                    self.stats.evictions["expired"] += 1

    # -- how a move runs ------------------------------------------------------------------------

    async def _remembering(
        self,
        kind: MoveKind,
        request_id: str,
        name: str,
        source: KvTransferParams,
        ttl: float,
        *,
        notify: bool,
        target: str,
    ) -> Moved:
        if request_id:
            check_id(request_id, "request_id", max_length=MAX_ID_LENGTH)
        if not math.isfinite(ttl) or ttl <= 0:
            raise InvalidArgument("ttl", "required, above 0")
        if ttl > self._max_ttl:
            raise InvalidArgument("ttl", f"at most {self._max_ttl:g} s")
        if not request_id:
            return await self._counted(kind, self._move(kind, name, source, ttl, notify=notify))
        fp = fingerprint(
            _PERSON,
            [kind, name, target, source.SerializeToString(deterministic=True), repr(ttl), str(notify)],
        )
        key = f"{kind}|{request_id}"
        first = self._remembered.get(key)
        if first is not None:
            if first.fingerprint != fp:
                raise request_id_reused()
            self._remembered.move_to_end(key)
            return await asyncio.shield(first.task)
        # A task of its own: a caller that goes away (deadline) leaves the move to finish, and
        # its retry gets the answer.
        task = asyncio.create_task(self._counted(kind, self._move(kind, name, source, ttl, notify=notify)))
        self._remembered[key] = _Remembered(fp, task)
        while len(self._remembered) > self._max_remembered:
            self._remembered.popitem(last=False)

        def forget_failed(done: asyncio.Task[Moved]) -> None:
            if (done.cancelled() or done.exception() is not None) and (
                (entry := self._remembered.get(key)) is not None and entry.task is done
            ):
                del self._remembered[key]

        task.add_done_callback(forget_failed)
        return await asyncio.shield(task)

    async def _counted(self, kind: MoveKind, move: Awaitable[Moved]) -> Moved:
        try:
            moved = await move
        except KvshuttleError as exc:
            self.stats.moves[(kind, str(exc.reason).lower())] += 1
            raise
        except BaseException:
            self.stats.moves[(kind, "error")] += 1
            raise
        self.stats.moves[(kind, "moved")] += 1
        self.stats.bytes[kind] += moved.bytes
        self.stats.observe_read(moved.read_seconds)
        return moved

    async def _move(
        self, kind: MoveKind, name: str, source: KvTransferParams, ttl: float, *, notify: bool
    ) -> Moved:
        received, wall = self._monotonic(), self._wall()
        retained = RetainedBlocks.of(source, "source")
        holder = self._engine if kind is MoveKind.PARK else await self._holder(source, retained)
        self._parker.check(retained, holder)
        if any(a.name == name for a in self._pool.allocations()):  # before evicting for it
            raise FailedPrecondition(f"{name} already holds pool slots")
        hold = ttl + self._grace
        async with self._room:
            await self._make_room(len(retained.block_ids))
            prepared = self._parker.prepare(name, retained, holder, notify=notify)
        parked = await self._parker.read(prepared, expire_at=received + hold)
        try:
            params = self._server.publish(name, retained.num_tokens)
        except KvshuttleError:
            self._pool.release(name)
            raise
        self._prune()  # bounded: one entry per live allocation
        self._held[name] = _Held(kind, received, parked.allocation.slots)
        log.info(
            "agent.moved",
            kind=str(kind),
            retention=name,
            holder=retained.engine_id,
            pool_node=self.pool_node,
            blocks=parked.allocation.blocks,
            bytes=parked.bytes,
            ttl_s=ttl,
            read_ms=round(parked.read_seconds * 1000, 3),
        )
        return Moved(
            name=name,
            node=self.pool_node,
            pooled=from_vllm(params, "pooled"),
            bytes=parked.bytes,
            read_seconds=parked.read_seconds,
            expire_time=wall + hold,
        )

    async def _holder(self, source: KvTransferParams, retained: RetainedBlocks) -> Handshake:
        """The handshake of the holder `source` names, checked against the own engine's."""
        for required in ("remote_host", "remote_port"):
            if not source.HasField(required):
                raise InvalidArgument(f"source.{required}", "missing")
        own = self._engine
        try:
            holder = await self._fetch(
                self._context,
                source.remote_host,
                source.remote_port,
                reply_timeout=self._handshake_timeout,
                expected_hash=own.payload.compatibility_hash,
            )
        except NixlIncompatible:
            raise
        except InvalidArgument as exc:  # the holder's answer, not the caller's request
            where = f"{source.remote_host}:{source.remote_port}"
            message = f"the holder at {where} sent no valid NIXL handshake: {exc.message}"
            raise FailedPrecondition(message) from None
        differences = {
            what: (str(mine), str(theirs))
            for what, mine, theirs in (
                ("block_size", own.metadata.block_size, holder.metadata.block_size),
                ("kv_cache_layout", own.metadata.kv_cache_layout, holder.metadata.kv_cache_layout),
                ("block_lens", own.metadata.block_lens, holder.metadata.block_lens),
            )
            if mine != theirs
        }
        if differences:
            raise NixlIncompatible(differences)
        return holder

    async def _make_room(self, blocks: int) -> None:
        """Evict parked allocations until `blocks` slots are free, as far as the registry lets."""
        pool = self._pool
        if pool.stats().free_blocks >= blocks or blocks > pool.layout.blocks:
            return  # room enough, or never enough: allocate says which
        live = self._prune()
        candidates = sorted(
            (
                (held.idle_since, -live[name].bytes, name)
                for name, held in self._held.items()
                if held.kind is not MoveKind.PULL
                and live[name].state is SlotState.PARKED
                and not self._server.active(name)
            ),
        )
        for _, _, name in candidates:
            if pool.stats().free_blocks >= blocks:
                return
            try:
                await self._registry.evict_retention(name, self.pool_node)
            except NotFound:
                pass  # gone from the registry already: no reader can be handed its params
            except FailedPrecondition as exc:  # claimed, or not (yet) moved to the pool node
                self.stats.evictions_refused[str(exc.reason).lower()] += 1
                continue
            except RegistryRefused as exc:
                self.stats.evictions_refused[exc.reason.lower()] += 1
                log.warning("agent.evict_refused", retention=name, reason=exc.reason, error=str(exc))
                continue
            except Unavailable as exc:
                self.stats.evictions_refused["registry_unavailable"] += 1
                raise ResourceExhausted(
                    f"the pool is full and the registry cannot be reached to evict: {exc.message}",
                    reason=ErrorReason.CAPACITY_EXCEEDED,
                ) from None
            self._evict(name, "pool_full")

    def _prune(self) -> dict[str, Allocation]:
        """Forget the moves whose allocations are gone (read, expired); the live allocations."""
        live = {a.name: a for a in self._pool.allocations()}
        for name in [n for n, h in self._held.items() if n not in live or live[n].slots != h.slots]:
            del self._held[name]
        return live

    def _evict(self, name: str, why: str) -> None:
        held = self._held.pop(name, None)
        try:
            allocation = self._pool.get(name)
        except NotFound:
            return  # read and released meanwhile
        if held is None or allocation.slots != held.slots or allocation.state is not SlotState.PARKED:
            return
        self._pool.release(name)
        self._server.withdraw(name)
        self.stats.evictions[why] += 1
        log.info("agent.evicted", retention=name, why=why, blocks=allocation.blocks, pool_node=self.pool_node)
