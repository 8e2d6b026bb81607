"""PlanTurn: where a turn's prefill and decode run, and whether prefill reads the
conversation's retained KV or recomputes the prompt.

A plan reads what it needs (the nodes; the conversation's retention, from this replica's hint or
the registry; prefill's local prefix hits), verifies the prompt against the retention, prices
reuse against recompute, and claims the retention when reuse wins. Anything uncertain plans a
recompute: a missing, expired, claimed or mismatched retention, a dead holder, a prefix that does
not verify, a claim lost to another router replica. Wrong KV is never served; slower is fine.

A hint is only confirmed by its claim: when a plan made on a hint claims nothing, it is made
again, once, on what the registry says.

A plan its caller will never receive claims nothing (kvshuttle.router.claiming).

A registry that does not answer (Unavailable, REGISTRY_UNAVAILABLE: unreachable or past its
deadline) degrades the plan, never fails it: plain P->D on the last node list it gave (no
retention read, no local hits, nothing claimed), decision RECOMPUTE, reason
REGISTRY_UNAVAILABLE, while that list is younger than `degraded_nodes_max_age_s`; older, the
error goes to the caller. The turn's generation is then this replica's best guess (the
conversation's hint's, else the first): its commit is fenced by the registry all the same.

One module for one RPC's path, from the reads through the decision; kvshuttle.router.plan_issue
writes the decided plan down (its signed handle, params, counters and span).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace

import structlog

from kvshuttle.core.errors import Unavailable
from kvshuttle.core.limits import MAX_BLOCK_HASHES
from kvshuttle.core.names import check_id
from kvshuttle.core.nodes import NodeRole
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.router import checks
from kvshuttle.router.chains import NO_CHAIN, Chain
from kvshuttle.router.claiming import Claimer
from kvshuttle.router.cost import price_extend
from kvshuttle.router.finding import ConversationFinder, new_conversation
from kvshuttle.router.fork_reads import ForkReads
from kvshuttle.router.model import (
    ClaimInfo,
    NodeInfo,
    Plan,
    PlanRequest,
    Reason,
    RetentionInfo,
)
from kvshuttle.router.parts import RouterParts
from kvshuttle.router.placement import candidates, choose_decode, choose_prefill, placeable, pool_owner_of
from kvshuttle.router.plan_issue import PlanCall, PlanContext, PlanIssuer, Verdict
from kvshuttle.router.timing import CallTimer
from kvshuttle.router.turn_memory import plan_fingerprint
from kvshuttle.router.verify import (
    knows_side_channel,
    verify,
)

log = structlog.get_logger("kvshuttle.router")


class _Sibling(Exception):
    """A plan of a found conversation lost its retention's claim to another turn."""


# A turn that recomputes for these reasons supersedes its conversation's retention: this turn's
# commit replaces it in the registry, and nothing will read it again. Left alone, its blocks stay
# pinned on the holder until the engine's own TTL (decoder_kv_blocks_ttl, minutes of HBM). The
# plan claims it and hands prefill release params instead (kvshuttle.router.verify's
# release_params): vLLM's prefill reads nothing and notifies the holder, which frees them.
_SUPERSEDED = frozenset({Reason.COST, Reason.BELOW_THRESHOLD, Reason.PREFIX_MISMATCH})


