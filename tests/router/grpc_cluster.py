"""A registry and router over real gRPC (the `c` fixture), shared by the router gRPC tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import pytest
from tests.router.helpers import (
    CONV,
    MODEL,
    RouterEnv,
    Tokens,
    add_node,
    heartbeat,
    start_router,
)
from tests.support.registry_env import RegistryEnv, start_registry

from kvshuttle.client import KvshuttleRpcError
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb

# Long enough that reading the KV beats recomputing it under the Qwen3-32B profile.
PROMPT = 4000


OUTPUT = 70  # 4070 tokens: not a whole number of blocks, so verification cuts the last one


@dataclass
class Cluster:
    registry: RegistryEnv
    a: RouterEnv
    b: RouterEnv
    tokens: Tokens = field(default_factory=Tokens)
    incarnations: dict[str, int] = field(default_factory=dict)
    extra: list[RouterEnv] = field(default_factory=list)

    async def add(self, name: str, role: reg_pb.NodeRole.ValueType, ttl: float = 300) -> None:
        self.incarnations[name] = await add_node(self.registry, name, role, ttl=ttl)

    async def beat(self, name: str, *, healthy: bool = True) -> None:
        await heartbeat(self.registry, name, self.incarnations[name], healthy=healthy)

    async def router(self, **kw: Any) -> RouterEnv:
        env = await start_router(self.registry, **kw)
        self.extra.append(env)
        return env

    async def plan(
        self, prompt: list[int], *, on: RouterEnv | None = None, conversation: str = CONV
    ) -> pb.PlanTurnResponse:
        return await (on or self.a).client.plan_turn(MODEL, prompt, conversation=conversation)

    async def commit(
        self,
        plan: pb.PlanTurnResponse,
        sequence: list[int],
        *,
        on: RouterEnv | None = None,
        timings: pb.TurnTimings | None = None,
    ) -> pb.CommitTurnResponse:
        return await (on or self.a).client.commit_turn(
            plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=self.tokens.decode_params(plan, len(sequence)),
            timings=timings,
        )

    async def turn(
        self, prompt: list[int], *, on: RouterEnv | None = None, output: int = OUTPUT
    ) -> tuple[pb.PlanTurnResponse, list[int]]:
        """Plan, then commit as a gateway does once decode answered `output` tokens."""
        plan = await self.plan(prompt, on=on)
        sequence = prompt + self.tokens(output)
        await self.commit(plan, sequence, on=on)
        return plan, sequence


@pytest.fixture(name="c")
async def cluster() -> AsyncIterator[Cluster]:
    registry = await start_registry()
    a = await start_router(registry)
    b = await start_router(registry)
    c = Cluster(registry, a, b)
    await c.add("nodes/p0", reg_pb.NODE_ROLE_PREFILL)
    await c.add("nodes/d0", reg_pb.NODE_ROLE_DECODE)
    yield c
    for env in (a, b, *c.extra):
        await env.close()
    await registry.channel.close()
    registry.registry.close()
    await registry.server.stop()


async def fails(call: Awaitable[Any]) -> KvshuttleRpcError:
    with pytest.raises(KvshuttleRpcError) as caught:
        await call
    assert caught.value.domain in (None, "router.kvshuttle")
    return caught.value


async def retention(c: Cluster, generation: int = 1) -> reg_pb.Retention:
    name = f"{CONV}/retentions/{generation}"
    return (await c.registry.stub.GetRetention(reg_pb.GetRetentionRequest(name=name))).retention
