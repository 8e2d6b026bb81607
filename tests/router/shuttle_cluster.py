"""The shuttle's test cluster: the registry's domain in process (its MoveRetention included),
routers over it with parking on, and fake agents whose moves answer at once (or on a gate)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

from bench.fleet.inproc import InProcessPort
from prometheus_client import CollectorRegistry
from tests.support.clock import FakeClock

from kvshuttle.core.nodes import POOL_CAPACITY_LABEL, POOL_OF_LABEL, NodeLoad, NodeRole, NodeSpec
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.router.cost import CostModel, LinkModel, ModelProfile, PrefillModel
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.model import (
    CommitRequest,
    Plan,
    PlanRequest,
    Pooled,
    TurnEnd,
    TurnTimings,
)
from kvshuttle.router.policy import ExtendPolicy, NextTurnPolicy, ParkingPolicy, RouterPolicy
from kvshuttle.router.router import Router
from kvshuttle.router.shuttle import Shuttle
from kvshuttle.router.turns import TurnCodec

CPU = ModelProfile(
    model="m",
    kv_bytes_per_token=16_384,
    prefill=PrefillModel(fixed_ms=5, per_token_ms=0.5),
    link=LinkModel(bandwidth_gb_s=5, fixed_ms=5),
)
MODEL = CPU.model
BS = 16
CONV = "tenants/acme/conversations/c1"
KEY = b"k" * 32
POOL_PORT = 5700
PROFILES = Path(__file__).resolve().parents[2] / "deploy" / "profiles" / "qwen3-32b-h200.toml"


def pool_params(node: str, source: dict[str, Any], slot0: int = 9000) -> dict[str, Any]:
    """What an agent answers: the pool node's engine and side channel, fresh slots."""
    blocks = len(source["remote_block_ids"][0])
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": f"pool-engine-{node[6:]}",
        "remote_host": "127.0.0.2",
        "remote_port": POOL_PORT,
        "remote_block_ids": [list(range(slot0, slot0 + blocks))],
        "remote_num_tokens": source["remote_num_tokens"],
        "remote_request_id": f"read-{node[6:]}",
        "tp_size": 1,
    }


