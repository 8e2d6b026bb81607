"""The shuttle: moves this replica's committed retentions off their decode engines into the
agents' DRAM pools (park), or next to the prefill node the conversation's next turn will most
likely use (prefetch). No grpc here: the registry and the agents are ports.

Fed by the committer after each retention it stored (only this replica's own commits are
scheduled), it keeps a bounded schedule keyed by conversation: a newer commit replaces the
conversation's entry, and the oldest entry is dropped when the schedule is full. A park is due

* once the conversation has been idle `park_after_idle_s` (reason `idle`),
* at once, oldest idle first, while its decode node's kv_cache_usage is above
  `park_kv_usage_above` (reason `kv_usage`),
* at the latest `park_before_pin_s` before the engine's pin on the blocks ends, when the
  conversation may come back after it (`max_idle_s` reaches past the pin; reason `pin_ending`).

A prefetch is due at commit time, when the turn's plan carried `expected_think_time_s` and
that is at least `prefetch_margin` times the estimated move (the cost model's link), to the
pool of the conversation's last prefill node (reason `think_time`). One that does not move
falls back to the park schedule.

A move, once due: read the conversation and the nodes; skip unless the retention is still the
one scheduled (same name and generation), unclaimed, on a live node the router can address (a
DECODE or BOTH engine for a park), and the target's pool node (`pool_node_name`) is live; claim
it (single use: nobody else reads its blocks from now on, which makes freeing the holder's
blocks safe); ask the agent to read it into its pool (`source` = the whole retention addressed
to its holder as registered, `ttl` = max_idle_s minus the time the conversation has been
idle); then MoveRetention (claim id, the pool node, the pooled params, kv bytes, ttl), which
re-points the retention in one registry update. An agent that refused (it read nothing) gets
the claim given back (ReleaseRetention with keep): the retention stays as it was, on its holder,
for the next turn. An agent whose answer is unknown (unavailable, past
its deadline) or a move the registry refused leaves the claim to lapse: the retention is never
readable while half moved.

Each move logs one line, `shuttle.move`, with kind, reason and outcome, and counts
`kvshuttle_router_moves_total{kind,reason,outcome}`; moved bytes and move seconds too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

import structlog

from kvshuttle.core.clock import Clock
from kvshuttle.core.digest import log_name
from kvshuttle.core.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    KvshuttleError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvshuttle.core.nodes import POOL_OF_LABEL, NodeRole, pool_node_name
from kvshuttle.router.cost import CostModel
from kvshuttle.router.hints import RetentionHints
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.model import NodeInfo, RetentionInfo, RouterPolicy
from kvshuttle.router.node_directory import NodeDirectory
from kvshuttle.router.ports import AgentPort, RegistryPort
from kvshuttle.router.verify import knows_side_channel, whole_params

__all__ = ["MoveKind", "MoveReason", "Outcome", "Shuttle"]

log = structlog.get_logger("kvshuttle.router")

# Stale heap items (replaced or dropped entries) kept before the heap is rebuilt, per entry.
_HEAP_SLACK = 2


class MoveKind(StrEnum):
    PARK = "park"
    PREFETCH = "prefetch"


class MoveReason(StrEnum):
    IDLE = "idle"
    KV_USAGE = "kv_usage"
    PIN_ENDING = "pin_ending"
    THINK_TIME = "think_time"


class Outcome(StrEnum):
    MOVED = "moved"
    # The conversation holds another retention now (a newer commit, a plan consumed it) or none.
    SKIPPED_REPLACED = "skipped_replaced"
    # Claimed by a plan first: the turn reads it where it is.
    SKIPPED_CLAIMED = "skipped_claimed"
    # A park of a retention no engine holds any more (a pool holds it already).
    SKIPPED_NOT_ON_DECODE = "skipped_not_on_decode"
    # A prefetch to where it is already.
    SKIPPED_ALREADY_THERE = "skipped_already_there"
    # Its holder is gone, unhealthy, or has no side channel the router knows.
    SKIPPED_HOLDER_DOWN = "skipped_holder_down"
    # No live pool node for the target (no agent with a pool, or it is down).
    SKIPPED_NO_POOL = "skipped_no_pool"
    # The conversation has been idle so long that the lease left is under min_ttl_s.
    SKIPPED_IDLE_OVER = "skipped_idle_over"
    # The retention's lease ends before a move could finish.
    SKIPPED_EXPIRING = "skipped_expiring"
    # Dropped from a full schedule (the oldest goes).
    SKIPPED_SCHEDULE_FULL = "skipped_schedule_full"
    # The registry did not answer the reads: nothing claimed, tried again at the next due time.
    SKIPPED_REGISTRY_UNAVAILABLE = "skipped_registry_unavailable"
    # The claim's answer is unknown: it may have landed, and then the retention lapses with it.
    FAILED_CLAIM = "failed_claim"
    # The agent's pool is full (nothing evictable): claim released.
    FAILED_POOL_FULL = "failed_pool_full"
    # The agent refused (read nothing): claim released.
    FAILED_AGENT = "failed_agent"
    # The agent's answer is unknown (it may have read): the claim lapses.
    FAILED_AGENT_UNAVAILABLE = "failed_agent_unavailable"
    # The agent answered another pool node than asked: the claim lapses.
    FAILED_AGENT_ANSWER = "failed_agent_answer"
    # The registry refused or did not answer the move after the agent read: the claim lapses.
    FAILED_MOVE = "failed_move"
    # A bug: logged with its traceback.
    FAILED_ERROR = "failed_error"


# Outcomes after which a prefetch falls back to the park schedule (the retention is untouched).
_PARK_INSTEAD = frozenset(
    {
        Outcome.SKIPPED_NO_POOL,
        Outcome.SKIPPED_REGISTRY_UNAVAILABLE,
        Outcome.SKIPPED_HOLDER_DOWN,
    }
)


@dataclass(slots=True)
class _Entry:
    conversation: str
    retention: str
    generation: int
    model: str
    node: str  # the decode node that holds it (as committed)
    kv_bytes: int
    num_tokens: int
    # The conversation's last activity (its commit); its lease ends max_idle_s after.
    active_at: float
    due_at: float
    kind: MoveKind
    reason: MoveReason
    target: str = ""  # a prefetch's prefill node
    seq: int = 0


@dataclass(slots=True)
class _Fields:
    """What one move's log line says."""

    holder: str = ""
    pool: str = ""
    ttl_s: float = 0.0
    bytes: int = 0
    error: str = ""


