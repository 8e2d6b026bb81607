"""One move of the shuttle (shuttle.py), once due: the checks, the claim, the agent's read and
the registry's MoveRetention. No grpc here: the registry and the agents are ports.

Read the conversation and the nodes; skip unless the retention is still the one scheduled (same
name and generation), unclaimed, on a live node the router can address (a DECODE or BOTH engine
for a park), and the target's pool node (`pool_node_name`) is live; claim it (single use: nobody
else reads its blocks from now on, which makes freeing the holder's blocks safe); ask the agent
to read it into its pool (`source` = the whole retention addressed to its holder as registered,
`ttl` = max_idle_s minus the time the conversation has been idle); then MoveRetention (claim id,
the pool node, the pooled params, kv bytes, ttl), which re-points the retention in one registry
update. An agent that refused (it read nothing) gets the claim given back (ReleaseRetention with
keep): the retention stays as it was, on its holder, for the next turn. An agent whose answer is
unknown (unavailable, past its deadline) or a move the registry refused leaves the claim to
lapse: the retention is never readable while half moved.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Final

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
from kvshuttle.router.hints import RetentionHints
from kvshuttle.router.model import NodeInfo, RetentionInfo, TurnEnd
from kvshuttle.router.node_directory import NodeDirectory
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.router.ports import AgentPort, RegistryPort
from kvshuttle.router.verify import knows_side_channel, whole_params

__all__ = [
    "MOVE_HOLDER_PREFIX",
    "PARK_INSTEAD",
    "SKIPPED",
    "MoveFields",
    "MoveKind",
    "MoveReason",
    "MoveRunner",
    "Outcome",
    "ScheduledMove",
    "pool_of",
]

log = structlog.get_logger("kvshuttle.router")

# The holder a move's claim names (any replica's shuttle): a plan waits for such a claim to end.
MOVE_HOLDER_PREFIX: Final = "router:shuttle:"


class MoveKind(StrEnum):
    PARK = "park"
    PREFETCH = "prefetch"


class MoveReason(StrEnum):
    IDLE = "idle"
    KV_USAGE = "kv_usage"
    PIN_ENDING = "pin_ending"
    THINK_TIME = "think_time"
    # When the learnt gaps after the turn's end say (kvshuttle.router.next_turn).
    NEXT_TURN = "next_turn"
    # Before forks of the history read it: a decode engine frees its blocks at the first read,
    # a pool's survive reads (kvshuttle.router.fork_reads).
    FORK = "fork"


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
PARK_INSTEAD = frozenset(
    {
        Outcome.SKIPPED_NO_POOL,
        Outcome.SKIPPED_REGISTRY_UNAVAILABLE,
        Outcome.SKIPPED_HOLDER_DOWN,
    }
)


@dataclass(slots=True)
class ScheduledMove:
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
    turn_end: TurnEnd = TurnEnd.UNSPECIFIED  # how the committed answer ended
    # The moved retention's lease at most (a park for the forks of a found history).
    max_ttl_s: float = math.inf

    @classmethod
    def park(
        cls,
        conversation: str,
        retention: RetentionInfo,
        *,
        kv_bytes: int,
        now: float,
        reason: MoveReason,
        turn_end: TurnEnd = TurnEnd.UNSPECIFIED,
        max_ttl_s: float = math.inf,
    ) -> ScheduledMove:
        """A park of `retention`, due now, its conversation active now."""
        return cls(
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
            reason=reason,
            turn_end=turn_end,
            max_ttl_s=max_ttl_s,
        )


@dataclass(slots=True)
class MoveFields:
    """What one move's log line says."""

    holder: str = ""
    pool: str = ""
    ttl_s: float = 0.0
    bytes: int = 0
    error: str = ""


class MoveRunner:
    def __init__(
        self,
        *,
        port: RegistryPort,
        agents: AgentPort,
        clock: Clock,
        nodes: NodeDirectory,
        hints: RetentionHints,
        policy: RouterPolicy,
    ) -> None:
        self._port = port
        self._agents = agents
        self._clock = clock
        self._nodes = nodes
        self._hints = hints
        self._policy = policy
        self._parking = policy.parking

    async def attempt(self, entry: ScheduledMove, fields: MoveFields) -> Outcome:
        """Carry out one due move; `fields` gathers what its log line says."""
        p, now = self._parking, self._clock.now()
        ttl = min(p.max_idle_s - (now - entry.active_at), entry.max_ttl_s)
        fields.ttl_s = ttl
        if ttl < p.min_ttl_s:
            return Outcome.SKIPPED_IDLE_OVER
        try:
            nodes = {x.name: x for x in await self._nodes.nodes(entry.model)}
            # No pool where the move would land: nothing to ask the registry (parking is on by
            # default, and a fleet whose agents have no pool must not pay a read per commit).
            if pool_of(nodes, entry.node if entry.kind is MoveKind.PARK else entry.target) is None:
                return Outcome.SKIPPED_NO_POOL
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
        pool = pool_of(nodes, engine, current)
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
        entry: ScheduledMove,
        current: RetentionInfo,
        holder: NodeInfo,
        pool: NodeInfo,
        ttl: float,
        fields: MoveFields,
    ) -> Outcome:
        attempt = uuid.uuid4().hex
        try:
            claim = await self._port.claim(
                current.name,
                holder=f"{MOVE_HOLDER_PREFIX}{entry.kind.value}",
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

    async def _give_back(self, name: str, claim_id: str, fields: MoveFields) -> None:
        """Give back a claim the move did not read under: the retention stays as it was, for
        the next turn. Best effort: a claim that does not reach the registry lapses on its TTL
        (and the retention with it)."""
        try:
            await self._port.release(name, claim_id=claim_id, keep=True)
        except KvshuttleError as err:
            log.warning("shuttle.release_failed", retention=log_name(name), reason=err.reason)
            fields.error = fields.error or str(err.reason)


SKIPPED = frozenset(o for o in Outcome if o.value.startswith("skipped_"))


def pool_of(
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
