"""The pool's host memory, registered with NIXL: a real READ between two NIXL agents (UCX,
DRAM, no progress thread) in this process copies slots bit for bit, region by region."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvshuttle.agent.pool.blocks import BlockPool, PoolLayout
from kvshuttle.agent.pool.nixl_memory import NixlPoolMemory
from kvshuttle.core.errors import FailedPrecondition

LAYOUT = PoolLayout(regions=3, blocks=6, block_bytes=16 * 1024)


def _memory() -> NixlPoolMemory:
    return NixlPoolMemory(LAYOUT, agent_name=f"test-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def holder() -> Iterator[NixlPoolMemory]:
    memory = _memory()
    yield memory
    memory.close()


@pytest.fixture
def reader() -> Iterator[NixlPoolMemory]:
    memory = _memory()
    yield memory
    memory.close()


def test_memory_is_page_aligned_and_described_region_major(holder: NixlPoolMemory) -> None:
    assert holder.base_address % 4096 == 0
    rows = holder.descriptors([4, 1])
    base = holder.base_address
    assert rows.tolist() == [
        [base + LAYOUT.offset(region, slot), LAYOUT.block_bytes, 0] for region in range(3) for slot in (4, 1)
    ]
    assert holder.descriptors().shape == (LAYOUT.regions * LAYOUT.blocks, 3)
    with pytest.raises(IndexError):
        holder.descriptors([6])


def test_a_sealed_allocation_is_never_a_write_destination(holder: NixlPoolMemory) -> None:
    pool = BlockPool(LAYOUT)
    filling = pool.allocate("r/a", 2, expire_at=1.0)
    assert holder.write_descriptors(filling).shape == (6, 3)
    with pytest.raises(FailedPrecondition):
        holder.write_descriptors(pool.seal("r/a"))


def test_nixl_read_copies_slots_bit_for_bit(holder: NixlPoolMemory, reader: NixlPoolMemory) -> None:
    rng = np.random.default_rng(7)
    for region in range(LAYOUT.regions):
        for slot in range(LAYOUT.blocks):
            holder.block(region, slot)[:] = rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)

    # The reader parks slots 1 and 4 of the holder into two slots of its own pool.
    pool = BlockPool(LAYOUT)
    allocation = pool.allocate("tenants/t/conversations/c/retentions/1", 2, expire_at=60.0)
    source_slots = [1, 4]
    remote = reader.agent.add_remote_agent(holder.metadata())
    local_side = reader.agent.prep_xfer_dlist("NIXL_INIT_AGENT", reader.write_descriptors(allocation), "DRAM")
    remote_side = reader.agent.prep_xfer_dlist(remote, holder.descriptors(source_slots), "DRAM")
    count = LAYOUT.regions * len(source_slots)
    handle = reader.agent.make_prepped_xfer(
        "READ", local_side, list(range(count)), remote_side, list(range(count)), b"park:1"
    )
    state = reader.agent.transfer(handle)
    deadline = time.monotonic() + 10
    notifs: dict[str, list[bytes]] = {}
    while state == "PROC" and time.monotonic() < deadline:
        state = reader.agent.check_xfer_state(handle)
        # No progress thread: the holder's side moves only while it is polled.
        for name, messages in holder.progress().items():
            notifs.setdefault(name, []).extend(messages)
    assert state == "DONE"
    handle.release()
    while not notifs and time.monotonic() < deadline:
        notifs = holder.progress()
    assert notifs == {reader.agent_name: [b"park:1"]}
    pool.seal(allocation.name)

    for region in range(LAYOUT.regions):
        for mine, theirs in zip(allocation.slots, source_slots, strict=True):
            assert np.array_equal(reader.block(region, mine), holder.block(region, theirs))
        untouched = set(range(LAYOUT.blocks)) - set(allocation.slots)
        assert all(not reader.block(region, slot).any() for slot in untouched)
    local_side.release()
    remote_side.release()


async def test_pumped_notifications_are_kept_bounded_on_the_nixl_thread(reader: NixlPoolMemory) -> None:
    holder = NixlPoolMemory(LAYOUT, agent_name=f"test-{uuid.uuid4().hex[:8]}", max_pending_notifications=2)
    try:
        remote = reader.agent.add_remote_agent(holder.metadata())
        for i in range(3):
            reader.agent.send_notif(remote, f"n{i}".encode())
        deadline = time.monotonic() + 10
        # Both sides move only while polled (no progress threads); the holder's on its thread.
        while holder.dropped_notifications == 0 and time.monotonic() < deadline:
            reader.progress()
            await holder.run(holder.pump)
        # Nothing taken meanwhile: of three, the oldest was dropped.
        assert holder.dropped_notifications == 1
        assert holder.take_notifications() == [(reader.agent_name, b"n1"), (reader.agent_name, b"n2")]
        assert holder.take_notifications() == []
    finally:
        holder.close()
