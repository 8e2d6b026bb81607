"""An in-process registry and router without gRPC, and the turn the router domain tests run through it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Protocol

from bench.fleet.inproc import InProcessPort
from prometheus_client import CollectorRegistry
from tests.router.helpers import TIES_BY_NAME
from tests.support.clock import FakeClock

from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.router.cost import CostModel, LinkModel, ModelProfile, PrefillModel, load_profiles
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.model import CommitRequest, Plan, PlanRequest, TurnTimings
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.router.router import Router
from kvshuttle.router.turns import TurnCodec

# A CPU-class model: prefill is dear, moving KV cheap, so reuse wins wherever it is safe.
CPU = ModelProfile(
    model="m",
    kv_bytes_per_token=16_384,
    prefill=PrefillModel(fixed_ms=5, per_token_ms=0.5),
    link=LinkModel(bandwidth_gb_s=5, fixed_ms=5),
)


MODEL = CPU.model


BS = 16


CONV = "tenants/acme/conversations/c1"


class Cluster:
    """A registry and routers over it (tests/router/conftest.py's `cluster` adds one prefill
    and one decode node)."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.registry = Registry(InMemoryStore(), self.clock, BlockIndex(100_000), RegistryLimits())
        self.rng = random.Random(7)
        self.block_ids = iter(range(1, 10**9))
        self._ports: dict[Router, InProcessPort] = {}

    async def add_node(self, name: str, role: NodeRole, model: str = MODEL, healthy: bool = True) -> None:
        node = await self.registry.register_node(
            NodeSpec(
                name=name,
                role=role,
                engine_id=f"engine-{name.split('/')[1]}",
                http_endpoint=f"http://{name[6:]}:8000",
                side_channel_host="127.0.0.1",
                side_channel_port=5600,
                agent_endpoint="",
                model=model,
                block_size=BS,
                kv_bytes_per_token=CPU.kv_bytes_per_token,
            ),
            ttl=300,
        )
        await self.registry.heartbeat_node(name, node.incarnation, 300, NodeLoad(engine_healthy=healthy))

    def router(
        self,
        profiles: list[ModelProfile] | None = None,
        *,
        costs: list[CostModel] | None = None,
        **policy: Any,
    ) -> Router:
        port = InProcessPort(self.registry)
        router = Router(
            port,
            self.clock,
            costs or [CostModel(p) for p in profiles or [CPU, QWEN]],
            TurnCodec(KEY),
            RouterPolicy(**{"weights": TIES_BY_NAME, **policy}),
            RouterMetrics(CollectorRegistry()),
        )
        self._ports[router] = port
        return router

    def port(self, router: Router) -> InProcessPort:
        """The port `router` reaches the registry through (it counts the calls)."""
        return self._ports[router]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 150_000) for _ in range(n)]

    def decode_params(self, plan: Plan, total_tokens: int) -> dict[str, Any]:
        """What decode answers when it keeps the whole sequence (bidirectional on)."""
        blocks = -(-total_tokens // BS)
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_block_ids": [[next(self.block_ids) for _ in range(blocks)]],
            "remote_engine_id": plan.decode.engine_id,
            "remote_request_id": f"cmpl-{plan.generation}",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "remote_num_tokens": total_tokens,
            "remote_blocks_expiry_time": 1234.5,
        }


async def run_turn(
    router: Router,
    cluster: Cluster,
    prompt: list[int],
    *,
    output: int = 64,
    conversation: str = CONV,
    **plan_kw: Any,
) -> tuple[Plan, list[int]]:
    """Plan, then commit as a gateway would after decode answered `output` tokens."""
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=conversation, **plan_kw)
    )
    sequence = prompt + cluster.tokens(output)
    await router.commit_turn(
        CommitRequest(
            turn=plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=cluster.decode_params(plan, len(sequence)),
            timings=TurnTimings(ttft_ms=100.0, prefill_ms=90.0),
        )
    )
    return plan, sequence


QWEN = load_profiles(Path(__file__).resolve().parents[2] / "deploy" / "profiles" / "qwen3-32b-h200.toml")[0]


KEY = b"k" * 32


class AnswersTurns(Protocol):
    """A test cluster that makes up answers and decode's params for them."""

    def tokens(self, n: int) -> list[int]: ...

    def decode_params(self, plan: Plan, total_tokens: int) -> dict[str, Any]: ...


async def commit_answer(
    router: Router, cluster: AnswersTurns, plan: Plan, prompt: list[int], *, output: int = 32
) -> list[int]:
    """Commit `plan` as a gateway would once decode answered `output` tokens; the sequence."""
    sequence = prompt + cluster.tokens(output)
    await router.commit_turn(
        CommitRequest(
            turn=plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=cluster.decode_params(plan, len(sequence)),
        )
    )
    return sequence
