"""The mover (kvshuttle.agent.pool.mover): real NIXL READs in this process from a stand-in engine, or
from another agent's pool server over its real side channel, into an agent's pool served on a
real side channel; the registry is a fake that records evictions."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import zmq.asyncio
from tests.agent.engine_fakes import FakeSideChannel
from tests.agent.helpers import eventually
from tests.agent.nixl_engine import ENGINE, HASH, Engine

from kvshuttle.agent.pool.blocks import BlockPool, PoolLayout, SlotState
from kvshuttle.agent.pool.mover import Moved, Mover
from kvshuttle.agent.pool.nixl_memory import NixlPoolMemory
from kvshuttle.agent.pool.park import Parker
from kvshuttle.agent.pool.serve import PoolServer
from kvshuttle.agent.ports import RegistryRefused
from kvshuttle.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvshuttleError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvshuttle.core.kv_events import ApplyResult, EventBatch
from kvshuttle.core.nodes import NodeLoad, NodeSpec
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.vllm.kv_transfer_params import from_vllm, to_vllm
from kvshuttle.vllm.nixl_wire import NixlIncompatible
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

POOL = PoolLayout(regions=2, blocks=6, block_bytes=16 * 1024)
NODE = "nodes/decode-0"
POOL_NODE = "nodes/decode-0-pool"
GRACE = 10.0


def retention(n: int = 1) -> str:
    return f"tenants/t/conversations/c{n}/retentions/1"


class Registry:
    """evict_retention answers `answers[name]` (an exception) or succeeds; records each call
    with whether the pool still held the slots when asked."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.answers: dict[str, Exception] = {}
        self.evicted: list[tuple[str, str, bool]] = []

    async def evict_retention(self, name: str, node: str) -> None:
        held = any(a.name == name for a in self.pool.allocations())
        self.evicted.append((name, node, held))
        if name in self.answers:
            raise self.answers[name]

    async def register_node(self, spec: NodeSpec, ttl: float) -> int:
        raise AssertionError("the mover registers nothing")

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float, load: NodeLoad) -> None:
        raise AssertionError("the mover registers nothing")

    async def deregister_node(self, name: str, incarnation: int, *, deadline_s: float) -> None:
        raise AssertionError("the mover registers nothing")

    async def report_block_events(
        self, node: str, incarnation: int, batches: list[EventBatch] | Any
    ) -> ApplyResult:
        raise AssertionError("the mover reports no events")


@dataclass
class Side:
    """One agent's pool, served, with its mover."""

    pool: BlockPool
    memory: NixlPoolMemory
    server: PoolServer
    registry: Registry
    parker: Parker
    mover: Mover


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.close()


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def _side(
    engine: Engine,
    context: zmq.asyncio.Context,
    *,
    layout: PoolLayout = POOL,
    monotonic: Any = time.monotonic,
) -> Side:
    pool = BlockPool(layout)
    memory = NixlPoolMemory(layout, agent_name=f"agent-{uuid.uuid4().hex[:8]}")
    server = PoolServer(pool, memory, engine.handshake(), context, host="127.0.0.1")
    await server.start()
    registry = Registry(pool)
    parker = Parker(pool, memory, timeout=5.0)
    mover = Mover(
        pool=pool,
        parker=parker,
        server=server,
        registry=registry,
        engine=engine.handshake(),
        context=context,
        node=NODE,
        pool_node=POOL_NODE,
        serve_grace=GRACE,
        max_ttl=3600.0,
        handshake_timeout=2.0,
        remembered=4,
        monotonic=monotonic,
    )
    return Side(pool, memory, server, registry, parker, mover)


async def _close(side: Side) -> None:
    await side.server.close()
    await asyncio.to_thread(side.memory.close)


@pytest.fixture
async def side(engine: Engine, context: zmq.asyncio.Context) -> AsyncIterator[Side]:
    s = await _side(engine, context)
    yield s
    await _close(s)


_requests = iter(range(10**6))


def source(block_ids: tuple[int, ...] = (5, 2, 7), **changes: Any) -> KvTransferParams:
    """Decode's params for `block_ids`, addressed to the stand-in engine."""
    params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": "engine-a",
        "remote_request_id": f"cmpl-{next(_requests)}-0",
        "remote_block_ids": [list(block_ids)],
        "remote_num_tokens": 32 * len(block_ids) - 5,
        "remote_blocks_expiry_time": time.perf_counter() + 100,
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        **changes,
    }
    return from_vllm(params)


def _same_bytes(side: Side, moved: Moved, engine: Engine, blocks: tuple[int, ...]) -> bool:
    slots = moved.pooled.remote_block_ids[0].block_ids
    return all(
        np.array_equal(side.memory.block(region, slot), engine.memory.block(region, block))
        for region in range(ENGINE.regions)
        for slot, block in zip(slots, blocks, strict=True)
    )


