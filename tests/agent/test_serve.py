"""Serving the pool (kvshuttle.agent.serve): its side channel on a real ZMQ ROUTER (127.0.0.1,
port 0), and a reader that plays vLLM's prefill with a NIXL agent of its own: handshake, READ of
the advertised slots with the read-done notification, heartbeats."""

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
from tests.agent.helpers import engine_metadata, eventually
from tests.clock import FakeClock

from kvshuttle.agent.block_pool import Allocation, BlockPool, PoolLayout, SlotState
from kvshuttle.agent.nixl_memory import NixlPoolMemory
from kvshuttle.agent.serve import PREFILL_EXPIRY_MARGIN, PoolServer
from kvshuttle.agent.side_channel import Handshake, fetch_handshake
from kvshuttle.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvshuttle.vllm.nixl_layout import RemoteLayout
from kvshuttle.vllm.nixl_wire import (
    ClockOffset,
    NixlHandshakePayload,
    encode_agent_metadata,
    encode_get_meta_request,
    heartbeat_message,
    read_done_message,
)

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


def _parked(pool: BlockPool, memory: NixlPoolMemory, blocks: int = 3, name: str = NAME) -> Allocation:
    allocation = pool.allocate(name, blocks, expire_at=1e9)
    rng = np.random.default_rng(5)
    for region in range(POOL.regions):
        for slot in allocation.slots:
            memory.block(region, slot)[:] = rng.integers(0, 256, POOL.block_bytes, dtype=np.uint8)
    return pool.seal(name)


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


async def test_a_read_and_its_notification_release_the_slots(
    server: PoolServer,
    pool: BlockPool,
    memory: NixlPoolMemory,
    reader: NixlPoolMemory,
    context: zmq.asyncio.Context,
) -> None:
    parked = _parked(pool, memory)
    before = time.perf_counter()
    params = server.serve(NAME, 3 * 32 - 4)
    assert pool.get(NAME).state is SlotState.CLAIMED
    assert params["remote_engine_id"] == server.engine_id
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", server.port)
    assert params["remote_block_ids"] == [list(parked.slots)] and params["remote_num_tokens"] == 92
    assert (params["do_remote_decode"], params["do_remote_prefill"]) == (True, False)
    assert params["remote_blocks_expiry_time"] - before >= 30.0 > PREFILL_EXPIRY_MARGIN
    served = await fetch_handshake(context, "127.0.0.1", server.port, reply_timeout=5)

    notification = read_done_message(params["remote_request_id"], 1)
    state = await asyncio.to_thread(_read, reader, served, list(parked.slots), notification)

    assert state == "DONE"
    for region in range(POOL.regions):
        for i, slot in enumerate(parked.slots):
            assert np.array_equal(reader.block(region, i), memory.block(region, slot))
    await eventually(lambda: not pool.allocations(), what="the slots released")
    assert not server.served


async def test_slots_wait_for_every_consumer_and_ignore_strangers(
    server: PoolServer,
    pool: BlockPool,
    memory: NixlPoolMemory,
    reader: NixlPoolMemory,
    context: zmq.asyncio.Context,
) -> None:
    _parked(pool, memory)
    request_id = server.serve(NAME, 1)["remote_request_id"]
    served = await fetch_handshake(context, "127.0.0.1", server.port, reply_timeout=5)
    for message in (b"\xff\xfe", b"no-colon", read_done_message("cmpl-unknown", 1)):
        await _send(reader, served, message)
    await _send(reader, served, read_done_message(request_id, 2))
    await eventually(
        lambda: server.served.get(request_id, None) is not None and server.served[request_id].notified == 1
    )
    await asyncio.sleep(0.1)
    assert pool.get(NAME).state is SlotState.CLAIMED
    await _send(reader, served, read_done_message(request_id, 2))
    await eventually(lambda: not pool.allocations(), what="the slots released")


async def test_heartbeats_renew_and_an_unread_retention_expires(
    pool: BlockPool, memory: NixlPoolMemory, reader: NixlPoolMemory, context: zmq.asyncio.Context
) -> None:
    clock = FakeClock(1000.0)
    async for server in _server(pool, memory, context, lease=6.0, grace=1.0, clock=clock.now):
        _parked(pool, memory)
        params = server.serve(NAME, 1)
        assert params["remote_blocks_expiry_time"] == 1006.0
        served = await fetch_handshake(context, "127.0.0.1", server.port, reply_timeout=5)
        clock.advance(6.5)  # past the advertised expiry, within the grace
        await _send(reader, served, heartbeat_message(["other", params["remote_request_id"]]))
        request_id = params["remote_request_id"]
        await eventually(lambda: server.served[request_id].hold_until == 1013.5, what="the renewal")  # noqa: B023
        clock.advance(6.5)
        await asyncio.sleep(0.2)
        assert pool.get(NAME).state is SlotState.CLAIMED
        clock.advance(0.5)
        await eventually(lambda: not pool.allocations(), what="the expired retention released")
        assert not server.served


async def test_serving_refuses_what_it_cannot_serve(
    server: PoolServer, pool: BlockPool, memory: NixlPoolMemory, context: zmq.asyncio.Context
) -> None:
    pool.allocate("filling", 1, expire_at=1e9)
    with pytest.raises(FailedPrecondition):
        server.serve("filling", 1)
    _parked(pool, memory)
    with pytest.raises(InvalidArgument, match="num_tokens"):
        server.serve(NAME, 3 * 32 + 1)
    server.serve(NAME, 1)
    with pytest.raises(FailedPrecondition):  # already claimed by a reader
        server.serve(NAME, 1)
    assert len(server.served) == 1
    with pytest.raises(ValueError, match="margin"):
        PoolServer(pool, memory, engine_handshake(), context, host="127.0.0.1", lease=PREFILL_EXPIRY_MARGIN)
    with pytest.raises(FailedPrecondition, match="block_bytes"):
        PoolServer(pool, memory, engine_handshake(block_lens=(4096, 4096)), context, host="127.0.0.1")
