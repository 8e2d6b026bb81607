"""Parking a retention: a real NIXL READ (UCX, in this process) from a stand-in engine, whose
KV memory is a NixlPoolMemory advertised as vLLM's CPU build advertises its cache, polled by a
thread of its own as vLLM's worker is. Failures are forced by replacing one NIXL call."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from tests.agent.helpers import eventually
from tests.agent.nixl_engine import ENGINE, Engine

from kvshuttle.agent.pool.blocks import BlockPool, PoolLayout, SlotState
from kvshuttle.agent.pool.nixl_memory import NixlPoolMemory
from kvshuttle.agent.pool.park import QUARANTINE, Parker, RetainedBlocks
from kvshuttle.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.vllm.kv_transfer_params import from_vllm

POOL = PoolLayout(regions=2, blocks=6, block_bytes=16 * 1024)
NAME = "tenants/t/conversations/c/retentions/1"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.close()


@pytest.fixture
def memory() -> Iterator[NixlPoolMemory]:
    m = NixlPoolMemory(POOL, agent_name=f"agent-{uuid.uuid4().hex[:8]}")
    yield m
    m.close()


def retained(block_ids: tuple[int, ...] = (5, 2, 7), *, pin: float = 100.0, **changes: Any) -> RetainedBlocks:
    params = {
        "do_remote_decode": True,
        "remote_engine_id": "engine-a",
        "remote_request_id": "cmpl-1-0",
        "remote_block_ids": [list(block_ids)],
        "remote_num_tokens": 32 * len(block_ids) - 5,
        "remote_blocks_expiry_time": time.perf_counter() + pin,
        **changes,
    }
    return RetainedBlocks.of(from_vllm(params))


async def test_park_moves_the_blocks_bit_for_bit_and_frees_them_on_the_engine(
    engine: Engine, memory: NixlPoolMemory
) -> None:
    pool = BlockPool(POOL)
    parker = Parker(pool, memory)
    for request, blocks in (("cmpl-1-0", (5, 2, 7)), ("cmpl-2-0", (0,))):
        name = f"{NAME}{request}"
        parked = await parker.park(
            name, retained(blocks, remote_request_id=request), engine.handshake(), expire_at=1e9
        )
        assert parked.allocation.state is SlotState.PARKED and parked.allocation.expire_at == 1e9
        assert parked.bytes == len(blocks) * ENGINE.regions * ENGINE.block_bytes
        assert parked.num_tokens == 32 * len(blocks) - 5 and parked.read_seconds > 0
        for region in range(ENGINE.regions):
            for slot, block in zip(parked.allocation.slots, blocks, strict=True):
                assert np.array_equal(memory.block(region, slot), engine.memory.block(region, block))
        note = (memory.agent_name, f"{request}:1".encode())
        await eventually(lambda n=note: n in engine.notifications, what="the engine's notification")  # type: ignore[misc]
    assert pool.stats().parked_retentions == 2


@pytest.mark.parametrize(
    ("make", "error", "reason"),
    [
        (
            lambda e: (retained(remote_engine_id="engine-b"), e.handshake()),
            FailedPrecondition,
            "NODE_MISMATCH",
        ),
        (lambda e: (retained(pin=10.5), e.handshake()), FailedPrecondition, "PIN_EXPIRED"),
        (lambda e: (retained((5, 8)), e.handshake()), InvalidArgument, "INVALID_ARGUMENT"),
        (lambda e: (retained(remote_num_tokens=200), e.handshake()), InvalidArgument, "INVALID_ARGUMENT"),
        (
            lambda e: (retained(), e.handshake(block_lens=(8192, 8192), block_strides=(8192, 8192))),
            FailedPrecondition,
            "FAILED_PRECONDITION",
        ),
    ],
    ids=["other-engine", "pin-ends-within-the-deadline", "block-outside", "too-few-blocks", "layout"],
)
async def test_refusals_change_nothing(
    engine: Engine, memory: NixlPoolMemory, make: Any, error: type[Exception], reason: str
) -> None:
    pool = BlockPool(POOL)
    parker = Parker(pool, memory, timeout=10.0, expiry_margin=1.0)
    blocks, handshake = make(engine)
    with pytest.raises(error) as caught:
        await parker.park(NAME, blocks, handshake, expire_at=1e9)
    assert getattr(caught.value, "reason", None) == ErrorReason(reason)
    assert pool.stats().used_blocks == 0 and not pool.allocations()


def test_retained_blocks_need_every_field() -> None:
    with pytest.raises(InvalidArgument, match="remote_blocks_expiry_time: missing"):
        RetainedBlocks.of(
            from_vllm({"remote_engine_id": "e", "remote_request_id": "r", "remote_num_tokens": 1})
        )
    with pytest.raises(InvalidArgument, match="one non-empty KV-cache group"):
        retained(remote_block_ids=[[1], [2]])


async def _fails(parker: Parker, pool: BlockPool, engine: Engine, match: str) -> None:
    with pytest.raises(Unavailable, match=match):
        await parker.park(NAME, retained(), engine.handshake(), expire_at=1e9)
    assert pool.stats().used_blocks == 0 and not pool.allocations()


async def test_a_timed_out_read_releases_its_slots(
    engine: Engine, memory: NixlPoolMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory.agent, "check_xfer_state", lambda handle: "PROC")
    monkeypatch.setattr(memory.agent, "transfer", lambda handle: "PROC")
    pool = BlockPool(POOL)
    started = time.monotonic()
    await _fails(Parker(pool, memory, timeout=0.2), pool, engine, "timed out")
    assert 0.2 <= time.monotonic() - started < 2


async def test_a_failed_read_releases_its_slots(
    engine: Engine, memory: NixlPoolMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory.agent, "transfer", lambda handle: "ERR")
    pool = BlockPool(POOL)
    await _fails(Parker(pool, memory), pool, engine, "NIXL READ failed")


async def test_nixl_refusing_the_engines_memory_releases_the_slots(
    engine: Engine, memory: NixlPoolMemory
) -> None:
    pool = BlockPool(POOL)
    parker = Parker(pool, memory)
    # Base addresses the engine's NIXL agent never registered.
    wrong = engine.handshake(kv_caches_base_addr=(1 << 40, (1 << 40) + ENGINE.region_bytes))
    with pytest.raises(Unavailable, match="nixlNotFoundError"):
        await parker.park(NAME, retained(), wrong, expire_at=1e9)
    assert pool.stats().used_blocks == 0


class _Uncancellable:
    """A transfer handle NIXL cannot release (cancel) while it runs."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._handle = handle._handle

    def release(self) -> None:
        raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")