async def test_park_reads_the_engines_blocks_and_answers_params_that_read_them_from_the_pool(
    side: Side, engine: Engine
) -> None:
    src = source()
    before = time.perf_counter()
    moved = await side.mover.park(retention(), src, ttl=60.0, request_id="park-1")

    assert (moved.name, moved.node, moved.bytes) == (retention(), POOL_NODE, 3 * POOL.slot_bytes)
    assert _same_bytes(side, moved, engine, (5, 2, 7))
    pooled = to_vllm(moved.pooled)
    allocation = side.pool.get(retention())
    assert allocation.state is SlotState.PARKED
    assert pooled["remote_engine_id"] == side.server.engine_id
    assert (pooled["remote_host"], pooled["remote_port"]) == ("127.0.0.1", side.server.port)
    assert pooled["remote_block_ids"] == [list(allocation.slots)]
    assert pooled["remote_num_tokens"] == src.remote_num_tokens
    assert (pooled["do_remote_decode"], pooled["do_remote_prefill"]) == (True, False)
    assert (pooled["tp_size"], pooled["pp_size"]) == (1, 1)
    assert pooled["remote_request_id"] in side.server.served
    # The pool keeps it ttl + the serve grace: past the registry's expiry of the moved retention.
    assert 60 + GRACE - 1 <= pooled["remote_blocks_expiry_time"] - before <= 60 + GRACE + 1
    assert 60 + GRACE - 1 <= moved.expire_time - time.time() <= 60 + GRACE + 1
    note = (side.memory.agent_name, f"{src.remote_request_id}:1".encode())
    await eventually(lambda: note in engine.notifications, what="the engine's notification")
    stats = side.mover.stats
    assert stats.moves[("park", "moved")] == 1 and stats.bytes["park"] == moved.bytes
    assert stats.reads == 1 and stats.read_buckets[-1] == 1


@pytest.mark.parametrize(
    ("call", "error", "reason", "field"),
    [
        (
            lambda m: m.park(retention(), source(remote_engine_id="engine-b"), ttl=60),
            FailedPrecondition,
            ErrorReason.NODE_MISMATCH,
            None,
        ),
        (
            lambda m: m.prefetch(retention(), "nodes/prefill-9", source(), ttl=60),
            FailedPrecondition,
            ErrorReason.NODE_MISMATCH,
            None,
        ),
        (
            lambda m: m.park(retention(), source(), ttl=0),
            InvalidArgument,
            ErrorReason.INVALID_ARGUMENT,
            "ttl",
        ),
        (
            lambda m: m.park(retention(), source(), ttl=3601),
            InvalidArgument,
            ErrorReason.INVALID_ARGUMENT,
            "ttl",
        ),
        (
            lambda m: m.park("tenants/t", source(), ttl=60),
            InvalidArgument,
            ErrorReason.INVALID_ARGUMENT,
            "retention",
        ),
        (
            lambda m: m.park(retention(), from_vllm({"remote_engine_id": "engine-a"}), ttl=60),
            InvalidArgument,
            ErrorReason.INVALID_ARGUMENT,
            "source.remote_request_id",
        ),
        (
            lambda m: m.park(retention(), source(remote_blocks_expiry_time=time.perf_counter() + 3), ttl=60),
            FailedPrecondition,
            ErrorReason.PIN_EXPIRED,
            None,
        ),
        (
            lambda m: m.park(retention(), source((5, 9)), ttl=60),
            InvalidArgument,
            ErrorReason.INVALID_ARGUMENT,
            None,
        ),
        (
            lambda m: m.park(retention(), source((0, 1, 2, 3, 4, 5, 6)), ttl=60),
            InvalidArgument,
            ErrorReason.INVALID_ARGUMENT,
            "blocks",
        ),
        (
            lambda m: m.prefetch(retention(), NODE, source(remote_host=None), ttl=60),
            InvalidArgument,
            ErrorReason.INVALID_ARGUMENT,
            "source.remote_host",
        ),
    ],
    ids=[
        "park-from-another-engine",
        "prefetch-for-another-node",
        "no-ttl",
        "ttl-over-the-maximum",
        "not-a-retention",
        "source-without-request-id",
        "pin-ends-before-a-read",
        "block-outside-the-engine",
        "more-blocks-than-the-pool",
        "prefetch-without-a-side-channel",
    ],
)
async def test_refused_moves_change_nothing(
    side: Side, engine: Engine, call: Any, error: type[KvshuttleError], reason: ErrorReason, field: str | None
) -> None:
    await asyncio.sleep(0.05)  # earlier tests' notifications in
    before = list(engine.notifications)
    with pytest.raises(error) as caught:
        await call(side.mover)
    assert caught.value.reason == reason
    if field is not None:
        assert caught.value.metadata.get("field") == field
    assert not side.pool.allocations() and not side.server.served and not side.registry.evicted
    await asyncio.sleep(0.05)
    assert engine.notifications == before


