"""The router's domain service: PlanTurn, CommitTurn, AbortTurn. No grpc here.

Anything uncertain plans a recompute: a missing, expired, claimed or mismatched retention, a
dead holder, a prefix that does not verify, a claim lost to another router replica. Wrong KV
is never served; slower is fine.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import structlog
from opentelemetry import trace

from kvshuttle.core.clock import Clock
from kvshuttle.core.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from kvshuttle.core.hashing import TokenIds, token_array
from kvshuttle.core.names import check_id, parse_conversation
from kvshuttle.router.chains import Chain, ChainCache
from kvshuttle.router.cost import CostModel, ModelProfile
from kvshuttle.router.hints import RetentionHints
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.model import (
    ClaimInfo,
    Decision,
    Estimate,
    NodeInfo,
    Plan,
    Reason,
    RetentionInfo,
    Role,
    TurnTimings,
)
from kvshuttle.router.placement import PlacementWeights, choose_decode, choose_prefill
from kvshuttle.router.ports import RegistryPort
from kvshuttle.router.turns import TurnCodec, TurnState
from kvshuttle.router.verify import VerifiedPrefix, block_groups, first_turn_params, prefill_params, verify

log = structlog.get_logger("kvshuttle.router")
_NO_CHAIN: Chain = np.zeros(0, dtype=np.uint64)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RouterPolicy:
    # How long a claim pins a retention for the prefill's read.
    claim_ttl_s: float = 30.0
    # A retention must outlive the read by this much: vLLM's prefill declines a remote read
    # whose deadline is within 5 s (an HTTP 500 without kv_load_failure_policy=recompute).
    claim_headroom_s: float = 6.0
    turn_ttl_s: float = 600.0
    # Decode keeps retained blocks this long (vLLM's decoder_kv_blocks_ttl), counted from
    # decode's answer; kvshuttle's lease ends margin_s earlier.
    decoder_kv_blocks_ttl_s: float = 480.0
    retention_margin_s: float = 30.0
    # The node list in hand is refreshed in the background once it is node_refresh_s old; a
    # plan waits for the registry only when it is node_max_age_s old (or missing).
    node_refresh_s: float = 0.5
    node_max_age_s: float = 5.0
    # A plan waits at most this long for its conversation's commit in flight on this replica.
    commit_wait_s: float = 2.0
    reuse_enabled: bool = True
    max_prompt_tokens: int = 262_144
    max_id_length: int = 128
    chain_cache_bytes: int = 256 * 2**20
    # The retentions this replica's commits stored, for the conversations' next plans.
    retention_hint_bytes: int = 256 * 2**20
    remembered_turns: int = 100_000
    weights: PlacementWeights = field(default_factory=PlacementWeights)


@dataclass(frozen=True, slots=True)
class PlanRequest:
    model: str
    prompt_token_ids: TokenIds
    conversation: str = ""
    request_id: str = ""
    parent_conversation: str = ""
    expected_think_time_s: float | None = None
    disable_reuse: bool = False


@dataclass(frozen=True, slots=True)
class CommitRequest:
    turn: str
    token_ids: TokenIds
    decode_kv_transfer_params: dict[str, Any] | None
    timings: TurnTimings = field(default_factory=TurnTimings)
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class CommitResult:
    retention: str
    expire_at: float | None


def _conversation_digest(conversation: str) -> str:
    return hashlib.sha256(conversation.encode()).hexdigest()[:16]


class _Timer:
    """One call's time split into the router's own and the registry's.

    Own time is reported both as wall time and as this thread's CPU time: while the call awaits
    the registry, the event loop runs other calls, so both clocks subtract those waits. On a
    busy host the wall figure also counts time the process was not scheduled; the CPU figure
    is what the router's work costs.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.start_cpu = time.thread_time()
        self.registry_s = 0.0
        self.registry_cpu_s = 0.0

    async def registry(self, call: Awaitable[T]) -> T:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return await call
        finally:
            self.registry_s += time.perf_counter() - t0
            self.registry_cpu_s += time.thread_time() - c0

    def own_s(self) -> float:
        return time.perf_counter() - self.start - self.registry_s

    def own_cpu_s(self) -> float:
        return time.thread_time() - self.start_cpu - self.registry_cpu_s

    def log_fields(self) -> dict[str, float]:
        return {
            "own_ms": round(self.own_s() * 1e3, 3),
            "own_cpu_ms": round(self.own_cpu_s() * 1e3, 3),
            "registry_ms": round(self.registry_s * 1e3, 3),
        }


