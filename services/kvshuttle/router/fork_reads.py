"""Forks that share: the turns of several conversations reading one retention (a history that
forked: subagents started from one context, or retries and edits of one turn), and plans that
wait for a move of the retention they read.

A decode engine frees a retention's blocks at the first read (vLLM's pull scheduler: single
use), so without sharing the first fork consumes the parent's KV and every other recomputes it
(FORK_UNSAFE). An agent's pool keeps its sealed slots across reads. So a fork's plan

* parks the parent's retention first when a decode engine holds it, through this replica's
  shuttle (a move it waits for, then reads where it landed) - when the park and a read from the
  pool still cost less than recomputing the retention's tokens (policy park_for_forks). A
  history the router found by the prompt is parked for policy.found_fork_window_s;
* reads a pool-held retention under a shared claim (the registry's ClaimRetentionRequest.shared),
  naming the pool's read with its own suffix (kvshuttle.vllm.shared_reads), so its read frees
  nothing; the commit or abort ends the claim, and the retention stays for the next fork until
  its lease ends or the pool evicts it.

Children stay isolated: each fork commits into its own conversation.

A move holds the retention's single-use claim while it runs. This replica's own is awaited (its
task); another replica's is seen in the claim's holder (MOVE_HOLDER_PREFIX), and the registry is
read again every MOVE_POLL_S, for at most policy.parking.move_wait_s either way: without the
wait the turn would recompute (CLAIM_LOST) while its KV is in flight.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Final

import structlog

from kvshuttle.core.nodes import NodeRole
from kvshuttle.router.cost import CostModel
from kvshuttle.router.model import NodeInfo, RetentionInfo
from kvshuttle.router.move_runner import MOVE_HOLDER_PREFIX, pool_of
from kvshuttle.router.parts import RouterParts
from kvshuttle.router.plan_issue import PlanCall
from kvshuttle.router.timing import CallTimer

__all__ = ["MOVE_POLL_S", "ForkReads", "moving_elsewhere"]

log = structlog.get_logger("kvshuttle.router")

# How often a plan reads the registry again while another replica moves its retention.
MOVE_POLL_S: Final = 0.05


def moving_elsewhere(retention: RetentionInfo | None) -> bool:
    """Whether a shuttle (any replica's) holds `retention`'s claim to move it."""
    return (
        retention is not None
        and retention.claimed_once
        and retention.claim_holder.startswith(MOVE_HOLDER_PREFIX)
    )


class ForkReads:
    def __init__(self, parts: RouterParts) -> None:
        self._parts = parts

    @property
    def enabled(self) -> bool:
        return self._parts.policy.share_forks

    def shares(self, fork: bool, holder: NodeInfo | None) -> bool:
        """Whether a read of a retention `holder` holds is a shared one: a fork's, from a pool."""
        return self.enabled and fork and holder is not None and holder.role is NodeRole.POOL

    async def readable(
        self, call: PlanCall, retention: RetentionInfo | None, nodes: Sequence[NodeInfo]
    ) -> RetentionInfo | None:
        """The parent's retention as a fork reads it: parked into its holder's pool first when a
        decode engine holds it and that is worth it, after a move of it (any replica's)."""
        parent, timer = call.parent, call.timer
        shuttle = self._parts.shuttle
        if retention is None or not self.enabled:
            return retention
        moving = None
        if shuttle is not None:
            moving = shuttle.move_in_flight(parent)
            holder = None if moving is not None else self._parked_from(retention, nodes, call.cost)
            if holder is not None:
                window = self._parts.policy.found_fork_window_s if call.parent_found else math.inf
                kv_bytes = retention.num_tokens * holder.kv_bytes_per_token
                moving = shuttle.park_for_forks(parent, retention, kv_bytes=kv_bytes, max_ttl_s=window)
        if moving is not None:
            await timer.registry(asyncio.wait({moving}, timeout=self._parts.policy.parking.move_wait_s))
            structlog.contextvars.bind_contextvars(waited_for_move=True)
            _, retention = await timer.registry(self._parts.port.get_conversation(parent))
            return retention
        return await self.after_move_elsewhere(parent, retention, timer)

    async def after_move_elsewhere(
        self, conversation: str, retention: RetentionInfo | None, timer: CallTimer
    ) -> RetentionInfo | None:
        """`retention`, or, while another replica's shuttle moves it, the conversation's retention
        once that move ended (or move_wait_s passed)."""
        if not moving_elsewhere(retention):
            return retention
        structlog.contextvars.bind_contextvars(waited_for_move=True)
        for _ in range(math.ceil(self._parts.policy.parking.move_wait_s / MOVE_POLL_S)):
            await asyncio.sleep(MOVE_POLL_S)
            _, retention = await timer.registry(self._parts.port.get_conversation(conversation))
            if not moving_elsewhere(retention):
                break
        return retention

    def _parked_from(
        self, retention: RetentionInfo, nodes: Sequence[NodeInfo], cost: CostModel
    ) -> NodeInfo | None:
        """The decode engine a fork parks `retention` from before reading it (None: it does
        not): unclaimed there, its agent has a pool, and the park is worth it."""
        if retention.claimed or not self._parts.policy.park_for_forks:
            return None
        by_name = {x.name: x for x in nodes}
        holder = by_name.get(retention.node)
        if (
            holder is None
            or holder.role is NodeRole.POOL
            or pool_of(by_name, holder.name, retention) is None
            or not _worth_parking(retention, cost)
        ):
            return None
        return holder


def _worth_parking(retention: RetentionInfo, cost: CostModel) -> bool:
    """The park (one move of the whole retention) and a read of it from the pool cost less than
    recomputing what it holds: what the first fork saves pays for the park."""
    n = retention.num_tokens
    return cost.transfer_ms(n) + cost.reuse(n, n, 0).total_ms < cost.recompute(n, 0).total_ms
