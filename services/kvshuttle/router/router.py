"""The router's domain service: PlanTurn, CommitTurn, AbortTurn, ListReadyDecodes. No grpc here.

`Router` wires the parts one replica shares between its calls and hands each call to its owner:

* planner.py: PlanTurn (verify, price, place, claim); plan_issue.py writes the plan down;
* committer.py: CommitTurn and AbortTurn;
* node_directory.py: the node list per model, refreshed in the background;
* turn_memory.py: what this replica remembers of its turns (retries, hints, commits in flight);
* ledger.py: the work this replica placed on each node that no report shows yet;
* chains.py: prompts' hash chains, computed incrementally per conversation;
* shuttle.py: parks and prefetches this replica's committed retentions in agents' pools.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import structlog
from opentelemetry import trace

from kvshuttle.core.clock import Clock
from kvshuttle.core.errors import NotFound, Unavailable
from kvshuttle.core.limits import MAX_READY_DECODES
from kvshuttle.core.names import parse_tenant
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.router import checks
from kvshuttle.router.chains import ChainCache
from kvshuttle.router.committer import Committer
from kvshuttle.router.cost import CostModel
from kvshuttle.router.ledger import PlacementLedger
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.model import (
    CommitRequest,
    CommitResult,
    FoundTranscript,
    NodeInfo,
    Plan,
    PlanRequest,
)
from kvshuttle.router.node_directory import NodeDirectory
from kvshuttle.router.parts import RouterParts
from kvshuttle.router.placement import ready_decodes
from kvshuttle.router.planner import Planner
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.router.ports import AgentPort, RegistryPort
from kvshuttle.router.shuttle import Shuttle
from kvshuttle.router.turn_memory import TurnMemory
from kvshuttle.router.turns import TurnCodec

__all__ = ["Router"]

T = TypeVar("T")


class Router:
    def __init__(
        self,
        port: RegistryPort,
        clock: Clock,
        costs: Sequence[CostModel],
        codec: TurnCodec,
        policy: RouterPolicy | None = None,
        metrics: RouterMetrics | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        agents: AgentPort | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        """`costs`: one cost model per served model; the router calibrates them as turns commit.
        `agents`: where the shuttle sends moves; it runs (`run_shuttle`) only with agents and
        policy.parking's park or prefetch enabled. `monotonic`: the clock the node list and the
        placement ledger age by (the fleet simulator's virtual one there). `rng`: draws among
        near-tied nodes (a seeded one makes a simulation repeatable)."""
        policy = policy or RouterPolicy()
        # Verifies turn handles for the authorization of CommitTurn and AbortTurn too.
        self.codec = codec
        # The process's global provider unless one is passed in (tests pass their own: OTel
        # lets the global be set only once per process).
        tracer = trace.get_tracer("kvshuttle.router", tracer_provider=tracer_provider)
        by_model = {c.profile.model: c for c in costs}
        metrics = metrics or RouterMetrics()
        nodes = NodeDirectory(
            port,
            refresh_s=policy.node_refresh_s,
            max_age_s=policy.node_max_age_s,
            miss_refresh_s=policy.node_miss_refresh_s,
            degraded_max_age_s=policy.degraded_nodes_max_age_s,
            monotonic=monotonic,
        )
        memory = TurnMemory(
            remembered_turns=policy.remembered_turns,
            hint_bytes=policy.retention_hint_bytes,
            plan_bytes=policy.remembered_plan_bytes,
            prompt_bytes=policy.held_prompt_bytes,
        )
        # The caches the planner and the committer share, exported as metrics.
        self.chains = ChainCache(policy.chain_cache_bytes)
        self.hints = memory.hints
        metrics.watch_caches(self.chains, self.hints, memory.prompts)
        parking = policy.parking
        self.shuttle = (
            Shuttle(
                port=port,
                agents=agents,
                clock=clock,
                nodes=nodes,
                hints=memory.hints,
                costs=by_model,
                policy=policy,
                metrics=metrics,
            )
            if agents is not None and (parking.enabled or parking.prefetch_enabled)
            else None
        )
        parts = RouterParts(
            port=port,
            clock=clock,
            costs=by_model,
            codec=codec,
            policy=policy,
            metrics=metrics,
            tracer=tracer,
            nodes=nodes,
            memory=memory,
            chains=self.chains,
            ledger=PlacementLedger(max_turns=policy.remembered_turns, monotonic=monotonic),
            rng=rng or random.Random(),
            shuttle=self.shuttle,
            agents=agents,
        )
        self._parts = parts
        self._planner = Planner(parts)
        self._committer = Committer(parts)
        # Commits and aborts whose callers stopped waiting, held so that they run to their end.
        self._finishing: set[asyncio.Future[Any]] = set()

    async def plan_turn(self, req: PlanRequest) -> Plan:
        return await self._planner.plan_turn(req)

    async def commit_turn(self, req: CommitRequest) -> CommitResult:
        return await self._to_the_end(self._committer.commit_turn(req))

    async def abort_turn(self, handle: str, reason: str) -> None:
        await self._to_the_end(self._committer.abort_turn(handle, reason))

    async def ready_decodes(self, model: str) -> list[NodeInfo]:
        """ListReadyDecodes: the healthy decode nodes of `model` in the node list plans place on,
        least loaded first, at most MAX_READY_DECODES. None in the list in hand: the registry's
        list now (a node that just registered). The registry not answering: its last list while
        young enough (as a degraded plan), else Unavailable (REGISTRY_UNAVAILABLE)."""
        checks.cost_model(self._parts.costs, model)
        directory, weights, ledger = self._parts.nodes, self._parts.policy.weights, self._parts.ledger
        try:
            nodes = await directory.nodes(model)
            if not ready_decodes(nodes, model, weights, ledger):
                nodes = await directory.reread(model)
        except Unavailable as err:
            known = directory.last_known(model) if err.reason == ErrorReason.REGISTRY_UNAVAILABLE else None
            if known is None:
                raise
            nodes = known[0]
            structlog.contextvars.bind_contextvars(nodes_age_s=round(known[1], 3))
        ready = ready_decodes(nodes, model, weights, ledger)[:MAX_READY_DECODES]
        structlog.contextvars.bind_contextvars(decodes=len(ready))
        return ready

    async def find_transcript(self, tenant: str, model: str, lookup_key: bytes) -> FoundTranscript:
        """FindTranscript: the tenant's transcript with `lookup_key` (NotFound when none)."""
        tenant_id = parse_tenant(tenant, "tenant", max_length=self._parts.policy.max_id_length)
        checks.cost_model(self._parts.costs, model)
        checks.lookup_key(lookup_key, "lookup_key")
        found = await self._parts.port.find_transcript(tenant_id, model, lookup_key)
        structlog.contextvars.bind_contextvars(transcript_found=found is not None)
        if found is None:
            raise NotFound(
                "no transcript of the tenant has that lookup key",
                reason=ErrorReason.RETENTION_NOT_FOUND,
                metadata={"field": "lookup_key"},
            )
        return found

    async def _to_the_end(self, call: Coroutine[Any, Any, T]) -> T:
        """A commit or an abort runs to its end even when its caller stops waiting (the RPC's
        deadline passed, or it was cancelled). Cut short, it would leave the claim it consumed
        claimed until the claim's TTL and decode's retained KV unstored, and the conversation's
        next turns would recompute (CLAIM_LOST, NO_RETENTION) long after the moment that made
        the caller give up. Its registry calls are bounded (commit_registry_timeout_s), so it
        ends soon; what it stores is fenced by the turn's generation as any commit is."""
        context = contextvars.copy_context()
        task = asyncio.get_running_loop().create_task(call, context=context)
        self._finishing.add(task)
        task.add_done_callback(self._settled)
        result = await asyncio.shield(task)
        # What the call bound for the RPC's one log line (rpc.done), bound in its own context.
        structlog.contextvars.bind_contextvars(**context.run(structlog.contextvars.get_contextvars))
        return result

    def _settled(self, task: asyncio.Future[Any]) -> None:
        self._finishing.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that left does not read it

    async def run_shuttle(self) -> None:
        """The shuttle's loop, until cancelled (returns at once without a shuttle)."""
        if self.shuttle is not None:
            await self.shuttle.run()