async def test_a_retention_already_in_the_pool_is_refused(side: Side) -> None:
    await side.mover.park(retention(), source((1,)), ttl=60)
    with pytest.raises(FailedPrecondition, match="already holds pool slots"):
        await side.mover.park(retention(), source((2,)), ttl=60)
    assert len(side.pool.allocations()) == 1


async def test_prefetch_reads_another_agents_pool_which_frees_its_copy(
    side: Side, engine: Engine, context: zmq.asyncio.Context
) -> None:
    """decode's agent parked it (side); the prefill node's agent (other) prefetches it from the
    parked copy, addressed to the decode agent's pool node as registered."""
    parked = await side.mover.park(retention(), source((3, 4)), ttl=60)
    other = await _side(engine, context)
    try:
        other.mover.node = "nodes/prefill-0"
        moved = await other.mover.prefetch(
            retention(), "nodes/prefill-0", parked.pooled, ttl=30, request_id="pf"
        )
        assert moved.bytes == parked.bytes and _same_bytes(other, moved, engine, (3, 4))
        assert to_vllm(moved.pooled)["remote_engine_id"] == other.server.engine_id
        # The read-done notification released the first pool's copy.
        await eventually(lambda: not side.pool.allocations() and not side.server.served, what="the release")
        assert side.server.reads == 1
        assert other.mover.stats.moves[("prefetch", "moved")] == 1
        assert other.pool.get(retention()).state is SlotState.PARKED
        assert set(other.parker.remotes) == {side.server.engine_id}  # the holder's agent, kept
    finally:
        await _close(other)


async def test_prefetch_checks_the_holders_handshake(
    side: Side, engine: Engine, context: zmq.asyncio.Context
) -> None:
    meta = replace(engine.handshake().metadata, block_size=16)
    channel = FakeSideChannel(context, meta)  # answers with the engine's hash, another block size
    try:
        with pytest.raises(NixlIncompatible, match="block_size"):
            await side.mover.prefetch(retention(), NODE, source(remote_port=channel.port), ttl=60)
        channel.metadata = None  # silent
        with pytest.raises(Unavailable):
            await side.mover.prefetch(retention(), NODE, source(remote_port=channel.port), ttl=60)
    finally:
        await channel.close()
    assert not side.pool.allocations()
    assert side.mover.stats.moves[("prefetch", "failed_precondition")] == 1
    assert side.mover.stats.moves[("prefetch", "unavailable")] == 1


async def test_prefetch_from_an_engine_over_its_side_channel(
    side: Side, engine: Engine, context: zmq.asyncio.Context
) -> None:
    channel = FakeSideChannel(context, engine.handshake().metadata)
    try:
        src = source((6,), remote_port=channel.port)
        moved = await side.mover.prefetch(retention(), NODE, src, ttl=60)
    finally:
        await channel.close()
    assert HASH == "ab" * 32  # FakeSideChannel's, the engine's
    assert _same_bytes(side, moved, engine, (6,))
    note = (side.memory.agent_name, f"{src.remote_request_id}:1".encode())
    await eventually(lambda: note in engine.notifications, what="the engine's notification")


async def test_pull_without_notifying_keeps_the_holders_copy(
    side: Side, engine: Engine, context: zmq.asyncio.Context
) -> None:
    channel = FakeSideChannel(context, engine.handshake().metadata)
    try:
        src = source((1, 2), remote_port=channel.port)
        moved = await side.mover.pull(src, ttl=60, notify_holder=False, request_id="pull-7")
    finally:
        await channel.close()
    assert moved.name == "pull/pull-7" and side.pool.get("pull/pull-7").blocks == 2
    assert _same_bytes(side, moved, engine, (1, 2))
    await asyncio.sleep(0.1)
    assert not any(m.startswith(src.remote_request_id.encode()) for _, m in engine.notifications)