class Planner:
    def __init__(self, parts: RouterParts) -> None:
        self._parts = parts
        self._issuer = PlanIssuer(parts)
        self._claimer = Claimer(parts)
        self._finder = ConversationFinder(parts)
        self._forks = ForkReads(parts)

    async def plan_turn(self, req: PlanRequest) -> Plan:
        timer = CallTimer()
        policy = self._parts.policy
        if req.request_id:
            check_id(req.request_id, "request_id", max_length=policy.max_id_length)
        cost = checks.cost_model(self._parts.costs, req.model)
        tokens = checks.token_ids(
            req.prompt_token_ids, "prompt_token_ids", max_tokens=policy.max_prompt_tokens
        )
        conversation, parent = checks.conversations(
            req.conversation, req.parent_conversation, max_id_length=policy.max_id_length
        )
        tenant = checks.tenant(req.tenant, conversation, max_id_length=policy.max_id_length)
        checks.think_time(req.expected_think_time_s)
        root = checks.chain_root(req.cache_salt_sha256)
        decode_allowed = checks.decode_endpoints(req.decode_endpoints)
        fingerprint = b""
        # Scoped by the conversation, else by the tenant: ids are the caller's, per tenant.
        scope = req.conversation or req.tenant
        if req.request_id:
            # A retry whose answer was lost gets the first plan; another request reusing the id
            # is refused (REQUEST_ID_REUSED), never handed the first one's plan.
            fingerprint = plan_fingerprint(req, tokens)
            earlier = self._parts.memory.earlier_plan(scope, req.model, req.request_id, fingerprint)
            if earlier is not None:
                return earlier
        found = ""  # the conversation the prompt continues, when the router found it
        if not conversation and tenant:
            conversation, parent, found = await self._finder.conversation_of(
                req, tenant, tokens, root, timer, reuse=self._reuse_allowed(req)
            )
        if conversation and self._parts.shuttle is not None:
            self._parts.shuttle.turn_arrived(conversation)  # the gap since its last commit here

        give_up_at = None if req.deadline_s is None else self._parts.clock.now() + req.deadline_s
        with self._parts.tracer.start_as_current_span("plan") as span:
            call = PlanCall(req, cost, tokens, conversation, parent, root, timer, span,
                            fingerprint=fingerprint, give_up_at=give_up_at, decode_allowed=decode_allowed,
                            fork_on_claim_lost=bool(found),
                            parent_found=bool(parent) and not req.parent_conversation)  # fmt: skip
            try:
                plan = await self._plan(call)
            except _Sibling:
                # Another turn continuing the same history (a sibling of a fork) holds its
                # retention: this one becomes a conversation of its own, forked from it, so
                # that neither fences the other's commit.
                forked = replace(
                    call, conversation=new_conversation(tenant), parent=found, fork_on_claim_lost=False
                )
                plan = await self._plan(forked)
                parent = found
        if tenant and not req.conversation:
            outcome = "forked" if parent else "continued" if found else "new"
            self._parts.metrics.child(self._parts.metrics.conversations_found, outcome).inc()
            structlog.contextvars.bind_contextvars(conversation_found=outcome)
        if req.request_id:
            self._parts.memory.remember_plan(scope, req.model, req.request_id, fingerprint, plan)

        own = timer.log_fields()  # read once: the metric and the log line agree
        self._parts.metrics.plan_seconds.observe(timer.elapsed_s())
        self._parts.metrics.own_plan.observe(own["own_cpu_ms"] / 1e3)
        structlog.contextvars.bind_contextvars(
            decision=plan.decision.value,
            reason=plan.reason.value,
            reusable_tokens=plan.reusable_tokens,
            prompt_tokens=int(tokens.size),
            **own,
        )
        return plan

    async def _plan(self, call: PlanCall) -> Plan:
        use_hint = True
        while True:
            try:
                ctx = await self._context(call, use_hint=use_hint)
            except Unavailable as err:
                if err.reason != ErrorReason.REGISTRY_UNAVAILABLE:
                    raise
                return self._degraded(self._last_known_context(call, err), err)
            if use_hint and not ctx.from_hint and call.conversation and self._reuse_allowed(call.req):
                self._hint_outcome("miss")
            decided = self._decide(ctx)
            verdict = await self._holder_serving(ctx, decided)
            reason, claim = verdict.reason, None
            if verdict.claim is not None:
                try:
                    claim, reason = await self._claimer.claim(ctx, verdict.claim, shared=verdict.shared)
                    if verdict.release:
                        # A release lost (another turn claimed it) only leaves the retention be.
                        reason = verdict.reason
                    if claim is not None:
                        verdict, claim, reason = await self._where_claimed(ctx, verdict, claim)
                except Unavailable as err:
                    if err.reason != ErrorReason.REGISTRY_UNAVAILABLE:
                        raise
                    # The claim may have landed: the retention is then consumed when it lapses.
                    if ctx.from_hint:
                        self._parts.memory.hints.forget(call.conversation)
                    return self._degraded(ctx, err)
            if ctx.from_hint:
                self._parts.memory.hints.forget(call.conversation)  # claimed (consumed), or not confirmed
                call.span.set_attribute("kvshuttle.retention_hint", "confirmed" if claim else "refused")
                self._hint_outcome("hit" if claim else "refused")
                # Unconfirmed: plan again on the registry's word, unless the holder the hint
                # named was just found dead (asking it twice would only wait twice).
                if claim is None and verdict is decided:
                    use_hint = False
                    continue
            if call.fork_on_claim_lost and claim is None and reason is Reason.CLAIM_LOST:
                raise _Sibling
            return self._issuer.issue(ctx, reason, verdict, claim)

    def _hint_outcome(self, outcome: str) -> None:
        """Counted, and on the plan's log line (`retention_hint`)."""
        metrics = self._parts.metrics
        metrics.child(metrics.retention_hints, outcome).inc()
        structlog.contextvars.bind_contextvars(retention_hint=outcome)

    async def _context(self, call: PlanCall, *, use_hint: bool) -> PlanContext:
        req, conversation, timer = call.req, call.conversation, call.timer
        storing = self._parts.memory.commit_in_flight(conversation) if conversation else None
        if storing is not None:
            # The previous turn's commit is being stored here (it came through another gateway,
            # or this one did not wait): what this turn may read is what it stores.
            await timer.registry(asyncio.wait({storing}, timeout=self._parts.policy.commit_wait_s))
        shuttle = self._parts.shuttle
        moving = shuttle.move_in_flight(conversation) if shuttle is not None and conversation else None
        if moving is not None:
            # This replica is moving the retention (park or prefetch) and holds its claim: the
            # turn reads it where it lands rather than recomputing on a lost claim.
            await timer.registry(asyncio.wait({moving}, timeout=self._parts.policy.parking.move_wait_s))
            structlog.contextvars.bind_contextvars(waited_for_move=True)
        nodes = await timer.registry(self._parts.nodes.nodes(req.model))  # cached: usually no round trip
        if not placeable(nodes, req.model, call.decode_allowed):
            # A node that just registered (an agent back) is not in the list in hand yet.
            nodes = await timer.registry(self._parts.nodes.reread(req.model))
        prefill_pool = candidates(nodes, NodeRole.PREFILL, req.model)
        block_size = prefill_pool[0].block_size
        # Prefill's own prefix-cache hits, asked only when a candidate has indexed blocks at all
        # (none do when prefill runs without prefix caching). The conversation's retention, from
        # this replica's hint or the registry, in the same round trip. A plain request with
        # nothing to look up needs no chain. The chain starts from the cache salt's root, as the
        # index keys blocks stored under that salt, so a lookup finds only the salt's own blocks.
        indexed = any(x.indexed_blocks for x in prefill_pool)
        chain = (
            self._parts.chains.chain(conversation, call.tokens, block_size, root=call.root)
            if conversation or indexed
            else NO_CHAIN
        )
        hint = self._hint(req, conversation, block_size) if use_hint else None
        hits, (fence, retention) = await self._registry_reads(
            # The registry looks up at most MAX_BLOCK_HASHES (a prompt of tiny blocks has more).
            chain[:MAX_BLOCK_HASHES] if len(chain) and indexed else None,
            conversation if conversation and hint is None else "",
            req.model,
            timer,
        )
        if hint is not None:
            fence, retention = hint.generation, hint
        elif moving is None:
            retention = await self._forks.after_move_elsewhere(conversation, retention, timer)
        fork = False
        if retention is None and call.parent:
            _, retention = await timer.registry(self._parts.port.get_conversation(call.parent))
            retention = await self._forks.readable(call, retention, nodes)
            fork = retention is not None
            if retention is not None:
                retention = self._known(call.parent, retention)
        if retention is not None and retention.block_size != block_size:
            # This prefill cannot read KV of another block size (MODEL_MISMATCH); the chain in
            # the retention's still lets verify() say how much matched.
            block_size = retention.block_size
            chain = self._parts.chains.chain(
                conversation, call.tokens, block_size, root=call.root, remember=False
            )
        hits = {
            name: blocks
            for name, blocks in hits.items()
            if any(x.name == name and x.block_size == block_size for x in nodes)
        }
        prefill, local_hits, decode = self._place(call, nodes, hits, retention)
        recompute = call.cost.recompute(int(call.tokens.size), local_hits, prefill.name)
        reported = prefill.running_requests + prefill.waiting_requests
        return PlanContext(
            call=call,
            chain=chain,
            block_size=block_size,
            nodes=nodes,
            fence=fence,
            retention=retention,
            fork=fork,
            from_hint=hint is not None,
            prefill=prefill,
            decode=decode,
            local_hits=local_hits,
            recompute_cost=recompute,
            now=self._parts.clock.now(),
            prefill_queued_ms=self._parts.ledger.queued_ms(
                prefill.name, reported, unknown_ms=recompute.total_ms
            ),
        )

    def _place(
        self,
        call: PlanCall,
        nodes: Sequence[NodeInfo],
        hits: Mapping[str, int],
        retention: RetentionInfo | None = None,
    ) -> tuple[NodeInfo, int, NodeInfo]:
        """Prefill (and its local hits in tokens) and decode. Ties: for prefill the node whose
        pool holds the retention, for decode the retention's holder, then the conversation's
        last nodes."""
        req, conversation = call.req, call.conversation
        holder = next((x for x in nodes if retention is not None and x.name == retention.node), None)
        held_bytes = retention.num_tokens * holder.kv_bytes_per_token if retention and holder else 0
        hint_p, hint_d = self._parts.memory.last_nodes(conversation) if conversation else ("", "")
        weights, ledger, rng = self._parts.policy.weights, self._parts.ledger, self._parts.rng
        prefill, local_hits = choose_prefill(
            nodes,
            model=req.model,
            prompt_tokens=int(call.tokens.size),
            local_hit_blocks=hits,
            cost=call.cost,
            weights=weights,
            ledger=ledger,
            rng=rng,
            hint=hint_p,
            prefer=pool_owner_of(nodes, retention.node) if retention else "",
        )
        decode = choose_decode(
            nodes,
            model=req.model,
            weights=weights,
            ledger=ledger,
            rng=rng,
            avoid=prefill.name,
            hint=hint_d,
            allowed=call.decode_allowed,
            holder=holder.name if holder is not None and holder.role.serves(NodeRole.DECODE) else "",
            held_bytes=held_bytes,
        )
        return prefill, local_hits, decode

    def _last_known_context(self, call: PlanCall, error: Unavailable) -> PlanContext:
        """A plain P->D context on the last node list the registry gave (no retention, no local
        hits); `error` again when there is none young enough to trust."""
        req, conversation = call.req, call.conversation
        known = self._parts.nodes.last_known(req.model)
        if known is None:
            raise error
        nodes, age = known
        block_size = candidates(nodes, NodeRole.PREFILL, req.model)[0].block_size
        # The commit checks its tokens against the prompt's chain (and stores the chain when
        # the registry is back by then).
        chain = (
            self._parts.chains.chain(conversation, call.tokens, block_size, root=call.root)
            if conversation
            else NO_CHAIN
        )
        hint = self._parts.memory.hints.get(conversation) if conversation else None
        prefill, local_hits, decode = self._place(call, nodes, {})
        structlog.contextvars.bind_contextvars(nodes_age_s=round(age, 3))
        return PlanContext(
            call=call,
            chain=chain,
            block_size=block_size,
            nodes=nodes,
            fence=hint.generation if hint is not None else 0,
            retention=None,
            fork=False,
            from_hint=False,
            prefill=prefill,
            decode=decode,
            local_hits=local_hits,
            recompute_cost=call.cost.recompute(int(call.tokens.size), local_hits, prefill.name),
            now=self._parts.clock.now(),
        )

    def _degraded(self, ctx: PlanContext, error: Unavailable) -> Plan:
        """The registry did not answer: plain P->D on `ctx`'s nodes, nothing claimed."""
        log.warning("plan.degraded", reason=error.reason, error=error.message[:300])
        verdict = Verdict(Reason.REGISTRY_UNAVAILABLE)
        return self._issuer.issue(ctx, Reason.REGISTRY_UNAVAILABLE, verdict, None)

    async def _registry_reads(
        self, chain: Chain | None, conversation: str, model: str, timer: CallTimer
    ) -> tuple[dict[str, int], tuple[int, RetentionInfo | None]]:
        """Prefill's local hits on `chain` and the conversation's retention: the reads asked
        for (None, "": not asked), both in one round trip."""
        lookup = None if chain is None else self._parts.port.lookup_blocks(chain, model, NodeRole.PREFILL)
        current = self._parts.port.get_conversation(conversation) if conversation else None
        if lookup is not None and current is not None:
            return await timer.registry(asyncio.gather(lookup, current))
        if lookup is not None:
            return await timer.registry(lookup), (0, None)
        if current is not None:
            return {}, await timer.registry(current)
        return {}, (0, None)

    def _reuse_allowed(self, req: PlanRequest) -> bool:
        return self._parts.policy.reuse_enabled and not req.disable_reuse

    def _known(self, conversation: str, retention: RetentionInfo) -> RetentionInfo:
        """`retention` with the tokens this replica's commit of it knows (its hint's), which let
        a fork's prefix be cut at its last equal token too."""
        hint = self._parts.memory.hints.get(conversation)
        if hint is None or (hint.name, hint.num_tokens) != (retention.name, retention.num_tokens):
            return retention
        return replace(retention, known_from_block=hint.known_from_block, known_tokens=hint.known_tokens)

    def _hint(self, req: PlanRequest, conversation: str, block_size: int) -> RetentionInfo | None:
        """The retention this replica last stored for the conversation, when reuse is on."""
        if not conversation or not self._reuse_allowed(req):
            return None
        hint = self._parts.memory.hints.get(conversation)
        return hint if hint is not None and hint.block_size == block_size else None

    def _decide(self, ctx: PlanContext) -> Verdict:
        """Why this turn reuses (if the claim succeeds) or recomputes."""
        call, retention = ctx.call, ctx.retention
        if not call.conversation:
            return Verdict(Reason.NO_CONVERSATION)
        if not self._reuse_allowed(call.req):
            return Verdict(Reason.DISABLED)
        if retention is None:
            return Verdict(Reason.NO_RETENTION)
        n, cost = int(call.tokens.size), call.cost
        # ctx.block_size is the retention's (see PlanContext), so the chains compare.
        tokens = call.tokens if self._parts.policy.token_granular_reuse else None
        prefix = verify(ctx.chain, n, retention, prompt=tokens)
        reuse_cost = cost.reuse(n, prefix.tokens, ctx.local_hits, ctx.prefill.name) if prefix.tokens else None
        reason: Reason | None = None
        # Prefill reads from the holder as registered; one the router cannot address is down.
        holder = next((x for x in ctx.nodes if x.name == retention.node and x.healthy), None)
        shared = self._forks.shares(ctx.fork, holder)
        if retention.claimed and (retention.claimed_once or not shared):
            reason = Reason.FORK_UNSAFE if ctx.fork else Reason.CLAIM_LOST
        elif retention.model != call.req.model or ctx.prefill.block_size != retention.block_size:
            reason = Reason.MODEL_MISMATCH
        elif holder is None or not knows_side_channel(holder):
            reason = Reason.NODE_DOWN
        elif retention.expire_at - ctx.now < self._parts.policy.claim_headroom_s + (
            reuse_cost.transfer_ms / 1e3 if reuse_cost else 0.0
        ):
            reason = Reason.EXPIRED
        elif prefix.tokens == 0:
            reason = Reason.PREFIX_MISMATCH
        elif prefix.tokens - ctx.local_hits < cost.profile.min_reuse_tokens:
            reason = Reason.BELOW_THRESHOLD
        elif reuse_cost is None or reuse_cost.total_ms >= ctx.recompute_cost.total_ms:
            reason = Reason.COST
        if reason is None:
            verdict = Verdict(
                Reason.REUSE_CHEAPER, prefix, reuse_cost, claim=retention, holder=holder, shared=shared
            )
        elif self._releases(ctx, reason, holder):
            verdict = Verdict(reason, prefix, reuse_cost, claim=retention, holder=holder, release=True)
        else:
            verdict = Verdict(reason, prefix, reuse_cost)
        if holder is not None and reason in (None, Reason.COST, Reason.BELOW_THRESHOLD):
            return self._extend_or(ctx, verdict, retention, holder)
        return verdict

    def _releases(self, ctx: PlanContext, reason: Reason, holder: NodeInfo | None) -> bool:
        """Whether a recompute for `reason` releases the retention `holder` holds."""
        return (
            self._parts.policy.release_superseded
            and reason in _SUPERSEDED
            and not ctx.fork
            and holder is not None
            and knows_side_channel(holder)
        )

    def _extend_or(
        self, ctx: PlanContext, verdict: Verdict, retention: RetentionInfo, holder: NodeInfo
    ) -> Verdict:
        """`verdict` (reuse on prefill, or recompute), or running the turn on `holder` when that
        is a decode node with room whose prefix cache holds the verified prefix's full blocks
        (pinned there under the retention), and it is cheaper still (kvshuttle.router.cost's
        price_extend). Never on a holder outside the decode endpoints the caller allows: the
        turn's decode would run there (reading its KV from there stays allowed)."""
        prefix, other = verdict.prefix, verdict.reuse_cost if verdict.claim else ctx.recompute_cost
        if holder.role is not NodeRole.DECODE or prefix is None or other is None:
            return verdict
        call = ctx.call
        if call.decode_allowed is not None and not call.decode_allowed.allows_url(holder.http_endpoint):
            return verdict
        extend, wins = price_extend(
            call.cost,
            self._parts.policy.extend,
            holder=holder.name,
            prompt_tokens=int(call.tokens.size),
            held_tokens=prefix.tokens // ctx.block_size * ctx.block_size,
            running=holder.running_requests,
            waiting=holder.waiting_requests,
            other=other,
            decode_is_holder=ctx.decode.name == holder.name,
            kv_usage=holder.kv_cache_usage,
            queued_ms=ctx.prefill_queued_ms,
        )
        if not wins:
            return replace(verdict, extend_cost=extend)
        return Verdict(
            Reason.EXTEND_CHEAPER,
            prefix,
            verdict.reuse_cost,
            claim=retention,
            holder=holder,
            extend_cost=extend,
        )

    async def _where_claimed(
        self, ctx: PlanContext, verdict: Verdict, claim: ClaimInfo
    ) -> tuple[Verdict, ClaimInfo | None, Reason]:
        """The plan on the claimed retention as the registry has it: the router's shuttle may
        have moved it into an agent's pool since it was read (same name and generation, another
        holder and params), and prefill must read it from there. Verified again on what was
        claimed; when that holder cannot serve it, the claim is given back unread (the retention
        stays for a later turn) and the turn recomputes (NODE_DOWN)."""
        seen, got = verdict.claim, claim.retention
        assert seen is not None
        if got.node == seen.node and got.kv_transfer_params == seen.kv_transfer_params:
            return verdict, claim, verdict.reason
        if verdict.release:
            # Moved since it was read: released where it is now, if that holder can be told.
            holder = next((x for x in ctx.nodes if x.name == got.node and x.healthy), None)
            if holder is not None and knows_side_channel(holder):
                return (
                    replace(verdict, claim=got, holder=holder),
                    replace(claim, retention=got),
                    verdict.reason,
                )
            await self._give_back(ctx, got, claim)
            return replace(verdict, claim=None, holder=None, release=False), None, verdict.reason
        if got.generation == seen.generation and got.num_tokens == seen.num_tokens:
            got = replace(got, known_from_block=seen.known_from_block, known_tokens=seen.known_tokens)
        call = ctx.call
        n = int(call.tokens.size)
        tokens = call.tokens if self._parts.policy.token_granular_reuse else None
        prefix = verify(ctx.chain, n, got, prompt=tokens) if got.block_size == ctx.block_size else None
        holder = next((x for x in ctx.nodes if x.name == got.node and x.healthy), None)
        call.span.set_attribute("kvshuttle.claim.moved", True)
        if holder is None or not knows_side_channel(holder) or prefix is None or prefix.tokens == 0:
            log.info("plan.claimed_elsewhere", node=got.node, verified_tokens=prefix.tokens if prefix else 0)
            await self._give_back(ctx, got, claim)
            return Verdict(Reason.NODE_DOWN, prefix), None, Reason.NODE_DOWN
        reuse_cost = call.cost.reuse(n, prefix.tokens, ctx.local_hits, ctx.prefill.name)
        moved = Verdict(
            Reason.REUSE_CHEAPER, prefix, reuse_cost, claim=got, holder=holder, shared=verdict.shared
        )
        return moved, replace(claim, retention=got), Reason.REUSE_CHEAPER

    async def _give_back(self, ctx: PlanContext, got: RetentionInfo, claim: ClaimInfo) -> None:
        """The claim given back unread: the retention stays for a later turn."""
        try:
            await ctx.call.timer.registry(
                self._parts.port.release(got.name, claim_id=claim.claim_id, keep=True)
            )
        except Unavailable as err:  # it lapses on its own TTL
            log.warning("plan.release_failed", reason=err.reason)

    async def _holder_serving(self, ctx: PlanContext, verdict: Verdict) -> Verdict:
        """`verdict`, unless it reads from an agent's pool whose agent does not answer now: then
        a recompute (NODE_DOWN), and the retention is left unclaimed. A killed agent's pool node
        stays listed until its lease lapses, and vLLM 0.32's prefill never finishes a request
        whose READ failed on a peer that died after its handshake."""
        holder, agents = verdict.holder, self._parts.agents
        if holder is None or holder.role is not NodeRole.POOL or agents is None:
            return verdict
        timeout = self._parts.policy.parking.holder_probe_timeout_s
        if await ctx.call.timer.registry(agents.serving(holder.agent_endpoint, deadline_s=timeout)):
            return verdict
        log.warning("plan.holder_not_serving", node=holder.name)
        self._parts.metrics.holders_not_serving.inc()
        ctx.call.span.set_attribute("kvshuttle.holder_serving", False)
        if verdict.release:  # nothing to release through an agent that does not answer
            return Verdict(verdict.reason, verdict.prefix, verdict.reuse_cost)
        return Verdict(Reason.NODE_DOWN, verdict.prefix, verdict.reuse_cost)
