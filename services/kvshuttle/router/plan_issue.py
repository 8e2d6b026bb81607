"""What one PlanTurn attempt knows (PlanCall, PlanContext), why it decided (Verdict), and the
plan it issues: the signed turn handle (TurnState), the params prefill gets, the counters and
the attributes of the plan's span. The planner (kvshuttle.router.planner) decides; this writes
the decision down."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
from opentelemetry import trace

from kvshuttle.core.digest import log_digest
from kvshuttle.core.endpoints import EndpointSet
from kvshuttle.router.chains import Chain
from kvshuttle.router.cost import CostModel
from kvshuttle.router.finding import router_started
from kvshuttle.router.model import (
    ClaimInfo,
    Decision,
    Estimate,
    NodeInfo,
    Plan,
    PlanRequest,
    Reason,
    RetentionInfo,
)
from kvshuttle.router.parts import RouterParts
from kvshuttle.router.timing import CallTimer
from kvshuttle.router.turns import TurnState
from kvshuttle.router.verify import (
    VerifiedPrefix,
    extend_params,
    first_turn_params,
    prefill_params,
    release_params,
)
from kvshuttle.vllm.shared_reads import shared_read_id

__all__ = ["PlanCall", "PlanContext", "PlanIssuer", "Verdict"]


@dataclass(frozen=True, slots=True)
class PlanCall:
    """One PlanTurn call, its request checked."""

    req: PlanRequest
    cost: CostModel
    tokens: np.ndarray[Any, Any]
    conversation: str  # "" for a request without one
    parent: str  # the conversation this one forks from, or ""
    # The root the prompt's chain starts from: its cache salt's (ROOT_HASH for none).
    root: int
    timer: CallTimer
    span: trace.Span
    # The request's fingerprint (b"" without a request id): a retry of it on another replica
    # makes the same claim, another request with its id does not.
    fingerprint: bytes = b""
    # When the caller stops waiting, on the router's clock (None: never).
    give_up_at: float | None = None
    # The decode endpoints the caller allows (hints.decode_endpoints; None: any).
    decode_allowed: EndpointSet | None = None
    # The conversation was found by the prompt (not named): a retention another turn claimed
    # first makes this turn a fork of it (Planner), rather than a recompute that its sibling's
    # commit would fence.
    fork_on_claim_lost: bool = False
    # `parent` is the conversation the router found by the prompt (not the caller's hint): a
    # park of its retention for the forks keeps it for policy.found_fork_window_s only.
    parent_found: bool = False


@dataclass(frozen=True, slots=True)
class PlanContext:
    """What one attempt at a plan knows when it decides."""

    call: PlanCall
    # The prompt's chain in `block_size` (empty when nothing needed it).
    chain: Chain
    # The prefill nodes' block size, or the retention's where that differs (so that verify()
    # can still tell how much matched: the mismatch is MODEL_MISMATCH).
    block_size: int
    nodes: Sequence[NodeInfo]
    # The conversation's fence generation: this turn is fence + 1.
    fence: int
    # The conversation's live retention, or its parent's for a fork.
    retention: RetentionInfo | None
    fork: bool
    # The retention is this replica's hint, not the registry's answer.
    from_hint: bool
    prefill: NodeInfo
    decode: NodeInfo
    local_hits: int
    recompute_cost: Estimate
    now: float
    # How long prefill's queue is expected to hold this turn before it starts (the placement
    # ledger's view): what running the turn on the holder instead saves.
    prefill_queued_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """Why the turn reuses or recomputes, before any claim."""

    reason: Reason
    prefix: VerifiedPrefix | None = None
    reuse_cost: Estimate | None = None
    # Set only when reuse wins (REUSE_CHEAPER): the retention whose claim confirms it, and its
    # node as the registry lists it (where prefill reads from).
    claim: RetentionInfo | None = None
    holder: NodeInfo | None = None
    # Running the turn on a decode holder, where it was priced (EXTEND_CHEAPER when it won).
    extend_cost: Estimate | None = None
    # The turn recomputes and supersedes the retention it claims (`claim`): prefill reads none
    # of it and notifies `holder`, which frees its blocks (kvshuttle.router.planner).
    release: bool = False
    # A fork reads `claim` from a pool under a shared claim (kvshuttle.router.fork_reads).
    shared: bool = False


class PlanIssuer:
    def __init__(self, parts: RouterParts) -> None:
        self._parts = parts

    def issue(self, ctx: PlanContext, reason: Reason, verdict: Verdict, claim: ClaimInfo | None) -> Plan:
        """The plan and its signed turn handle; counted, and described on the plan's span."""
        call, prefill, decode, chain = ctx.call, ctx.prefill, ctx.decode, ctx.chain
        req, conversation, n = call.req, call.conversation, int(call.tokens.size)
        prefix, reuse_cost = verdict.prefix, verdict.reuse_cost
        reusable = prefix.tokens if claim is not None and prefix is not None else 0
        local_hits = ctx.local_hits
        if claim is None:
            decision, params = Decision.RECOMPUTE, first_turn_params()
        elif verdict.release and verdict.holder is not None:
            decision, params = Decision.RECOMPUTE, release_params(claim.retention, verdict.holder)
            reusable = 0
        elif reason is Reason.EXTEND_CHEAPER and verdict.holder is not None:
            # The whole turn on the holder: its prefix cache serves the verified full blocks.
            decision, params = Decision.EXTEND, extend_params()
            prefill = decode = verdict.holder
            reusable = local_hits = reusable // ctx.block_size * ctx.block_size
        elif prefix is not None and verdict.holder is not None:
            decision, params = Decision.REUSE, prefill_params(claim.retention, prefix, verdict.holder)
            if verdict.shared:  # its own read of the pool's allocation, which frees nothing
                params["remote_request_id"] = shared_read_id(str(params["remote_request_id"]), claim.claim_id)
        else:
            raise AssertionError(f"a claim without a holder ({reason})")
        cached = max(reusable, local_hits)
        span_context = call.span.get_span_context()
        # CommitTurn checks its tokens against the prompt's chain, which is in decode's block
        # size only when the prefill nodes' is decode's too.
        same_blocks = decode.block_size == ctx.block_size
        now = self._parts.clock.now()
        state = TurnState(
            # 128 random bits as 32 hex digits (as uuid4().hex, without building a UUID).
            turn_id=os.urandom(16).hex(),
            conversation=conversation,
            generation=ctx.fence + 1,
            model=req.model,
            block_size=decode.block_size,
            prefill_node=prefill.name,
            decode_node=decode.name,
            decode_engine_id=decode.engine_id,
            prompt_tokens=n,
            prompt_tail_hash=int(chain[-1]) if len(chain) and same_blocks else 0,
            prompt_full_blocks=len(chain) if same_blocks else 0,
            reusable_tokens=reusable,
            local_hit_tokens=local_hits,
            decision=decision.value,
            reason=reason.value,
            claimed=claim.retention.name if claim else "",
            claim_id=claim.claim_id if claim else "",
            issued_at=now,
            expire_at=now + self._parts.policy.turn_ttl_s,
            trace_id=format(span_context.trace_id, "032x"),
            span_id=format(span_context.span_id, "016x"),
            trace_sampled=span_context.trace_flags.sampled,
            chain_root=call.root,
            decode_side_channel_host=decode.side_channel_host,
            decode_side_channel_port=decode.side_channel_port,
            expected_think_time_s=req.expected_think_time_s,
            superseded_parent=bool(
                claim and verdict.shared and call.parent_found and router_started(call.parent)
            ),
        )
        plan = Plan(
            turn=self._parts.codec.encode(state),
            generation=state.generation,
            prefill=prefill,
            decode=decode,
            prefill_kv_transfer_params=params,
            decision=decision,
            reason=reason,
            reusable_tokens=reusable,
            tokens_to_compute=n - cached,
            reuse_cost=reuse_cost,
            recompute_cost=ctx.recompute_cost,
            expire_at=state.expire_at,
            claimed=state.claimed,
            extend_cost=verdict.extend_cost,
            conversation=conversation,
        )
        if conversation:
            self._parts.memory.placed(conversation, prefill.name, decode.name)
        self._parts.memory.hold_prompt(state.turn_id, call.tokens)
        self._account(plan, state)
        self._parts.metrics.decided(decision, reason, reusable, n - cached)
        metrics = self._parts.metrics
        if claim is not None and verdict.holder is not None and not verdict.release:
            metrics.child(metrics.plan_holders, verdict.holder.role.value).inc()
        if verdict.release and claim is not None:
            metrics.released.inc()
            structlog.contextvars.bind_contextvars(released=True)
        if call.span.is_recording():  # the attributes of a span nobody records are not built
            self._describe(ctx, state, verdict, claim, prefill, decode, cached)
        return plan

    def _account(self, plan: Plan, state: TurnState) -> None:
        """The plan's work into the placement ledger: its estimated prefill compute queued on
        the node that runs it, its decode among the node's unreported turns."""
        if plan.decision is Decision.EXTEND and plan.extend_cost is not None:
            prefill_ms = plan.extend_cost.prefill_ms
        elif plan.decision is Decision.REUSE and plan.reuse_cost is not None:
            prefill_ms = plan.reuse_cost.prefill_ms
        else:
            prefill_ms = plan.recompute_cost.prefill_ms
        ledger = self._parts.ledger
        short = prefill_ms < self._parts.policy.weights.long_prefill_ms
        ledger.placed_prefill(plan.prefill.name, prefill_ms, state.turn_id, short=short)
        ledger.placed_decode(state.turn_id, plan.decode.name)

    def _describe(
        self,
        ctx: PlanContext,
        state: TurnState,
        verdict: Verdict,
        claim: ClaimInfo | None,
        prefill: NodeInfo,
        decode: NodeInfo,
        cached: int,
    ) -> None:
        """The plan's attributes on its span."""
        call, conversation, n = ctx.call, ctx.call.conversation, state.prompt_tokens
        req, reuse_cost = call.req, verdict.reuse_cost
        call.span.set_attributes(
            {
                "kvshuttle.tenant": conversation.split("/")[1] if conversation else "",
                "kvshuttle.conversation": log_digest(conversation) if conversation else "",
                "kvshuttle.turn_index": state.generation,
                "kvshuttle.decision": state.decision,
                "kvshuttle.decision.reason": state.reason,
                "kvshuttle.prompt_tokens": n,
                "kvshuttle.reused_tokens": state.reusable_tokens,
                "kvshuttle.recomputed_tokens": n - cached,
                "kvshuttle.local_hit_tokens": state.local_hit_tokens,
                "kvshuttle.cache_salted": bool(req.cache_salt_sha256),
                "kvshuttle.prefill_node": prefill.name,
                "kvshuttle.decode_node": decode.name,
                "kvshuttle.estimate.reuse_ms": reuse_cost.total_ms if reuse_cost else -1.0,
                "kvshuttle.estimate.recompute_ms": ctx.recompute_cost.total_ms,
                "kvshuttle.estimate.extend_ms": verdict.extend_cost.total_ms if verdict.extend_cost else -1.0,
            }
        )
        if req.expected_think_time_s is not None:
            call.span.set_attribute("kvshuttle.expected_think_time_s", req.expected_think_time_s)
        if claim is not None and verdict.holder is not None:
            # Where prefill reads from: a decode engine, or an agent's pool (parked, prefetched).
            call.span.set_attributes(
                {"kvshuttle.holder": verdict.holder.name, "kvshuttle.holder_role": verdict.holder.role.value}
            )
