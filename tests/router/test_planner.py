"""The planner on its own, over a scripted registry port: no registry, no sockets."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from opentelemetry import trace
from prometheus_client import CollectorRegistry
from tests.support.clock import FakeClock

from kvshuttle.core.errors import Aborted, NotFound, Unavailable
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.core.nodes import NodeRole
from kvshuttle.router.chains import ChainCache
from kvshuttle.router.cost import CostModel, LinkModel, ModelProfile, PrefillModel
from kvshuttle.router.ledger import PlacementLedger
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.model import (
    ClaimInfo,
    Decision,
    FoundTranscript,
    Hashes,
    NewRetention,
    NodeInfo,
    PlanRequest,
    Reason,
    RetentionInfo,
)
from kvshuttle.router.node_directory import NodeDirectory
from kvshuttle.router.parts import RouterParts
from kvshuttle.router.planner import Planner
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.router.turn_memory import TurnMemory
from kvshuttle.router.turns import TurnCodec

BS = 16
CPU = ModelProfile(
    model="m",
    kv_bytes_per_token=16_384,
    prefill=PrefillModel(fixed_ms=5, per_token_ms=0.5),
    link=LinkModel(bandwidth_gb_s=5, fixed_ms=5),
)
CONV = "tenants/acme/conversations/c1"
PROMPT = list(range(100, 1100))  # 1000 tokens
RETAINED = PROMPT[:960]


def node(name: str, role: NodeRole) -> NodeInfo:
    return NodeInfo(
        name=name,
        role=role,
        engine_id=f"engine-{name[6:]}",
        http_endpoint=f"http://{name[6:]}:8000",
        model=CPU.model,
        block_size=BS,
        kv_bytes_per_token=CPU.kv_bytes_per_token,
        healthy=True,
        side_channel_host="127.0.0.1",
        side_channel_port=5600,
    )


def retention(generation: int, expire_at: float) -> RetentionInfo:
    blocks = len(RETAINED) // BS
    return RetentionInfo(
        name=f"{CONV}/retentions/{generation}",
        node="nodes/d0",
        generation=generation,
        model=CPU.model,
        block_size=BS,
        num_tokens=len(RETAINED),
        block_hashes=np.array(chain_hashes(RETAINED, BS), dtype=np.uint64),
        kv_transfer_params={"do_remote_decode": True, "remote_block_ids": [list(range(blocks))]},
        expire_at=expire_at,
        claimed=False,
    )


class ScriptedPort:
    """The registry's answers, set by the test; claims of `refused` names fail with `error`."""

    def __init__(self, nodes: list[NodeInfo], current: tuple[int, RetentionInfo | None]) -> None:
        self.nodes = nodes
        self.current = current
        self.refused: dict[str, Exception] = {}
        self.calls: list[str] = []

    async def get_conversation(self, name: str) -> tuple[int, RetentionInfo | None]:
        self.calls.append("get_conversation")
        return self.current

    async def list_nodes(self, model: str) -> list[NodeInfo]:
        self.calls.append("list_nodes")
        return self.nodes

    async def find_by_chain(
        self, tenant: str, model: str, block_size: int, chain: Hashes
    ) -> RetentionInfo | None:
        self.calls.append("find_by_chain")
        return None

    async def find_transcript(self, tenant: str, model: str, lookup_key: bytes) -> FoundTranscript | None:
        raise AssertionError("a plan finds no transcript")

    async def lookup_blocks(self, chain: Hashes, model: str, role: NodeRole) -> dict[str, int]:
        self.calls.append("lookup_blocks")
        return {}

    async def claim(
        self, name: str, *, holder: str, claim_ttl: float, request_id: str, shared: bool = False
    ) -> ClaimInfo:
        self.calls.append(f"claim {name}")
        if name in self.refused:
            raise self.refused[name]
        found = self.current[1]
        assert found is not None and found.name == name
        return ClaimInfo(found, "claim-1", found.expire_at)

    async def put_retention(self, new: NewRetention) -> RetentionInfo:
        raise AssertionError("a plan stores nothing")

    async def release(self, name: str, *, claim_id: str, keep: bool = False) -> None:
        raise AssertionError("a plan releases nothing")

    async def move_retention(self, name: str, **kwargs: Any) -> RetentionInfo:
        raise AssertionError("a plan moves nothing")