class Router:
    def __init__(
        self,
        port: RegistryPort,
        clock: Clock,
        profiles: Sequence[ModelProfile],
        codec: TurnCodec,
        policy: RouterPolicy | None = None,
        metrics: RouterMetrics | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        # The process's global provider unless one is passed in (tests pass their own: OTel
        # lets the global be set only once per process).
        self._tracer = trace.get_tracer("kvshuttle.router", tracer_provider=tracer_provider)
        self._port = port
        self._clock = clock
        self._costs = {p.model: CostModel(p) for p in profiles}
        self._codec = codec
        self.policy = policy or RouterPolicy()
        self._metrics = metrics or RouterMetrics()
        self.chains = ChainCache(self.policy.chain_cache_bytes)
        self.hints = RetentionHints(self.policy.retention_hint_bytes)
        self._nodes_cache: dict[str, tuple[float, list[NodeInfo]]] = {}
        self._node_refreshes: dict[str, asyncio.Task[None]] = {}
        # Conversation -> its commit being stored here: the next turn's plan waits for it.
        self._storing: dict[str, asyncio.Future[None]] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._commits: OrderedDict[str, CommitResult] = OrderedDict()
        self._plans: OrderedDict[str, Plan] = OrderedDict()
        self._sticky: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def cost_model(self, model: str) -> CostModel:
        return self._costs[model]

    # ---- shared ----------------------------------------------------------------------------

    async def _nodes(self, model: str) -> list[NodeInfo]:
        """Live nodes serving `model`: the list in hand unless it is node_max_age_s old, and
        refreshed in the background past node_refresh_s, so a plan rarely waits for ListNodes."""
        cached = self._nodes_cache.get(model)
        age = math.inf if cached is None else time.monotonic() - cached[0]
        if cached is None or age >= self.policy.node_max_age_s:
            return await self._read_nodes(model)
        if age >= self.policy.node_refresh_s and model not in self._node_refreshes:
            # In a context of its own: not a part of the plan that happened to start it.
            task = asyncio.create_task(self._refresh_nodes(model), context=contextvars.Context())
            self._node_refreshes[model] = task
            task.add_done_callback(lambda _: self._node_refreshes.pop(model, None))
        return cached[1]

    async def _read_nodes(self, model: str) -> list[NodeInfo]:
        read_at = time.monotonic()
        nodes = await self._port.list_nodes(model)
        self._nodes_cache[model] = (read_at, nodes)
        return nodes

    async def _refresh_nodes(self, model: str) -> None:
        try:
            await self._read_nodes(model)
        except Exception as exc:  # the next plan retries; past node_max_age_s it reads itself
            log.warning("router.nodes_refresh_failed", model=model, error=repr(exc)[:300])

    def _remember(self, table: OrderedDict[str, T], key: str, value: T) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.policy.remembered_turns:
            table.popitem(last=False)

    def _tokens(self, tokens: TokenIds, field_name: str) -> np.ndarray[Any, Any]:
        try:
            arr = token_array(tokens)
        except ValueError as exc:
            raise InvalidArgument(field_name, str(exc)) from exc
        if arr.size == 0:
            raise InvalidArgument(field_name, "required")
        if arr.size > self.policy.max_prompt_tokens:
            raise InvalidArgument(field_name, f"more than {self.policy.max_prompt_tokens} tokens")
        return arr

    def _profile(self, model: str) -> CostModel:
        if not model:
            raise InvalidArgument("model", "required")
        cost = self._costs.get(model)
        if cost is None:
            raise InvalidArgument("model", f"no model profile for {model[:200]!r}")
        return cost

    # ---- PlanTurn --------------------------------------------------------------------------

    async def plan_turn(self, req: PlanRequest) -> Plan:
        timer = _Timer()
        # Scoped by conversation: a request id is the caller's, unique only within its own turns.
        plan_key = f"{req.conversation}|{req.model}|{req.request_id}"
        if req.request_id:
            check_id(req.request_id, "request_id", max_length=self.policy.max_id_length)
            earlier = self._plans.get(plan_key)
            if earlier is not None:
                return earlier
        cost = self._profile(req.model)
        tokens = self._tokens(req.prompt_token_ids, "prompt_token_ids")
        conversation = (
            str(parse_conversation(req.conversation, "conversation", max_length=self.policy.max_id_length))
            if req.conversation
            else ""
        )
        parent = ""
        if req.parent_conversation:
            parsed = parse_conversation(
                req.parent_conversation, "hints.parent_conversation", max_length=self.policy.max_id_length
            )
            if not conversation:
                raise InvalidArgument("hints.parent_conversation", "needs a conversation")
            if parsed.tenant != parse_conversation(conversation).tenant:
                raise InvalidArgument("hints.parent_conversation", "must be in the conversation's tenant")
            parent = str(parsed)
        think = req.expected_think_time_s
        if think is not None and (not math.isfinite(think) or think < 0):
            raise InvalidArgument("hints.expected_think_time", "must not be negative")

        with self._tracer.start_as_current_span("plan") as span:
            plan = await self._plan(req, cost, tokens, conversation, parent, timer, span)
        if req.request_id:
            self._remember(self._plans, plan_key, plan)

        self._metrics.plan_seconds.observe(time.perf_counter() - timer.start)
        self._metrics.own_seconds.labels("PlanTurn").observe(timer.own_cpu_s())
        structlog.contextvars.bind_contextvars(
            decision=plan.decision.value,
            reason=plan.reason.value,
            reusable_tokens=plan.reusable_tokens,
            prompt_tokens=int(tokens.size),
            **timer.log_fields(),
        )
        return plan

    async def _plan(
        self,
        req: PlanRequest,
        cost: CostModel,
        tokens: np.ndarray[Any, Any],
        conversation: str,
        parent: str,
        timer: _Timer,
        span: trace.Span,
        *,
        use_hint: bool = True,
    ) -> Plan:
        n = int(tokens.size)
        storing = self._storing.get(conversation) if conversation else None
        if storing is not None:
            # The previous turn's commit is being stored here (it came through another gateway,
            # or this one did not wait): what this turn may read is what it stores.
            await timer.registry(asyncio.wait({storing}, timeout=self.policy.commit_wait_s))
        nodes = await timer.registry(self._nodes(req.model))  # cached: usually no round trip
        prefill_pool = [x for x in nodes if x.healthy and x.role.serves(Role.PREFILL)]
        block_size = prefill_pool[0].block_size if prefill_pool else 16
        # Prefill's own prefix-cache hits, asked only when a candidate has indexed blocks at all
        # (none do when prefill runs without prefix caching). The conversation's retention, from
        # this replica's hint or the registry, in the same round trip. A plain request with
        # nothing to look up needs no chain.
        indexed = any(x.indexed_blocks for x in prefill_pool)
        chain = self.chains.chain(conversation, tokens, block_size) if conversation or indexed else _NO_CHAIN
        hint = self._hint(req, conversation, block_size) if use_hint else None
        hits, (fence, retention) = await self._registry_reads(
            chain if len(chain) and indexed else None,
            conversation if conversation and hint is None else "",
            req.model,
            timer,
        )
        if hint is not None:
            fence, retention = hint.generation, hint
        fork = False
        if retention is None and parent:
            _, retention = await timer.registry(self._port.get_conversation(parent))
            fork = retention is not None
        if retention is not None and retention.block_size != block_size:
            # KV of another block size cannot be read by this prefill (MODEL_MISMATCH below);
            # the chain in its block size still lets verify() say so precisely.
            block_size = retention.block_size
            chain = self.chains.chain(conversation, tokens, block_size, remember=False)
        hits = {
            name: blocks
            for name, blocks in hits.items()
            if any(x.name == name and x.block_size == block_size for x in nodes)
        }
        hint_p, hint_d = self._sticky.get(conversation, ("", "")) if conversation else ("", "")
        prefill, local_hits = choose_prefill(
            nodes,
            model=req.model,
            prompt_tokens=n,
            local_hit_blocks=hits,
            cost=cost,
            weights=self.policy.weights,
            hint=hint_p,
        )
        decode = choose_decode(
            nodes, model=req.model, weights=self.policy.weights, avoid=prefill.name, hint=hint_d
        )
        recompute_cost = cost.recompute(n, local_hits)

        reason, prefix, reuse_cost, claim = await self._decide(
            req,
            cost,
            conversation,
            retention,
            fork,
            chain,
            n,
            block_size,
            nodes,
            prefill,
            local_hits,
            recompute_cost,
            timer,
        )
        if hint is not None:
            self.hints.forget(conversation)  # claimed (consumed), or not confirmed
            span.set_attribute("kvshuttle.retention_hint", "confirmed" if claim else "refused")
            if claim is None:
                return await self._plan(req, cost, tokens, conversation, parent, timer, span, use_hint=False)
        reusable = prefix.tokens if claim is not None and prefix is not None else 0

        turn_id = uuid.uuid4().hex
        now = self._clock.now()
        decision = Decision.REUSE if claim is not None else Decision.RECOMPUTE
        if claim is not None and prefix is not None:
            params = prefill_params(claim.retention, prefix)
        else:
            params = first_turn_params()
        cached = max(reusable, local_hits)
        ctx = span.get_span_context()
        full_blocks = len(chain)
        state = TurnState(
            turn_id=turn_id,
            conversation=conversation,
            generation=fence + 1,
            model=req.model,
            block_size=decode.block_size,
            prefill_node=prefill.name,
            decode_node=decode.name,
            decode_engine_id=decode.engine_id,
            prompt_tokens=n,
            prompt_tail_hash=int(chain[-1]) if len(chain) and decode.block_size == block_size else 0,
            prompt_full_blocks=full_blocks if decode.block_size == block_size else 0,
            reusable_tokens=reusable,
            local_hit_tokens=local_hits,
            decision=decision.value,
            reason=reason.value,
            claimed=claim.retention.name if claim else "",
            claim_id=claim.claim_id if claim else "",
            issued_at=now,
            expire_at=now + self.policy.turn_ttl_s,
            trace_id=format(ctx.trace_id, "032x"),
            span_id=format(ctx.span_id, "016x"),
        )
        plan = Plan(
            turn=self._codec.encode(state),
            generation=state.generation,
            prefill=prefill,
            decode=decode,
            prefill_kv_transfer_params=params,
            decision=decision,
            reason=reason,
            reusable_tokens=reusable,
            tokens_to_compute=n - cached,
            reuse_cost=reuse_cost,
            recompute_cost=recompute_cost,
            expire_at=state.expire_at,
            claimed=state.claimed,
        )
        if conversation:
            self._remember(self._sticky, conversation, (prefill.name, decode.name))
        self._metrics.decided(decision, reason, reusable, n - cached)
        span.set_attributes(
            {
                "kvshuttle.tenant": conversation.split("/")[1] if conversation else "",
                "kvshuttle.conversation": _conversation_digest(conversation) if conversation else "",
                "kvshuttle.turn_index": state.generation,
                "kvshuttle.decision": decision.value,
                "kvshuttle.decision.reason": reason.value,
                "kvshuttle.prompt_tokens": n,
                "kvshuttle.reused_tokens": reusable,
                "kvshuttle.recomputed_tokens": n - cached,
                "kvshuttle.local_hit_tokens": local_hits,
                "kvshuttle.prefill_node": prefill.name,
                "kvshuttle.decode_node": decode.name,
                "kvshuttle.estimate.reuse_ms": reuse_cost.total_ms if reuse_cost else -1.0,
                "kvshuttle.estimate.recompute_ms": recompute_cost.total_ms,
            }
        )
        if req.expected_think_time_s is not None:
            span.set_attribute("kvshuttle.expected_think_time_s", req.expected_think_time_s)
        return plan

    async def _registry_reads(
        self, chain: Chain | None, conversation: str, model: str, timer: _Timer
    ) -> tuple[dict[str, int], tuple[int, RetentionInfo | None]]:
        """Prefill's local hits on `chain` and the conversation's retention: the reads asked
        for (None, "": not asked), both in one round trip."""
        lookup = None if chain is None else self._port.lookup_blocks(chain, model, Role.PREFILL)
        current = self._port.get_conversation(conversation) if conversation else None
        if lookup is not None and current is not None:
            return await timer.registry(asyncio.gather(lookup, current))
        if lookup is not None:
            return await timer.registry(lookup), (0, None)
        if current is not None:
            return {}, await timer.registry(current)
        return {}, (0, None)

    def _hint(self, req: PlanRequest, conversation: str, block_size: int) -> RetentionInfo | None:
        """The retention this replica last stored for the conversation, when reuse is on."""
        if not conversation or not self.policy.reuse_enabled or req.disable_reuse:
            return None
        hint = self.hints.get(conversation)
        return hint if hint is not None and hint.block_size == block_size else None

    async def _decide(
        self,
        req: PlanRequest,
        cost: CostModel,
        conversation: str,
        retention: RetentionInfo | None,
        fork: bool,
        chain: Chain,
        n: int,
        block_size: int,
        nodes: Sequence[NodeInfo],
        prefill: NodeInfo,
        local_hits: int,
        recompute_cost: Estimate,
        timer: _Timer,
    ) -> tuple[Reason, VerifiedPrefix | None, Estimate | None, ClaimInfo | None]:
        """Why this turn reuses or recomputes; claims the retention when reuse wins."""
        if not conversation:
            return Reason.NO_CONVERSATION, None, None, None
        if not self.policy.reuse_enabled or req.disable_reuse:
            return Reason.DISABLED, None, None, None
        if retention is None:
            return Reason.NO_RETENTION, None, None, None
        prefix = verify(chain, n, retention) if retention.block_size == block_size else None
        reuse_cost = (
            cost.reuse(n, prefix.tokens, local_hits) if prefix is not None and prefix.blocks else None
        )
        live = {x.name for x in nodes if x.healthy}
        reason: Reason | None = None
        if retention.claimed:
            reason = Reason.FORK_UNSAFE if fork else Reason.CLAIM_LOST
        elif retention.model != req.model or prefix is None or prefill.block_size != retention.block_size:
            reason = Reason.MODEL_MISMATCH
        elif retention.node not in live:
            reason = Reason.NODE_DOWN
        elif retention.expire_at - self._clock.now() < self.policy.claim_headroom_s + (
            reuse_cost.transfer_ms / 1e3 if reuse_cost else 0.0
        ):
            reason = Reason.EXPIRED
        elif prefix.blocks == 0:
            reason = Reason.PREFIX_MISMATCH
        elif prefix.tokens - local_hits < cost.profile.min_reuse_tokens:
            reason = Reason.BELOW_THRESHOLD
        elif reuse_cost is None or reuse_cost.total_ms >= recompute_cost.total_ms:
            reason = Reason.COST
        if reason is not None:
            return reason, prefix, reuse_cost, None
        claim, reason = await self._claim(retention, req, fork, timer)
        return reason, prefix, reuse_cost, claim

    async def _claim(
        self, retention: RetentionInfo, req: PlanRequest, fork: bool, timer: _Timer
    ) -> tuple[ClaimInfo | None, Reason]:
        # The registry scopes claim ids by retention; a digest keeps the id within its bounds.
        request_id = (
            hashlib.sha256(f"claim|{req.request_id}".encode()).hexdigest()[:32] if req.request_id else ""
        )
        with self._tracer.start_as_current_span("claim") as span:
            span.set_attribute("kvshuttle.retention.generation", retention.generation)
            try:
                claim = await timer.registry(
                    self._port.claim(
                        retention.name,
                        holder=f"router:{req.request_id or 'plan'}",
                        claim_ttl=self.policy.claim_ttl_s,
                        request_id=request_id,
                    )
                )
            except Aborted:
                span.set_attribute("kvshuttle.claim", "lost")
                return None, Reason.FORK_UNSAFE if fork else Reason.CLAIM_LOST
            except (FailedPrecondition, NotFound) as err:
                span.set_attribute("kvshuttle.claim", err.reason)
                return None, Reason.EXPIRED
            span.set_attribute("kvshuttle.claim", "won")
            return claim, Reason.REUSE_CHEAPER

    # ---- CommitTurn ------------------------------------------------------------------------

    def _turn(self, handle: str) -> TurnState:
        state = self._codec.decode(handle)
        if state.turn_id in self._finished:
            raise FailedPrecondition(f"turn already {self._finished[state.turn_id]}", reason="TURN_FINISHED")
        if self._clock.now() >= state.expire_at:
            raise FailedPrecondition("turn expired; its claim is gone", reason="TURN_EXPIRED")
        return state

    @staticmethod
    def _check_timings(timings: TurnTimings) -> None:
        for name in (
            "ttft_ms",
            "prefill_ms",
            "transfer_ms",
            "decode_ms",
            "transfer_bytes",
            "remote_cached_tokens",
        ):
            value = getattr(timings, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                field_name = name.removesuffix("_ms") if name.endswith("_ms") else name
                raise InvalidArgument(f"timings.{field_name}", "must not be negative")

    async def commit_turn(self, req: CommitRequest) -> CommitResult:
        timer = _Timer()
        if req.request_id:
            check_id(req.request_id, "request_id", max_length=self.policy.max_id_length)
            state = self._codec.decode(req.turn)
            earlier = self._commits.get(f"{state.turn_id}|{req.request_id}")
            if earlier is not None:  # a retry whose first answer was lost
                return earlier
        state = self._turn(req.turn)
        tokens = self._tokens(req.token_ids, "token_ids")
        self._check_timings(req.timings)
        if tokens.size < state.prompt_tokens:
            raise InvalidArgument("token_ids", "shorter than the planned prompt")
        params = req.decode_kv_transfer_params
        retains = bool(params and params.get("do_remote_decode") and block_groups(params)[0])
        if retains and params is not None and params.get("remote_engine_id") != state.decode_engine_id:
            raise InvalidArgument(
                "decode_kv_transfer_params.remote_engine_id",
                "names another engine than the planned decode node",
            )
        with self._tracer.start_as_current_span("commit", context=self._trace_parent(state)) as span:
            chain: Chain = _NO_CHAIN
            if state.conversation and state.prompt_full_blocks:
                chain = self.chains.chain(state.conversation, tokens, state.block_size)
                if (
                    len(chain) < state.prompt_full_blocks
                    or chain[state.prompt_full_blocks - 1] != state.prompt_tail_hash
                ):
                    raise InvalidArgument("token_ids", "does not start with the planned prompt")
            # Read or not, a claimed retention is consumed: prefill notified its holder. Released
            # while the new one is stored (the two are independent: a put replaces whatever the
            # conversation holds), so the commit waits for one round trip, not two.
            release = (
                asyncio.ensure_future(self._port.release(state.claimed, claim_id=state.claim_id))
                if state.claimed
                else None
            )
            storing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if state.conversation:
                self._storing[state.conversation] = storing
            try:
                result = await self._store(state, tokens, chain, params if retains else None, timer)
            finally:
                storing.set_result(None)
                if self._storing.get(state.conversation) is storing:
                    del self._storing[state.conversation]
                if release is not None:
                    await timer.registry(release)
            self._observe(state, req.timings)
            self._remember(self._finished, state.turn_id, "committed")
            if req.request_id:
                self._remember(self._commits, f"{state.turn_id}|{req.request_id}", result)
            self._metrics.commits.labels("stored" if result.retention else "nothing_retained").inc()
            t = req.timings
            span.set_attributes(
                {
                    "kvshuttle.turn_index": state.generation,
                    "kvshuttle.decision": state.decision,
                    "kvshuttle.decision.reason": state.reason,
                    "kvshuttle.reused_tokens": state.reusable_tokens,
                    "kvshuttle.recomputed_tokens": state.prompt_tokens
                    - max(state.reusable_tokens, state.local_hit_tokens),
                    "kvshuttle.retention": result.retention,
                    **({"kvshuttle.ttft.ms": t.ttft_ms} if t.ttft_ms is not None else {}),
                    **({"kvshuttle.transfer.ms": t.transfer_ms} if t.transfer_ms is not None else {}),
                    **(
                        {"kvshuttle.transfer.bytes": t.transfer_bytes} if t.transfer_bytes is not None else {}
                    ),
                }
            )
        self._metrics.own_seconds.labels("CommitTurn").observe(timer.own_cpu_s())
        structlog.contextvars.bind_contextvars(retention=result.retention, **timer.log_fields())
        return result

    @staticmethod
    def _trace_parent(state: TurnState) -> Any:
        """The plan's trace, when the caller did not send one: a turn stays one trace."""
        current = trace.get_current_span().get_span_context()
        if current.is_valid and format(current.trace_id, "032x") == state.trace_id:
            return None
        try:
            ctx = trace.SpanContext(
                int(state.trace_id, 16),
                int(state.span_id, 16),
                is_remote=True,
                trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
            )
        except ValueError:
            return None
        return trace.set_span_in_context(trace.NonRecordingSpan(ctx)) if ctx.is_valid else None

    async def _store(
        self,
        state: TurnState,
        tokens: np.ndarray[Any, Any],
        chain: Chain,
        params: dict[str, Any] | None,
        timer: _Timer,
    ) -> CommitResult:
        if not state.conversation or params is None:
            return CommitResult("", None)
        bs = state.block_size
        if not len(chain):
            chain = self.chains.chain(state.conversation, tokens, bs)
        num_tokens = int(tokens.size)
        if isinstance(params.get("remote_num_tokens"), int):
            num_tokens = min(num_tokens, int(params["remote_num_tokens"]))
        num_tokens = min(num_tokens, len(block_groups(params)[0]) * bs)
        if num_tokens <= 0:
            return CommitResult("", None)
        nodes = {x.name: x for x in await timer.registry(self._nodes(state.model))}
        node = nodes.get(state.decode_node)
        if node is None:
            log.warning("commit.decode_node_gone", node=state.decode_node)
            return CommitResult("", None)
        now = self._clock.now()
        pin = now + self.policy.decoder_kv_blocks_ttl_s - self.policy.retention_margin_s
        try:
            stored = await timer.registry(
                self._port.put_retention(
                    request_id=f"{state.turn_id}-commit",
                    conversation=state.conversation,
                    node=node.name,
                    generation=state.generation,
                    model=state.model,
                    block_size=bs,
                    num_tokens=num_tokens,
                    block_hashes=chain[: num_tokens // bs],
                    kv_transfer_params=params,
                    kv_bytes=num_tokens * node.kv_bytes_per_token,
                    ttl=pin - now,
                    pin_expire_at=pin,
                )
            )
        except Aborted as err:
            raise FailedPrecondition(
                "a turn of this generation or later was already committed", reason="TURN_FINISHED"
            ) from err
        except (FailedPrecondition, NotFound) as err:
            log.warning("commit.not_stored", reason=err.reason, node=node.name)
            return CommitResult("", None)
        self.hints.put(state.conversation, stored)
        return CommitResult(stored.name, stored.expire_at)

    def _observe(self, state: TurnState, t: TurnTimings) -> None:
        cost = self._costs.get(state.model)
        if cost is None or t.prefill_ms is None:
            return
        reused = state.reusable_tokens
        if state.decision == Decision.REUSE.value and t.remote_cached_tokens == 0:
            reused = 0  # prefill read nothing after all: it recomputed
        if reused and t.transfer_ms is not None and t.transfer_bytes:
            cost.observe_transfer(nbytes=t.transfer_bytes, measured_ms=t.transfer_ms)
        cached = max(reused, state.local_hit_tokens)
        read = max(reused - state.local_hit_tokens, 0)
        transfer = t.transfer_ms if t.transfer_ms is not None else (cost.transfer_ms(read) if read else 0.0)
        cost.observe_prefill(
            computed=state.prompt_tokens - cached, cached=cached, measured_ms=t.prefill_ms - transfer
        )

    # ---- AbortTurn -------------------------------------------------------------------------

    async def abort_turn(self, handle: str, reason: str) -> None:
        timer = _Timer()
        if len(reason) > 1024:
            raise InvalidArgument("reason", "longer than 1024 characters")
        state = self._codec.decode(handle)
        if state.turn_id in self._finished:
            raise FailedPrecondition(f"turn already {self._finished[state.turn_id]}", reason="TURN_FINISHED")
        if state.conversation:
            fence, _ = await timer.registry(self._port.get_conversation(state.conversation))
            if fence >= state.generation:
                raise FailedPrecondition("turn already committed", reason="TURN_FINISHED")
        if state.claimed:
            await timer.registry(self._port.release(state.claimed, claim_id=state.claim_id))
        self._remember(self._finished, state.turn_id, "aborted")
        log.info("turn.aborted", reason=reason[:200], claimed=state.claimed)
        self._metrics.own_seconds.labels("AbortTurn").observe(timer.own_cpu_s())


__all__ = ["CommitRequest", "CommitResult", "PlanRequest", "Router", "RouterPolicy"]