class Shuttle:
    def __init__(
        self,
        *,
        port: RegistryPort,
        agents: AgentPort,
        clock: Clock,
        nodes: NodeDirectory,
        hints: RetentionHints,
        costs: Mapping[str, CostModel],
        policy: RouterPolicy,
        metrics: RouterMetrics,
    ) -> None:
        self._port = port
        self._agents = agents
        self._clock = clock
        self._nodes = nodes
        self._hints = hints
        self._costs = costs
        self._policy = policy
        self._parking = policy.parking
        self._metrics = metrics
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # by last activity, oldest first
        self._heap: list[tuple[float, int, str]] = []
        self._models: dict[str, int] = {}
        self._seq = 0
        self._moving: set[asyncio.Task[Outcome]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def in_flight(self) -> int:
        return len(self._moving)

    # ---- the schedule ----------------------------------------------------------------------

    def committed(
        self,
        conversation: str,
        retention: RetentionInfo,
        *,
        kv_bytes: int,
        pin_expire_at: float,
        prefill_node: str,
        expected_think_time_s: float | None,
    ) -> None:
        """Schedule the retention a commit of this replica just stored (replacing whatever the
        conversation had scheduled)."""
        if self._closed:
            return
        now = self._clock.now()
        entry = _Entry(
            conversation=conversation,
            retention=retention.name,
            generation=retention.generation,
            model=retention.model,
            node=retention.node,
            kv_bytes=kv_bytes,
            num_tokens=retention.num_tokens,
            active_at=now,
            due_at=now,
            kind=MoveKind.PARK,
            reason=MoveReason.IDLE,
        )
        if self._wants_prefetch(entry, prefill_node, expected_think_time_s):
            entry.kind, entry.reason, entry.target = MoveKind.PREFETCH, MoveReason.THINK_TIME, prefill_node
            self._put(entry)
            return
        park = self._park_entry(entry, pin_expire_at)
        if park is None:
            self.forget(conversation)
        else:
            self._put(park)

    def forget(self, conversation: str) -> None:
        entry = self._entries.pop(conversation, None)
        if entry is not None:
            self._dropped(entry)

    def _wants_prefetch(self, entry: _Entry, prefill_node: str, think_s: float | None) -> bool:
        if not self._parking.prefetch_enabled or think_s is None or not prefill_node:
            return False
        if prefill_node == entry.node:  # a kv_both node: its next prefill reads locally already
            return False
        cost = self._costs.get(entry.model)
        if cost is None:
            return False
        move_s = cost.transfer_ms(entry.num_tokens) / 1e3
        return think_s >= self._parking.prefetch_margin * move_s

    def _park_entry(self, entry: _Entry, pin_expire_at: float) -> _Entry | None:
        """The park schedule of `entry` (None with parking off): idle, or before the pin ends
        when that comes first and the conversation may outlive it."""
        p = self._parking
        if not p.enabled:
            return None
        idle_at = entry.active_at + p.park_after_idle_s
        pin_at = pin_expire_at - p.park_before_pin_s
        lives_past_pin = entry.active_at + p.max_idle_s > pin_expire_at
        if lives_past_pin and pin_at < idle_at:
            return replace(entry, kind=MoveKind.PARK, reason=MoveReason.PIN_ENDING, due_at=pin_at, target="")
        return replace(entry, kind=MoveKind.PARK, reason=MoveReason.IDLE, due_at=idle_at, target="")

    def _put(self, entry: _Entry) -> None:
        old = self._entries.pop(entry.conversation, None)
        if old is not None:
            self._dropped(old)
        self._seq += 1
        entry.seq = self._seq
        self._entries[entry.conversation] = entry
        self._models[entry.model] = self._models.get(entry.model, 0) + 1
        heapq.heappush(self._heap, (entry.due_at, entry.seq, entry.conversation))
        while len(self._entries) > self._parking.max_scheduled:
            _, oldest = self._entries.popitem(last=False)
            self._dropped(oldest)
            self._count(oldest, oldest.reason, Outcome.SKIPPED_SCHEDULE_FULL)
        if len(self._heap) > _HEAP_SLACK * len(self._entries) + 64:
            self._heap = [(e.due_at, e.seq, e.conversation) for e in self._entries.values()]
            heapq.heapify(self._heap)
        self._metrics.scheduled.set(len(self._entries))

    def _dropped(self, entry: _Entry) -> None:
        left = self._models.get(entry.model, 0) - 1
        if left > 0:
            self._models[entry.model] = left
        else:
            self._models.pop(entry.model, None)
        self._metrics.scheduled.set(len(self._entries))

    def _take(self, conversation: str) -> _Entry:
        entry = self._entries.pop(conversation)
        self._dropped(entry)
        return entry

    # ---- running ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Start due moves every tick_s until cancelled (then wait for the moves in flight)."""
        try:
            while True:
                try:
                    await self.step()
                except Exception:  # a tick that failed; the next one tries again
                    log.exception("shuttle.tick_failed")
                await asyncio.sleep(self._parking.tick_s)
        except asyncio.CancelledError:
            self._closed = True
            raise

    async def step(self) -> int:
        """Start the moves due now (kv_usage ones first), at most max_in_flight running at
        once; returns how many started."""
        free = self._parking.max_in_flight - len(self._moving)
        started = 0
        if free <= 0 or self._closed:
            return 0
        for conversation in await self._pressured():
            if started >= free:
                return started
            entry = self._take(conversation)
            self._start(entry, MoveReason.KV_USAGE)
            started += 1
        now = self._clock.now()
        while self._heap and started < free and self._heap[0][0] <= now:
            _, seq, conversation = heapq.heappop(self._heap)
            scheduled = self._entries.get(conversation)
            if scheduled is None or scheduled.seq != seq:
                continue  # replaced or dropped since
            self._take(conversation)
            self._start(scheduled, scheduled.reason)
            started += 1
        return started

    async def drain(self) -> None:
        """Wait for the moves in flight."""
        while self._moving:
            await asyncio.gather(*self._moving, return_exceptions=True)

    async def close(self, grace_s: float) -> None:
        """Start nothing more; give the moves in flight `grace_s`, then cancel them (a move cut
        short leaves its claim to lapse)."""
        self._closed = True
        if self._moving:
            _, pending = await asyncio.wait(set(self._moving), timeout=grace_s)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _pressured(self) -> list[str]:
        """Conversations to park at once: those scheduled for a park on a decode node whose
        kv_cache_usage is above park_kv_usage_above (and which has a pool), oldest first."""
        if not self._parking.enabled or not self._entries:
            return []
        nodes: dict[str, NodeInfo] = {}
        for model in list(self._models):
            try:
                nodes.update((x.name, x) for x in await self._nodes.nodes(model))
            except KvshuttleError as err:  # the registry is down: the next tick looks again
                log.warning("shuttle.nodes_unavailable", model=model, reason=err.reason)
        full = {
            name
            for name, x in nodes.items()
            if x.role in (NodeRole.DECODE, NodeRole.BOTH)
            and x.kv_cache_usage > self._parking.park_kv_usage_above
            and _pool_of(nodes, name) is not None
        }
        if not full:
            return []
        limit = self._parking.max_in_flight
        return [c for c, e in self._entries.items() if e.kind is MoveKind.PARK and e.node in full][:limit]

    def _start(self, entry: _Entry, reason: MoveReason) -> None:
        task = asyncio.create_task(self._move(entry, reason), context=contextvars.Context())
        self._moving.add(task)
        self._metrics.moves_in_flight.set(len(self._moving))

        def done(t: asyncio.Task[Outcome]) -> None:
            self._moving.discard(t)
            self._metrics.moves_in_flight.set(len(self._moving))

        task.add_done_callback(done)

    async def _move(self, entry: _Entry, reason: MoveReason) -> Outcome:
        fields = _Fields()
        started = time.perf_counter()
        try:
            outcome = await self._attempt(entry, fields)
        except asyncio.CancelledError:
            self._log(entry, reason, Outcome.FAILED_ERROR, fields, time.perf_counter() - started, "cancelled")
            raise
        except Exception:
            log.exception("shuttle.move_crashed", retention=log_name(entry.retention))
            outcome = Outcome.FAILED_ERROR
        seconds = time.perf_counter() - started
        self._count(entry, reason, outcome)
        if fields.pool and outcome not in _SKIPPED:
            self._metrics.move_seconds.labels(entry.kind.value).observe(seconds)
        if outcome is Outcome.MOVED:
            self._metrics.moved_bytes.labels(entry.kind.value).inc(fields.bytes)
        self._log(entry, reason, outcome, fields, seconds)
        if entry.kind is MoveKind.PREFETCH and outcome in _PARK_INSTEAD:
            self._park_instead(entry)
        return outcome

    def _park_instead(self, entry: _Entry) -> None:
        """A prefetch that did not move: the park schedule, unless a newer commit came."""
        if self._closed or entry.conversation in self._entries:
            return
        # The pin is not known here: the commit's ttl ended it no earlier than the idle park.
        park = self._park_entry(entry, entry.active_at + self._parking.max_idle_s)
        if park is not None:
            self._put(park)

    def _count(self, entry: _Entry, reason: MoveReason, outcome: Outcome) -> None:
        self._metrics.moves.labels(entry.kind.value, reason.value, outcome.value).inc()

    def _log(
        self,
        entry: _Entry,
        reason: MoveReason,
        outcome: Outcome,
        fields: _Fields,
        seconds: float,
        error: str = "",
    ) -> None:
        line = log.info if outcome is Outcome.MOVED or outcome in _SKIPPED else log.warning
        line(
            "shuttle.move",
            kind=entry.kind.value,
            reason=reason.value,
            outcome=outcome.value,
            retention=log_name(entry.retention),
            holder=fields.holder or entry.node,
            pool=fields.pool,
            target=entry.target,
            kv_bytes=fields.bytes or entry.kv_bytes,
            ttl_s=round(fields.ttl_s, 3),
            idle_s=round(self._clock.now() - entry.active_at, 3),
            seconds=round(seconds, 4),
            error=error or fields.error,
        )

    async def _attempt(self, entry: _Entry, fields: _Fields) -> Outcome:
        p, now = self._parking, self._clock.now()
        ttl = p.max_idle_s - (now - entry.active_at)
        fields.ttl_s = ttl
        if ttl < p.min_ttl_s:
            return Outcome.SKIPPED_IDLE_OVER
        try:
            nodes = {x.name: x for x in await self._nodes.nodes(entry.model)}
            _, current = await self._port.get_conversation(entry.conversation)
        except Unavailable as err:
            fields.error = err.reason
            return Outcome.SKIPPED_REGISTRY_UNAVAILABLE
        if current is None or current.name != entry.retention or current.generation != entry.generation:
            return Outcome.SKIPPED_REPLACED
        if current.claimed:
            return Outcome.SKIPPED_CLAIMED
        holder = nodes.get(current.node)
        fields.holder = current.node
        if entry.kind is MoveKind.PARK and holder is not None and holder.role is NodeRole.POOL:
            return Outcome.SKIPPED_NOT_ON_DECODE
        if holder is None or not holder.healthy or not knows_side_channel(holder):
            return Outcome.SKIPPED_HOLDER_DOWN
        engine = holder.name if entry.kind is MoveKind.PARK else entry.target
        pool = _pool_of(nodes, engine, current)
        if pool is None:
            return Outcome.SKIPPED_NO_POOL
        fields.pool = pool.name
        if pool.name == holder.name:
            return Outcome.SKIPPED_ALREADY_THERE
        if current.expire_at - now < self._policy.claim_headroom_s:
            return Outcome.SKIPPED_EXPIRING
        return await self._claimed_move(entry, current, holder, pool, ttl, fields)

    async def _claimed_move(
        self,
        entry: _Entry,
        current: RetentionInfo,
        holder: NodeInfo,
        pool: NodeInfo,
        ttl: float,
        fields: _Fields,
    ) -> Outcome:
        attempt = uuid.uuid4().hex
        try:
            claim = await self._port.claim(
                current.name,
                holder=f"router:shuttle:{entry.kind.value}",
                claim_ttl=self._policy.claim_ttl_s,
                request_id=f"shuttle-{attempt}",
            )
        except (Aborted, FailedPrecondition) as err:
            fields.error = err.reason
            return Outcome.SKIPPED_CLAIMED if isinstance(err, Aborted) else Outcome.SKIPPED_REPLACED
        except NotFound as err:
            fields.error = err.reason
            return Outcome.SKIPPED_REPLACED
        except Unavailable as err:
            fields.error = err.reason
            return Outcome.FAILED_CLAIM
        # The conversation's hint names the holder this replica stored: stale from now on.
        hint = self._hints.get(entry.conversation)
        self._hints.forget(entry.conversation)
        retention = claim.retention
        if retention.generation != entry.generation or retention.node != holder.name:
            await self._give_back(retention.name, claim.claim_id, fields)  # changed under us, unread
            return Outcome.SKIPPED_REPLACED
        source = whole_params(retention, holder)
        fields.bytes = retention.num_tokens * holder.kv_bytes_per_token
        try:
            if entry.kind is MoveKind.PARK:
                pooled = await self._agents.park(
                    pool.agent_endpoint, retention.name, source=source, ttl=ttl, request_id=f"park-{attempt}"
                )
            else:
                pooled = await self._agents.prefetch(
                    pool.agent_endpoint,
                    retention.name,
                    entry.target,
                    source=source,
                    ttl=ttl,
                    request_id=f"prefetch-{attempt}",
                )
        except Unavailable as err:
            fields.error = err.reason
            return Outcome.FAILED_AGENT_UNAVAILABLE
        except (ResourceExhausted, FailedPrecondition, NotFound, Aborted, InvalidArgument) as err:
            fields.error = err.reason
            await self._give_back(retention.name, claim.claim_id, fields)  # the agent read nothing
            return Outcome.FAILED_POOL_FULL if isinstance(err, ResourceExhausted) else Outcome.FAILED_AGENT
        if pooled.node != pool.name:
            fields.error = f"agent answered {pooled.node}"
            return Outcome.FAILED_AGENT_ANSWER
        try:
            moved = await self._port.move_retention(
                retention.name,
                claim_id=claim.claim_id,
                node=pool.name,
                kv_transfer_params=pooled.kv_transfer_params,
                kv_bytes=fields.bytes,
                ttl=ttl,
                request_id=f"move-{attempt}",
            )
        except KvshuttleError as err:
            fields.error = str(err.reason)
            return Outcome.FAILED_MOVE
        fresh = self._hints.get(entry.conversation) is None  # no newer commit's hint since
        if fresh and hint is not None and hint.name == moved.name and hint.generation == moved.generation:
            # The next plan here reads it where it is now, still cut token-granular.
            known = replace(moved, known_from_block=hint.known_from_block, known_tokens=hint.known_tokens)
            self._hints.put(entry.conversation, known)
        return Outcome.MOVED

    async def _give_back(self, name: str, claim_id: str, fields: _Fields) -> None:
        """Give back a claim the move did not read under: the retention stays as it was, for
        the next turn. Best effort: a claim that does not reach the registry lapses on its TTL
        (and the retention with it)."""
        try:
            await self._port.release(name, claim_id=claim_id, keep=True)
        except KvshuttleError as err:
            log.warning("shuttle.release_failed", retention=log_name(name), reason=err.reason)
            fields.error = fields.error or str(err.reason)


_SKIPPED = frozenset(o for o in Outcome if o.value.startswith("skipped_"))


def _pool_of(
    nodes: Mapping[str, NodeInfo], engine: str, retention: RetentionInfo | None = None
) -> NodeInfo | None:
    """The live pool node of `engine`'s agent, when the router can send the agent a move and a
    reader the pool's blocks (and, given `retention`, it holds KV of its kind)."""
    try:
        name = pool_node_name(engine)
    except InvalidArgument:
        return None
    pool = nodes.get(name)
    if pool is None or pool.role is not NodeRole.POOL or not pool.healthy or not pool.agent_endpoint:
        return None
    if pool.labels.get(POOL_OF_LABEL, engine) != engine or not knows_side_channel(pool):
        return None
    if retention is not None and (pool.model != retention.model or pool.block_size != retention.block_size):
        return None
    return pool