def planner(port: ScriptedPort, clock: FakeClock, memory: TurnMemory) -> Planner:
    policy = RouterPolicy()
    return Planner(
        RouterParts(
            port=port,
            clock=clock,
            costs={CPU.model: CostModel(CPU)},
            codec=TurnCodec(b"k" * 32),
            policy=policy,
            metrics=RouterMetrics(CollectorRegistry()),
            tracer=trace.get_tracer("test"),
            nodes=NodeDirectory(port, refresh_s=60, max_age_s=60),
            memory=memory,
            chains=ChainCache(1 << 20),
            ledger=PlacementLedger(),
            rng=random.Random(0),
        )
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def memory() -> TurnMemory:
    return TurnMemory(remembered_turns=100, hint_bytes=1 << 20)


NODES = [node("nodes/p0", NodeRole.PREFILL), node("nodes/d0", NodeRole.DECODE)]


async def plan(p: Planner) -> Any:
    return await p.plan_turn(PlanRequest(model=CPU.model, prompt_token_ids=PROMPT, conversation=CONV))


@pytest.mark.parametrize(
    "refusal",
    [
        NotFound("replaced", reason="RETENTION_NOT_FOUND"),
        Aborted("taken", reason="RETENTION_ALREADY_CLAIMED"),
    ],
)
async def test_a_refused_hint_plans_again_once_on_the_registrys_word(
    clock: FakeClock, memory: TurnMemory, refusal: Exception
) -> None:
    stale, current = retention(1, clock.now() + 400), retention(2, clock.now() + 400)
    memory.hints.put(CONV, stale)
    port = ScriptedPort(NODES, (2, current))
    port.refused[stale.name] = refusal

    got = await plan(planner(port, clock, memory))

    assert (got.decision, got.reason, got.generation, got.claimed) == (
        Decision.REUSE,
        Reason.REUSE_CHEAPER,
        3,
        current.name,
    )
    # The hint's claim first (no read), then the registry's retention: the node list in hand
    # serves both attempts.
    assert port.calls == ["list_nodes", f"claim {stale.name}", "get_conversation", f"claim {current.name}"]
    assert memory.hints.get(CONV) is None


async def test_the_second_attempt_is_the_last(clock: FakeClock, memory: TurnMemory) -> None:
    stale, current = retention(1, clock.now() + 400), retention(2, clock.now() + 400)
    memory.hints.put(CONV, stale)
    port = ScriptedPort(NODES, (2, current))
    port.refused[stale.name] = NotFound("replaced", reason="RETENTION_NOT_FOUND")
    port.refused[current.name] = Aborted("taken", reason="RETENTION_ALREADY_CLAIMED")

    got = await plan(planner(port, clock, memory))

    assert (got.decision, got.reason, got.generation, got.claimed) == (
        Decision.RECOMPUTE,
        Reason.CLAIM_LOST,
        3,
        "",
    )
    assert [c for c in port.calls if c.startswith("claim")] == [
        f"claim {stale.name}",
        f"claim {current.name}",
    ]


async def test_a_hint_the_plan_would_not_claim_is_checked_with_the_registry(
    clock: FakeClock, memory: TurnMemory
) -> None:
    # The hint expires within the claim headroom: no claim is tried on it, the registry is read.
    memory.hints.put(CONV, retention(1, clock.now() + 1))
    current = retention(2, clock.now() + 400)
    port = ScriptedPort(NODES, (2, current))

    got = await plan(planner(port, clock, memory))

    assert (got.reason, got.claimed) == (Reason.REUSE_CHEAPER, current.name)
    assert port.calls == ["list_nodes", "get_conversation", f"claim {current.name}"]


async def test_without_a_prefill_node_nothing_is_read_but_the_nodes(
    clock: FakeClock, memory: TurnMemory
) -> None:
    port = ScriptedPort([node("nodes/d0", NodeRole.DECODE)], (1, retention(1, clock.now() + 400)))

    with pytest.raises(Unavailable) as err:
        await plan(planner(port, clock, memory))

    assert err.value.reason == "NO_PREFILL_NODE"
    assert set(port.calls) == {"list_nodes"}  # read, and reread in case a node just joined
