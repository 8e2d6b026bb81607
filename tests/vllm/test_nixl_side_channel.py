"""kvshuttle.agent.pool.side_channel against a ROUTER that answers as vLLM 0.32's handshake listener
does (identity, empty delimiter, payload frame, perf_counter frame), or misbehaves."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest
import zmq
import zmq.asyncio
from tests.vllm.nixl_samples import HASH, META

from kvshuttle.agent.pool.side_channel import fetch_handshake, side_channel_endpoint, verify_engine
from kvshuttle.core.errors import InvalidArgument, Unavailable
from kvshuttle.vllm.nixl_compat import Expected
from kvshuttle.vllm.nixl_wire import (
    MAX_HANDSHAKE_BYTES,
    NixlHandshakePayload,
    NixlIncompatible,
    decode_get_meta_request,
    encode_agent_metadata,
    encode_handshake_payload,
    encode_handshake_reply,
)

Answer = Callable[[bytes], list[bytes] | None]  # request -> reply frames (None: stay silent)


def vllm_like(request: bytes) -> list[bytes]:
    assert decode_get_meta_request(request) == (0, 0)
    payload = encode_handshake_payload(NixlHandshakePayload(HASH, encode_agent_metadata(META)))
    return encode_handshake_reply(payload, time.perf_counter() + 1000.0)


@contextlib.asynccontextmanager
async def listener(ctx: zmq.asyncio.Context, answer: Answer) -> AsyncIterator[int]:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        while True:
            identity, _, request = await sock.recv_multipart()
            frames = answer(request)
            if frames is not None:
                await sock.send_multipart([identity, b"", *frames])

    task = asyncio.create_task(serve())
    try:
        yield port
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close(linger=0)


@pytest.fixture
def ctx() -> zmq.asyncio.Context:
    return zmq.asyncio.Context.instance()


async def test_fetch_decodes_the_handshake_and_the_clock(ctx: zmq.asyncio.Context) -> None:
    async with listener(ctx, vllm_like) as port:
        hs = await fetch_handshake(ctx, "127.0.0.1", port, expected_hash=HASH)
    assert hs.metadata == META and hs.payload.compatibility_hash == HASH
    assert 0 <= hs.clock.rtt < 1.0
    assert abs(hs.clock.offset - 1000.0) <= hs.clock.rtt  # the listener's clock is ours + 1000 s


async def test_a_silent_side_channel_is_unavailable(ctx: zmq.asyncio.Context) -> None:
    async with listener(ctx, lambda _: None) as port:
        began = time.monotonic()
        with pytest.raises(Unavailable):
            await fetch_handshake(ctx, "127.0.0.1", port, reply_timeout=0.2)
    assert time.monotonic() - began < 2.0


async def test_an_oversized_reply_is_dropped_not_read(ctx: zmq.asyncio.Context) -> None:
    async with listener(ctx, lambda _: [bytes(MAX_HANDSHAKE_BYTES + 1024), b"\xcb" + bytes(8)]) as port:
        with pytest.raises(Unavailable):
            await fetch_handshake(ctx, "127.0.0.1", port, reply_timeout=0.5)


async def test_a_malformed_reply_is_invalid(ctx: zmq.asyncio.Context) -> None:
    async with listener(ctx, lambda _: [b"\xc1", b"\xcb" + bytes(8)]) as port:
        with pytest.raises(InvalidArgument) as e:
            await fetch_handshake(ctx, "127.0.0.1", port, reply_timeout=1.0)
    assert e.value.field == "handshake"


async def test_another_hash_is_refused_before_the_metadata_is_read(ctx: zmq.asyncio.Context) -> None:
    def other(_: bytes) -> list[bytes]:
        payload = NixlHandshakePayload("cd" * 32, b"\xc1 not metadata")
        return encode_handshake_reply(encode_handshake_payload(payload), 1.0)

    async with listener(ctx, other) as port:
        with pytest.raises(NixlIncompatible) as e:
            await fetch_handshake(ctx, "127.0.0.1", port, expected_hash=HASH, reply_timeout=1.0)
    assert set(e.value.differences) == {"compatibility_hash"}


async def test_verify_engine_names_every_difference(ctx: zmq.asyncio.Context) -> None:
    async with listener(ctx, vllm_like) as port:
        hs = await verify_engine(ctx, "127.0.0.1", port, Expected(block_size=32, compatibility_hash=HASH))
        assert hs.layout.num_descriptors == 14
        wrong = Expected(block_size=16, compatibility_hash="cd" * 32, vllm_version="0.33.0")
        with pytest.raises(NixlIncompatible) as e:
            await verify_engine(ctx, "127.0.0.1", port, wrong)
    assert set(e.value.differences) == {"block_size", "compatibility_hash", "vllm_version"}


def test_endpoints_as_vllm_writes_them() -> None:
    assert side_channel_endpoint("127.0.0.1", 5600) == "tcp://127.0.0.1:5600"
    assert side_channel_endpoint("::1", 5600) == "tcp://[::1]:5600"