class FakeAgents:
    """Agents by endpoint; `fail` (an exception) makes the next call raise it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, dict[str, Any], float]] = []
        self.fail: Exception | None = None
        self.answer_node: str | None = None
        # Endpoints whose agent does not answer a liveness probe (killed).
        self.dead: set[str] = set()
        self.probes: list[str] = []
        # Set: a move answers only once it is set (a READ in flight).
        self.gate: asyncio.Event | None = None

    async def park(
        self, endpoint: str, retention: str, *, source: dict[str, Any], ttl: float, request_id: str
    ) -> Pooled:
        return self._answer("park", endpoint, retention, source, ttl)

    async def prefetch(
        self,
        endpoint: str,
        retention: str,
        target_node: str,
        *,
        source: dict[str, Any],
        ttl: float,
        request_id: str,
    ) -> Pooled:
        if self.gate is not None:
            await self.gate.wait()
        return self._answer(f"prefetch {target_node}", endpoint, retention, source, ttl)

    def _answer(self, kind: str, endpoint: str, retention: str, source: dict[str, Any], ttl: float) -> Pooled:
        self.calls.append((kind, endpoint, retention, source, ttl))
        if self.fail is not None:
            raise self.fail
        node = self.answer_node or f"nodes/{endpoint.split(':', maxsplit=1)[0]}-pool"
        return Pooled(node, pool_params(node, source))

    async def serving(self, endpoint: str, *, deadline_s: float) -> bool:
        self.probes.append(endpoint)
        return endpoint not in self.dead

    async def close(self) -> None:
        return None


class Cluster:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.registry = Registry(InMemoryStore(), self.clock, BlockIndex(100_000), RegistryLimits())
        self.rng = random.Random(3)
        self.block_ids = iter(range(1, 10**9))
        self.agents = FakeAgents()
        self.incarnations: dict[str, int] = {}

    @classmethod
    async def prefill_and_decode(cls) -> Cluster:
        """A prefill node and a decode node, each with its agent's pool."""
        cluster = cls()
        await cluster.add_node("nodes/p", NodeRole.PREFILL)
        await cluster.add_node("nodes/d", NodeRole.DECODE)
        return cluster

    async def add_node(self, name: str, role: NodeRole, *, pool: bool = True) -> None:
        short = name[6:]
        await self._register(
            NodeSpec(
                name=name,
                role=role,
                engine_id=f"engine-{short}",
                http_endpoint=f"http://{short}:8000",
                side_channel_host="127.0.0.1",
                side_channel_port=5600,
                agent_endpoint=f"{short}:7000",
                model=MODEL,
                block_size=BS,
                kv_bytes_per_token=CPU.kv_bytes_per_token,
            )
        )
        if pool:
            await self.add_pool(name)

    async def add_pool(self, engine: str) -> None:
        short = engine[6:]
        await self._register(
            NodeSpec(
                name=f"{engine}-pool",
                role=NodeRole.POOL,
                engine_id=f"pool-engine-{short}-pool",
                http_endpoint=f"http://{short}:7001",
                side_channel_host="127.0.0.2",
                side_channel_port=POOL_PORT,
                agent_endpoint=f"{short}:7000",
                model=MODEL,
                block_size=BS,
                kv_bytes_per_token=CPU.kv_bytes_per_token,
                labels={POOL_OF_LABEL: engine, POOL_CAPACITY_LABEL: str(2**30)},
            )
        )

    async def _register(self, spec: NodeSpec) -> None:
        node = await self.registry.register_node(spec, ttl=300)
        self.incarnations[spec.name] = node.incarnation
        await self.load(spec.name)

    async def load(self, name: str, *, kv_cache_usage: float = 0.0, healthy: bool = True) -> None:
        await self.registry.heartbeat_node(
            name,
            self.incarnations[name],
            300,
            NodeLoad(engine_healthy=healthy, kv_cache_usage=kv_cache_usage),
        )

    def router(
        self,
        *,
        extend: ExtendPolicy | None = None,
        next_turn: bool = False,
        share_forks: bool = True,
        **parking: Any,
    ) -> Router:
        policy = RouterPolicy(
            node_max_age_s=0.0,
            share_forks=share_forks,
            parking=ParkingPolicy(**{"enabled": True, **parking}),
            extend=extend or ExtendPolicy(),
            next_turn=NextTurnPolicy(enabled=next_turn),
        )
        self.port = InProcessPort(self.registry)
        return Router(
            self.port,
            self.clock,
            [CostModel(CPU)],
            TurnCodec(KEY),
            policy,
            RouterMetrics(CollectorRegistry()),
            agents=self.agents,
        )

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 150_000) for _ in range(n)]

    def decode_params(self, plan: Plan, total_tokens: int) -> dict[str, Any]:
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_block_ids": [[next(self.block_ids) for _ in range(-(-total_tokens // BS))]],
            "remote_engine_id": plan.decode.engine_id,
            "remote_request_id": f"cmpl-{plan.generation}",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "remote_num_tokens": total_tokens,
        }

    async def turn(
        self,
        router: Router,
        prompt: list[int],
        *,
        conversation: str = CONV,
        turn_end: TurnEnd = TurnEnd.UNSPECIFIED,
        **plan_kw: Any,
    ) -> tuple[Plan, list[int]]:
        plan = await router.plan_turn(
            PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=conversation, **plan_kw)
        )
        sequence = prompt + self.tokens(64)
        await router.commit_turn(
            CommitRequest(
                turn=plan.turn,
                token_ids=sequence,
                decode_kv_transfer_params=self.decode_params(plan, len(sequence)),
                timings=TurnTimings(ttft_ms=100.0, prefill_ms=90.0),
                turn_end=turn_end,
            )
        )
        return plan, sequence


def shuttle(router: Router) -> Shuttle:
    assert router.shuttle is not None
    return router.shuttle


async def tick(router: Router) -> int:
    started = await shuttle(router).step()
    await shuttle(router).drain()
    return started


def moves(router: Router, kind: str, reason: str, outcome: str) -> float:
    return float(shuttle(router)._metrics.moves.labels(kind, reason, outcome)._value.get())
