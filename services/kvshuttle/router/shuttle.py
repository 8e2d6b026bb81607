"""The shuttle: moves this replica's committed retentions off their decode engines into the
agents' DRAM pools (park), or next to the prefill node the conversation's next turn will most
likely use (prefetch). No grpc here: the registry and the agents are ports.

Fed by the committer after each retention it stored (only this replica's own commits are
scheduled), it keeps a bounded schedule keyed by conversation: a newer commit replaces the
conversation's entry, and the oldest entry is dropped when the schedule is full. A park is due

* once the conversation has been idle `park_after_idle_s` (reason `idle`),
* at once, oldest idle first (lowest value per byte first, below), while its decode node's
  kv_cache_usage is above `park_kv_usage_above` (reason `kv_usage`),
* at the latest `park_before_pin_s` before the engine's pin on the blocks ends, when the
  conversation may come back after it (`max_idle_s` reaches past the pin; reason `pin_ending`).

Where the gaps after the commit's end are learnt (kvshuttle.router.next_turn; `next_turn`
policy), they set the idle park's time instead (reason `next_turn`): kept on decode through the
likely tool call, parked at once when the next turn is unlikely soon; and the kv_usage parks go
lowest value per byte first (the least likely to be wanted soon, per byte freed), not oldest.

A prefetch is due at commit time, when the turn's plan carried `expected_think_time_s` and
that is at least `prefetch_margin` times the estimated move (the cost model's link), to the
pool of the conversation's last prefill node (reason `think_time`); with no hint and learnt
gaps, the learnt park time moves it there instead of to any pool (reason `next_turn`). Never
when the next turn would extend on the holder. One that does not move falls back to the park
schedule.

A move, once due, is carried out by move_runner.py (checks, claim, the agent's read, MoveRetention).

Each move logs one line, `shuttle.move`, with kind, reason and outcome, and counts
`kvshuttle_router_moves_total{kind,reason,outcome}`; moved bytes and move seconds too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace

import structlog

from kvshuttle.core.clock import Clock
from kvshuttle.core.digest import log_name
from kvshuttle.core.errors import KvshuttleError
from kvshuttle.core.nodes import NodeRole
from kvshuttle.router.cost import CostModel
from kvshuttle.router.hints import RetentionHints
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.model import NodeInfo, RetentionInfo, TurnEnd
from kvshuttle.router.move_runner import (
    PARK_INSTEAD,
    SKIPPED,
    MoveFields,
    MoveKind,
    MoveReason,
    MoveRunner,
    Outcome,
    ScheduledMove,
    pool_of,
)
from kvshuttle.router.next_turn import NextTurnModel
from kvshuttle.router.node_directory import NodeDirectory
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.router.ports import AgentPort, RegistryPort

__all__ = ["MoveKind", "MoveReason", "Outcome", "Shuttle"]

log = structlog.get_logger("kvshuttle.router")

# Stale heap items (replaced or dropped entries) kept before the heap is rebuilt, per entry.
_HEAP_SLACK = 2


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
        self._runner = MoveRunner(
            port=port, agents=agents, clock=clock, nodes=nodes, hints=hints, policy=policy
        )
        self._clock = clock
        self._nodes = nodes
        self._costs = costs
        self._policy = policy
        self._parking = policy.parking
        self._metrics = metrics
        self._next_turn = NextTurnModel(policy.next_turn) if policy.next_turn.enabled else None
        self._entries: OrderedDict[str, ScheduledMove] = OrderedDict()  # by last activity, oldest first
        self._heap: list[tuple[float, int, str]] = []
        self._models: dict[str, int] = {}
        self._seq = 0
        self._moving: set[asyncio.Task[Outcome]] = set()
        # Conversation -> its retention's move while it runs (it holds the retention's claim).
        self._moving_for: dict[str, asyncio.Task[Outcome]] = {}
        self._closed = False

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def in_flight(self) -> int:
        return len(self._moving)

    def move_in_flight(self, conversation: str) -> asyncio.Task[Outcome] | None:
        """The move of the conversation's retention while it runs (None: there is none)."""
        return self._moving_for.get(conversation)

    def park_for_forks(
        self, conversation: str, retention: RetentionInfo, *, kv_bytes: int, max_ttl_s: float = math.inf
    ) -> asyncio.Task[Outcome] | None:
        """Park `retention` now, for the forks of its history to read it together (reason
        `fork`; its lease at most `max_ttl_s`): the move of the conversation's retention already
        running, else a new one, else None (parking off, the shuttle closing or max_in_flight
        moves running)."""
        running = self._moving_for.get(conversation)
        if running is not None:
            return running
        if self._closed or not self._parking.enabled or len(self._moving) >= self._parking.max_in_flight:
            return None
        scheduled = self._entries.get(conversation)
        if scheduled is not None and scheduled.retention == retention.name:
            entry = self._take(conversation)
            entry = replace(entry, kind=MoveKind.PARK, reason=MoveReason.FORK, target="", max_ttl_s=max_ttl_s)
        else:  # committed by another replica: its lease runs max_idle_s from now
            entry = ScheduledMove.park(conversation, retention, kv_bytes=kv_bytes, now=self._clock.now(),
                                       reason=MoveReason.FORK, max_ttl_s=max_ttl_s)  # fmt: skip
        self._start(entry, MoveReason.FORK)
        return self._moving_for[conversation]

    # ---- what the conversations do next ----------------------------------------------------

    def turn_ended(self, conversation: str, end: TurnEnd) -> None:
        """A turn of `conversation` was committed here, its answer ended so (stored or not)."""
        if self._next_turn is not None and conversation:
            self._next_turn.committed(conversation, end, self._clock.now())

    def turn_arrived(self, conversation: str) -> None:
        """A turn of `conversation` is being planned here."""
        if self._next_turn is not None and conversation:
            self._next_turn.arrived(conversation, self._clock.now())

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
        computed_tokens: int = 0,
        turn_end: TurnEnd = TurnEnd.UNSPECIFIED,
    ) -> None:
        """Schedule the retention a commit of this replica just stored (replacing whatever the
        conversation had scheduled); `computed_tokens`: what the turn computed, `turn_end`: how
        its answer ended."""
        if self._closed:
            return
        entry = ScheduledMove.park(conversation, retention, kv_bytes=kv_bytes, now=self._clock.now(),
                                   reason=MoveReason.IDLE, turn_end=turn_end)  # fmt: skip
        if self._wants_prefetch(entry, prefill_node, expected_think_time_s, computed_tokens):
            entry.kind, entry.reason, entry.target = MoveKind.PREFETCH, MoveReason.THINK_TIME, prefill_node
            self._put(entry)
            return
        park = self._park_entry(entry, pin_expire_at)
        if (
            park is not None
            and park.reason is MoveReason.NEXT_TURN
            and expected_think_time_s is None
            and self._can_prefetch(entry, prefill_node, computed_tokens)
        ):
            park.kind, park.target = MoveKind.PREFETCH, prefill_node  # to where the next turn runs
        if park is None:
            self.forget(conversation)
        else:
            self._put(park)

    def forget(self, conversation: str) -> None:
        entry = self._entries.pop(conversation, None)
        if entry is not None:
            self._dropped(entry)

    def _wants_prefetch(
        self, entry: ScheduledMove, prefill_node: str, think_s: float | None, computed: int
    ) -> bool:
        """A prefetch at commit time, on the client's think-time hint."""
        if think_s is None or not self._can_prefetch(entry, prefill_node, computed):
            return False
        cost = self._costs[entry.model]
        move_s = cost.transfer_ms(entry.num_tokens) / 1e3
        return think_s >= self._parking.prefetch_margin * move_s

    def _can_prefetch(self, entry: ScheduledMove, prefill_node: str, computed: int) -> bool:
        if not self._parking.prefetch_enabled or not prefill_node:
            return False
        if prefill_node == entry.node:  # a kv_both node: its next prefill reads locally already
            return False
        cost = self._costs.get(entry.model)
        return cost is not None and not self._next_turn_extends(entry, cost, computed)

    def _next_turn_extends(self, entry: ScheduledMove, cost: CostModel, computed: int) -> bool:
        """With extend on the holder, a next turn computing as much as this one did would run on
        the decode node holding the KV (its prefill within max_prefill_ms): moving the KV away
        would only make that turn read it back."""
        extend = self._policy.extend
        if not extend.enabled:
            return False
        estimate = cost.extend(entry.num_tokens + max(computed, 1), entry.num_tokens, running=0,
                               interference_weight=0.0)  # fmt: skip
        return estimate.prefill_ms <= extend.max_prefill_ms

    def _park_entry(self, entry: ScheduledMove, pin_expire_at: float) -> ScheduledMove | None:
        """The park schedule of `entry` (None with parking off): idle, or before the pin ends
        when that comes first and the conversation may outlive it."""
        p = self._parking
        if not p.enabled:
            return None
        keep = None
        if self._next_turn is not None:
            keep = self._next_turn.keep_s(entry.conversation, entry.turn_end)
        reason = MoveReason.IDLE if keep is None else MoveReason.NEXT_TURN
        idle_at = entry.active_at + (p.park_after_idle_s if keep is None else keep)
        pin_at = pin_expire_at - p.park_before_pin_s
        lives_past_pin = entry.active_at + p.max_idle_s > pin_expire_at
        if lives_past_pin and pin_at < idle_at:
            return replace(entry, kind=MoveKind.PARK, reason=MoveReason.PIN_ENDING, due_at=pin_at, target="")
        return replace(entry, kind=MoveKind.PARK, reason=reason, due_at=idle_at, target="")

    def _put(self, entry: ScheduledMove) -> None:
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

    def _dropped(self, entry: ScheduledMove) -> None:
        left = self._models.get(entry.model, 0) - 1
        if left > 0:
            self._models[entry.model] = left
        else:
            self._models.pop(entry.model, None)
        self._metrics.scheduled.set(len(self._entries))

    def _take(self, conversation: str) -> ScheduledMove:
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
        kv_cache_usage is above park_kv_usage_above (and which has a pool): oldest first, or lowest
        value per byte first with the next_turn model on."""
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
            and pool_of(nodes, name) is not None
        }
        if not full:
            return []
        limit = self._parking.max_in_flight
        due = [e for e in self._entries.values() if e.kind is MoveKind.PARK and e.node in full]
        if self._next_turn is not None:
            now = self._clock.now()
            # Not learnt: P = 1/2, so by the prefill it saves per byte; equal values stay oldest first.
            due.sort(key=lambda e: self._value_per_byte(e, now))
        return [e.conversation for e in due[:limit]]

    def _value_per_byte(self, entry: ScheduledMove, now: float) -> float:
        assert self._next_turn is not None
        cost = self._costs.get(entry.model)
        saved_ms = cost.prefill_ms(entry.num_tokens, 0) if cost is not None else float(entry.num_tokens)
        return self._next_turn.value_per_byte(
            entry.conversation, entry.turn_end, idle_s=now - entry.active_at, saved_ms=saved_ms,
            kv_bytes=entry.kv_bytes,
        )  # fmt: skip

    def _start(self, entry: ScheduledMove, reason: MoveReason) -> None:
        task = asyncio.create_task(self._move(entry, reason), context=contextvars.Context())
        self._moving.add(task)
        self._moving_for[entry.conversation] = task
        self._metrics.moves_in_flight.set(len(self._moving))

        def done(t: asyncio.Task[Outcome]) -> None:
            self._moving.discard(t)
            if self._moving_for.get(entry.conversation) is t:
                del self._moving_for[entry.conversation]
            self._metrics.moves_in_flight.set(len(self._moving))

        task.add_done_callback(done)

    async def _move(self, entry: ScheduledMove, reason: MoveReason) -> Outcome:
        fields = MoveFields()
        started = time.perf_counter()
        try:
            outcome = await self._runner.attempt(entry, fields)
        except asyncio.CancelledError:
            self._log(entry, reason, Outcome.FAILED_ERROR, fields, time.perf_counter() - started, "cancelled")
            raise
        except Exception:
            log.exception("shuttle.move_crashed", retention=log_name(entry.retention))
            outcome = Outcome.FAILED_ERROR
        seconds = time.perf_counter() - started
        self._count(entry, reason, outcome)
        if fields.pool and outcome not in SKIPPED:
            self._metrics.move_seconds.labels(entry.kind.value).observe(seconds)
        if outcome is Outcome.MOVED:
            self._metrics.moved_bytes.labels(entry.kind.value).inc(fields.bytes)
        self._log(entry, reason, outcome, fields, seconds)
        if entry.kind is MoveKind.PREFETCH and outcome in PARK_INSTEAD:
            self._park_instead(entry)
        return outcome

    def _park_instead(self, entry: ScheduledMove) -> None:
        """A prefetch that did not move: the park schedule, unless a newer commit came."""
        if self._closed or entry.conversation in self._entries:
            return
        # The pin is not known here: the commit's ttl ended it no earlier than the idle park.
        park = self._park_entry(entry, entry.active_at + self._parking.max_idle_s)
        if park is not None:
            self._put(park)

    def _count(self, entry: ScheduledMove, reason: MoveReason, outcome: Outcome) -> None:
        self._metrics.moves.labels(entry.kind.value, reason.value, outcome.value).inc()

    def _log(
        self,
        entry: ScheduledMove,
        reason: MoveReason,
        outcome: Outcome,
        fields: MoveFields,
        seconds: float,
        error: str = "",
    ) -> None:
        line = log.info if outcome is Outcome.MOVED or outcome in SKIPPED else log.warning
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