async def test_a_read_nixl_cannot_cancel_keeps_its_slots_until_expiry(
    engine: Engine, memory: NixlPoolMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = memory.agent
    real = agent.make_prepped_xfer
    handles: list[_Uncancellable] = []

    def make(*args: Any) -> _Uncancellable:
        handles.append(_Uncancellable(real(*args)))
        return handles[-1]

    monkeypatch.setattr(agent, "make_prepped_xfer", make)
    monkeypatch.setattr(agent, "check_xfer_state", lambda handle: "PROC")
    pool = BlockPool(POOL)
    parker = Parker(pool, memory, timeout=0.2)
    before = time.monotonic()
    with pytest.raises(Unavailable, match="could not cancel"):
        await parker.park(NAME, retained(), engine.handshake(), expire_at=1e9)
    (stuck,) = pool.allocations()
    assert stuck.state is SlotState.FILLING and stuck.blocks == 3
    assert before + 0.2 + QUARANTINE <= stuck.expire_at <= time.monotonic() + QUARANTINE
    handles[0].handle.release()


async def test_a_cancelled_park_frees_its_slots_once_the_read_stopped(
    engine: Engine, memory: NixlPoolMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory.agent, "check_xfer_state", lambda handle: "PROC")
    pool = BlockPool(POOL)
    parker = Parker(pool, memory, timeout=0.5)
    task = asyncio.create_task(parker.park(NAME, retained(), engine.handshake(), expire_at=1e9))
    await eventually(lambda: pool.stats().used_blocks == 3, what="the allocation")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.stats().filling_retentions == 1  # the READ still runs in its thread
    await eventually(lambda: pool.stats().used_blocks == 0, what="the slots freed")


async def test_holders_agents_are_kept_by_engine_id_and_bounded(
    engine: Engine, memory: NixlPoolMemory
) -> None:
    pool = BlockPool(POOL)
    parker = Parker(pool, memory, max_remotes=1)
    for engine_id in ("engine-a", "engine-b"):
        blocks = retained((1,), remote_engine_id=engine_id, remote_request_id=f"{engine_id}-1")
        await parker.park(f"{NAME}{engine_id}", blocks, engine.handshake(engine_id=engine_id), expire_at=1e9)
    assert list(parker.remotes) == ["engine-b"]


async def test_a_read_without_notification_leaves_the_holders_blocks(
    engine: Engine, memory: NixlPoolMemory
) -> None:
    pool = BlockPool(POOL)
    parked = await Parker(pool, memory).park(
        NAME, retained((3,), remote_request_id="quiet-1"), engine.handshake(), expire_at=1e9, notify=False
    )
    assert np.array_equal(memory.block(1, parked.allocation.slots[0]), engine.memory.block(1, 3))
    await asyncio.sleep(0.1)
    assert not [m for _, m in engine.notifications if m.startswith(b"quiet-1")]