async def test_a_repeated_request_gets_the_first_answer(side: Side, engine: Engine) -> None:
    src = source((0,))
    first, again = await asyncio.gather(
        side.mover.park(retention(), src, ttl=60, request_id="r-1"),
        side.mover.park(retention(), src, ttl=60, request_id="r-1"),
    )
    assert first is again
    assert await side.mover.park(retention(), src, ttl=60, request_id="r-1") is first
    assert side.mover.stats.moves[("park", "moved")] == 1 and side.mover.stats.reads == 1
    with pytest.raises(InvalidArgument) as reused:
        await side.mover.park(retention(), src, ttl=61, request_id="r-1")
    assert reused.value.reason == ErrorReason.REQUEST_ID_REUSED
    # A failed move is not remembered: its retry runs again.
    bad = source((1,), remote_blocks_expiry_time=time.perf_counter() + 2)
    for _ in range(2):
        with pytest.raises(FailedPrecondition):
            await side.mover.park(retention(2), bad, ttl=60, request_id="r-2")
    assert side.mover.stats.moves[("park", "pin_expired")] == 2
    # Bounded: the oldest answers are dropped (4 remembered here).
    for n in range(3, 8):
        await side.mover.park(retention(n), source((n,)), ttl=60, request_id=f"p-{n}")
        side.pool.release(retention(n))
    with pytest.raises(FailedPrecondition, match="already holds"):  # r-1 forgotten: runs again
        await side.mover.park(retention(), src, ttl=60, request_id="r-1")


class Clock:
    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


async def test_a_full_pool_evicts_the_oldest_idle_then_the_biggest_once_the_registry_let_them_go(
    engine: Engine, context: zmq.asyncio.Context
) -> None:
    clock = Clock()
    side = await _side(engine, context, monotonic=clock)
    try:
        await side.mover.park(retention(1), source((0,)), ttl=600)  # 1 slot, oldest
        clock.now += 1
        await side.mover.park(retention(2), source((1,)), ttl=600)  # 1 slot
        await side.mover.park(retention(3), source((2, 3, 4)), ttl=600)  # 3 slots, as idle as 2
        channel = FakeSideChannel(context, engine.handshake().metadata)
        try:  # a pull is never evicted
            await side.mover.pull(
                source((5,), remote_port=channel.port), ttl=600, notify_holder=False, request_id="keep"
            )
        finally:
            await channel.close()
        assert side.pool.stats().free_blocks == 0

        await side.mover.park(retention(4), source((6, 7)), ttl=600)  # needs 2: evicts 1, then 3

        assert side.registry.evicted == [(retention(1), POOL_NODE, True), (retention(3), POOL_NODE, True)]
        names = {a.name for a in side.pool.allocations()}
        assert names == {retention(2), retention(4), "pull/keep"}
        assert side.mover.stats.evictions["pool_full"] == 2
        assert {s.name for s in side.server.served.values()} == names  # the evicted withdrawn
    finally:
        await _close(side)


async def test_eviction_keeps_what_the_registry_keeps(engine: Engine, context: zmq.asyncio.Context) -> None:
    clock = Clock()
    side = await _side(engine, context, monotonic=clock)
    try:
        for n in range(1, 7):
            await side.mover.park(retention(n), source((n,)), ttl=600)
            clock.now += 1
        answers = side.registry.answers
        answers[retention(1)] = FailedPrecondition("claimed", reason=ErrorReason.RETENTION_ALREADY_CLAIMED)
        answers[retention(2)] = FailedPrecondition("elsewhere", reason=ErrorReason.NODE_MISMATCH)
        answers[retention(3)] = RegistryRefused("no", reason="PERMISSION_MISSING")
        answers[retention(4)] = NotFound("gone", reason=ErrorReason.RETENTION_NOT_FOUND)  # as good as evicted
        side.server.active = lambda name: name == retention(5)  # type: ignore[method-assign]  # a reader on it
        await side.mover.park(retention(7), source((0,)), ttl=600)
        assert [e[0] for e in side.registry.evicted] == [retention(n) for n in (1, 2, 3, 4)]
        assert retention(4) not in {a.name for a in side.pool.allocations()}

        # Unreachable: nothing is evicted and the move is refused, the source left untouched.
        answers[retention(6)] = Unavailable("registry down")
        src = source((1, 2))
        with pytest.raises(ResourceExhausted) as full:
            await side.mover.park(retention(8), src, ttl=600)
        assert full.value.reason == ErrorReason.CAPACITY_EXCEEDED and "registry" in full.value.message
        assert len(side.pool.allocations()) == 6
        stats = side.mover.stats
        assert stats.evictions["pool_full"] == 1
        assert stats.evictions_refused == {
            "retention_already_claimed": 2,
            "node_mismatch": 2,
            "permission_missing": 2,
            "registry_unavailable": 1,
        }
        await asyncio.sleep(0.05)
        assert not any(m.startswith(src.remote_request_id.encode()) for _, m in engine.notifications)
    finally:
        await _close(side)


async def test_expired_moves_are_counted(side: Side) -> None:
    await side.mover.park(retention(), source((1,)), ttl=60)
    expired = side.pool.expire(time.monotonic() + 60 + GRACE + 1)
    side.mover.expired(expired)
    assert side.mover.stats.evictions["expired"] == 1
    await eventually(lambda: not side.server.served, what="the server forgetting it")
