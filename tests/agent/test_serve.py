"""Serving the pool (kvshuttle.agent.pool.serve): its side channel on a real ZMQ ROUTER (127.0.0.1,
port 0), and a reader that plays vLLM's prefill with a NIXL agent of its own: handshake, READ of
the published slots with the read-done notification, heartbeats."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from tests.agent.engine_fakes import engine_metadata
from tests.agent.helpers import eventually
from tests.support.clock import FakeClock

from kvshuttle.agent.pool.blocks import Allocation, BlockPool, PoolLayout, SlotState
from kvshuttle.agent.pool.nixl_memory import NixlPoolMemory
from kvshuttle.agent.pool.serve import PREFILL_EXPIRY_MARGIN, PoolServer, Served
from kvshuttle.agent.pool.side_channel import Handshake, fetch_handshake
from kvshuttle.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from kvshuttle.vllm.nixl_layout import RemoteLayout
from kvshuttle.vllm.nixl_wire import (
    ClockOffset,
    NixlHandshakePayload,
    encode_agent_metadata,
    encode_get_meta_request,
    heartbeat_message,
    read_done_message,
)
from kvshuttle.vllm.shared_reads import shared_read_id

ENGINE = PoolLayout(regions=2, blocks=16, block_bytes=8 * 1024)
POOL = PoolLayout(regions=2, blocks=6, block_bytes=8 * 1024)
HASH = "cd" * 32
NAME = "tenants/t/conversations/c/retentions/1"


def engine_handshake(**changes: Any) -> Handshake:
    meta = dataclasses.replace(engine_metadata(ENGINE, agent_metadata=b"engine-blob"), **changes)
    return Handshake(
        payload=NixlHandshakePayload(HASH, encode_agent_metadata(meta)),
        metadata=meta,
        layout=RemoteLayout.of(meta),
        clock=ClockOffset(offset=0.0, rtt=0.0),
    )


@pytest.fixture
def memory() -> Iterator[NixlPoolMemory]:
    m = NixlPoolMemory(POOL, agent_name=f"agent-{uuid.uuid4().hex[:8]}")
    yield m
    m.close()


@pytest.fixture
def reader() -> Iterator[NixlPoolMemory]:
    m = NixlPoolMemory(POOL, agent_name=f"prefill-{uuid.uuid4().hex[:8]}")
    yield m
    m.close()


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def _parked(
    pool: BlockPool,
    memory: NixlPoolMemory,
    blocks: int = 3,
    name: str = NAME,
    *,
    expire_at: float | None = None,
) -> Allocation:
    expire_at = time.monotonic() + 60 if expire_at is None else expire_at
    allocation = pool.allocate(name, blocks, expire_at=expire_at)
    rng = np.random.default_rng(5)
    for region in range(POOL.regions):
        for slot in allocation.slots:
            memory.block(region, slot)[:] = rng.integers(0, 256, POOL.block_bytes, dtype=np.uint8)
    return pool.seal(name)


def _served(server: PoolServer, read_id: str) -> Served:
    return server.served[read_id]


async def _server(
    pool: BlockPool, memory: NixlPoolMemory, context: zmq.asyncio.Context, **kwargs: Any
) -> AsyncIterator[PoolServer]:
    server = PoolServer(pool, memory, engine_handshake(), context, host="127.0.0.1", **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(POOL)


@pytest.fixture
async def server(
    pool: BlockPool, memory: NixlPoolMemory, context: zmq.asyncio.Context
) -> AsyncIterator[PoolServer]:
    async for s in _server(pool, memory, context):
        yield s


async def test_the_handshake_describes_the_pool_in_the_engines_layout(
    server: PoolServer, memory: NixlPoolMemory, context: zmq.asyncio.Context
) -> None:
    got = await fetch_handshake(context, "127.0.0.1", server.port, expected_hash=HASH, reply_timeout=5)
    engine = engine_handshake().metadata
    meta = got.metadata
    assert meta.engine_id == server.engine_id != engine.engine_id
    assert meta.agent_metadata == memory.metadata()
    assert meta.kv_caches_base_addr == (memory.base_address, memory.base_address + POOL.region_bytes)
    assert (meta.num_blocks, meta.region_num_blocks) == (POOL.blocks, (POOL.blocks,) * POOL.regions)
    assert meta.block_strides == (POOL.block_bytes,) * POOL.regions
    kept = ("block_lens", "region_names", "kv_cache_layout", "block_size", "attn_backend_name", "device_id")
    assert all(getattr(meta, f) == getattr(engine, f) for f in kept)
    assert got.layout.descriptor(1, 2) == tuple(int(v) for v in memory.descriptors([2])[1])
    assert abs(got.clock.offset) < 1.0  # the agent's perf_counter stamps the reply
    assert meta.region_mem_types == ("DRAM",) * POOL.regions


async def test_the_pool_is_advertised_as_host_memory_whatever_the_engines_cache_is(
    pool: BlockPool, memory: NixlPoolMemory, context: zmq.asyncio.Context
) -> None:
    engine = engine_handshake(region_mem_types=("VRAM",) * ENGINE.regions)
    server = PoolServer(pool, memory, engine, context, host="127.0.0.1")
    await server.start()
    try:
        got = await fetch_handshake(context, "127.0.0.1", server.port, reply_timeout=5)
        assert got.metadata.region_mem_types == ("DRAM",) * POOL.regions and got.layout.mem_type == "DRAM"
        assert server.serving
    finally:
        await server.close()
    assert not server.serving


async def test_malformed_requests_and_other_ranks_get_no_answer(
    server: PoolServer, context: zmq.asyncio.Context
) -> None:
    with pytest.raises(Unavailable):
        await fetch_handshake(context, "127.0.0.1", server.port, tp_rank=1, reply_timeout=0.3)
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://127.0.0.1:{server.port}")
    for frames in (
        [b"", b"\xc1not msgpack"],
        [b"", msgpack.packb([b"get_meta", 0, 0])],
        [b"", msgpack.packb([b"get_meta_msg", 0, -1])],
        [b"", encode_get_meta_request(1, 0)],
        [b"no-delimiter", encode_get_meta_request()],
        [b"", encode_get_meta_request(), b"extra"],
    ):
        await raw.send_multipart(frames)
    await eventually(lambda: server.refused == 7, what="the refusals")
    await raw.send_multipart([b"", b"x" * 4096])  # over MAXMSGSIZE: the connection drops
    await asyncio.sleep(0.1)
    raw.close(linger=0)
    assert server.refused == 7 and server.answered == 0
    got = await fetch_handshake(context, "127.0.0.1", server.port, reply_timeout=5)
    assert got.metadata.engine_id == server.engine_id and server.answered == 1


def _read(reader: NixlPoolMemory, served: Handshake, block_ids: list[int], notification: bytes) -> str:
    """What prefill does: add the agent, READ the blocks with the read-done notification."""
    agent = reader.agent
    remote = agent.add_remote_agent(served.metadata.agent_metadata)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", reader.descriptors(range(len(block_ids))), "DRAM")
    theirs = agent.prep_xfer_dlist(remote, served.layout.descriptors(block_ids), "DRAM")
    rows = list(range(POOL.regions * len(block_ids)))
    handle = agent.make_prepped_xfer("READ", local, rows, theirs, rows, notification)
    state = agent.transfer(handle)
    deadline = time.monotonic() + 10
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
        state = agent.check_xfer_state(handle)
    for held in (handle, theirs, local):
        held.release()
    return str(state)


async def _send(reader: NixlPoolMemory, served: Handshake, message: bytes) -> None:
    """A notification as prefill sends it (a heartbeat, or a read-done without a READ)."""

    def send() -> None:
        reader.agent.send_notif(reader.agent.add_remote_agent(served.metadata.agent_metadata), message)
        # No progress thread: the message (and the connection) moves only while polled.
        until = time.monotonic() + 0.3
        while time.monotonic() < until:
            reader.progress()
            time.sleep(0.001)

    await asyncio.to_thread(send)


def _assert_read(reader: NixlPoolMemory, memory: NixlPoolMemory, parked: Allocation) -> None:
    """The reader's blocks 0.. hold `parked`'s slots, byte for byte, in every region."""
    for region in range(POOL.regions):
        for i, slot in enumerate(parked.slots):
            assert np.array_equal(reader.block(region, i), memory.block(region, slot))


async def test_a_read_and_its_notification_release_the_slots(
    server: PoolServer,
    pool: BlockPool,
    memory: NixlPoolMemory,
    reader: NixlPoolMemory,
    context: zmq.asyncio.Context,
) -> None:
    parked = _parked(pool, memory)
    before = time.perf_counter()
    params = server.publish(NAME, 3 * 32 - 4)
    assert pool.get(NAME).state is SlotState.PARKED  # the registry's claim guards it, not the pool
    assert params["remote_engine_id"] == server.engine_id
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", server.port)
    assert params["remote_block_ids"] == [list(parked.slots)] and params["remote_num_tokens"] == 92
    assert (params["do_remote_decode"], params["do_remote_prefill"]) == (True, False)
    # The allocation's own expiry, on the agent's perf_counter.
    assert 59.0 <= params["remote_blocks_expiry_time"] - before <= 60.5
    assert params["remote_request_id"].startswith("kvshuttle-pool-")
    served = await fetch_handshake(context, "127.0.0.1", server.port, reply_timeout=5)

    notification = read_done_message(params["remote_request_id"], 1)
    state = await asyncio.to_thread(_read, reader, served, list(parked.slots), notification)

    assert state == "DONE"
    _assert_read(reader, memory, parked)
    await eventually(lambda: not pool.allocations(), what="the slots released")
    assert not server.served and server.reads == 1


async def test_shared_readers_read_the_same_slots_and_free_nothing(
    server: PoolServer,
    pool: BlockPool,
    memory: NixlPoolMemory,
    reader: NixlPoolMemory,
    context: zmq.asyncio.Context,
) -> None:
    parked = _parked(pool, memory)
    read_id = server.publish(NAME, 3 * 32)["remote_request_id"]
    served = await fetch_handshake(context, "127.0.0.1", server.port, reply_timeout=5)
    for claim in ("claim-1", "claim-2"):  # two forks, each with its own shared claim
        shared = shared_read_id(read_id, claim)
        await _send(reader, served, heartbeat_message([shared]))
        notification = read_done_message(shared, 1)
        state = await asyncio.to_thread(_read, reader, served, list(parked.slots), notification)
        assert state == "DONE"
        _assert_read(reader, memory, parked)
    await eventually(lambda: server.shared_reads == 2, what="both shared read-dones")
    assert pool.get(NAME).state is SlotState.PARKED and server.active(NAME)
    assert server.reads == 0 and read_id in server.served
    # A single-use reader's read-done (its plain read id) still frees the slots.
    await _send(reader, served, read_done_message(read_id, 1))
    await eventually(lambda: not pool.allocations(), what="the slots released")
    assert server.reads == 1


async def test_slots_wait_for_every_consumer_and_ignore_strangers(
    server: PoolServer,
    pool: BlockPool,
    memory: NixlPoolMemory,
    reader: NixlPoolMemory,
    context: zmq.asyncio.Context,
) -> None:
    _parked(pool, memory)
    request_id = server.publish(NAME, 1)["remote_request_id"]
    served = await fetch_handshake(context, "127.0.0.1", server.port, reply_timeout=5)
    for message in (b"\xff\xfe", b"no-colon", read_done_message("cmpl-unknown", 1)):
        await _send(reader, served, message)
    await _send(reader, served, read_done_message(request_id, 2))
    await eventually(
        lambda: server.served.get(request_id, None) is not None and server.served[request_id].notified == 1
    )
    await asyncio.sleep(0.1)
    assert pool.get(NAME).state is SlotState.PARKED and server.active(NAME)  # a reader is on it
    await _send(reader, served, read_done_message(request_id, 2))
    await eventually(lambda: not pool.allocations(), what="the slots released")
    assert not server.active(NAME)


async def test_heartbeats_hold_the_allocation_and_expiry_forgets_it(
    pool: BlockPool, memory: NixlPoolMemory, reader: NixlPoolMemory, context: zmq.asyncio.Context
) -> None:
    clock = FakeClock(1000.0)
    async for server in _server(
        pool, memory, context, lease=6.0, grace=1.0, clock=clock.now, monotonic=clock.now
    ):
        _parked(pool, memory, expire_at=1006.0)
        params = server.publish(NAME, 1)
        assert params["remote_blocks_expiry_time"] == 1006.0
        assert not server.active(NAME)
        served = await fetch_handshake(context, "127.0.0.1", server.port, reply_timeout=5)
        clock.advance(3.0)
        request_id = params["remote_request_id"]
        await _send(reader, served, heartbeat_message(["other", request_id]))
        await eventually(lambda: pool.get(NAME).expire_at == 1010.0, what="the renewal")
        assert server.active(NAME) and _served(server, request_id).active_until == 1010.0
        assert not pool.expire(1009.0)
        clock.advance(7.5)
        assert not server.active(NAME)
        assert [a.name for a in pool.expire(clock.now())] == [NAME]
        await eventually(lambda: not server.served, what="the expired allocation forgotten")  # noqa: B023
        # A late read-done for it releases nothing (the name may hold other slots by now).
        _parked(pool, memory, blocks=2, expire_at=2000.0)
        await _send(reader, served, read_done_message(request_id, 1))
        await asyncio.sleep(0.1)
        assert pool.get(NAME).blocks == 2 and server.reads == 0


async def test_publishing_refuses_what_it_cannot_serve(
    server: PoolServer, pool: BlockPool, memory: NixlPoolMemory, context: zmq.asyncio.Context
) -> None:
    pool.allocate("filling", 1, expire_at=1e9)
    with pytest.raises(FailedPrecondition, match="not sealed"):
        server.publish("filling", 1)
    with pytest.raises(NotFound):
        server.publish("nothing", 1)
    _parked(pool, memory)
    with pytest.raises(InvalidArgument, match="num_tokens"):
        server.publish(NAME, 3 * 32 + 1)
    first = server.publish(NAME, 1)["remote_request_id"]
    with pytest.raises(FailedPrecondition, match="served already"):
        server.publish(NAME, 1)
    assert list(server.served) == [first]
    server.withdraw(NAME)
    assert not server.served
    assert server.publish(NAME, 1)["remote_request_id"] != first
    with pytest.raises(ValueError, match="margin"):
        PoolServer(pool, memory, engine_handshake(), context, host="127.0.0.1", lease=PREFILL_EXPIRY_MARGIN)
    with pytest.raises(FailedPrecondition, match="block_bytes"):
        PoolServer(pool, memory, engine_handshake(block_lens=(4096, 4096)), context, host="127.0.0.1")
