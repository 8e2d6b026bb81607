"""The NIXL handshake with a vLLM engine's side channel (kvshuttle.vllm.nixl_wire), over ZMQ.

One REQ socket per fetch, closed after it, so a late answer to an abandoned fetch can never be
read as the next one's. The peer is unauthenticated: replies are size-capped by ZMQ
(MAXMSGSIZE: a bigger message drops the connection, and the fetch times out) and decoded
strictly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvshuttle.core.errors import Unavailable
from kvshuttle.vllm.nixl_compat import Expected, check_compatible
from kvshuttle.vllm.nixl_layout import RemoteLayout
from kvshuttle.vllm.nixl_wire import (
    MAX_HANDSHAKE_BYTES,
    ClockOffset,
    NixlAgentMetadata,
    NixlHandshakePayload,
    NixlIncompatible,
    clock_offset,
    decode_agent_metadata,
    decode_handshake_reply,
    encode_get_meta_request,
)

__all__ = ["Handshake", "fetch_handshake", "side_channel_endpoint", "verify_engine"]


@dataclass(frozen=True, slots=True)
class Handshake:
    payload: NixlHandshakePayload
    metadata: NixlAgentMetadata
    layout: RemoteLayout  # where the metadata's blocks are (checked consistent)
    clock: ClockOffset  # the engine's perf_counter against `now` of fetch_handshake


def side_channel_endpoint(host: str, port: int) -> str:
    """The ZMQ address of a side channel, as vLLM's make_zmq_path writes it (IPv6 bracketed)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


async def fetch_handshake(
    context: zmq.asyncio.Context,
    host: str,
    port: int,
    *,
    pp_rank: int = 0,
    tp_rank: int = 0,
    reply_timeout: float = 5.0,
    expected_hash: str | None = None,
    now: Callable[[], float] = time.perf_counter,
) -> Handshake:
    """Ask the side channel at host:port for (pp_rank, tp_rank)'s handshake.

    Raises Unavailable (no reply within `reply_timeout` seconds, or a ZMQ error), InvalidArgument (a
    malformed reply or an inconsistent layout), NixlIncompatible (its hash is not
    `expected_hash`: checked before the agent metadata is decoded, as vLLM does, so a schema
    change reports as the hash it is).
    """
    endpoint = side_channel_endpoint(host, port)
    request = encode_get_meta_request(pp_rank, tp_rank)
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    # Both frames of the reply; a bigger one is a hostile or broken peer.
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_HANDSHAKE_BYTES + 64)
    try:
        socket.connect(endpoint)
        sent_at = now()
        await socket.send(request)
        if not await socket.poll(max(1, int(reply_timeout * 1000))):
            raise Unavailable(f"no NIXL handshake from {endpoint} within {reply_timeout:g} s")
        frames = await socket.recv_multipart()
        received_at = now()
    except zmq.ZMQError as exc:
        raise Unavailable(f"NIXL handshake with {endpoint} failed: {exc}") from None
    finally:
        with contextlib.suppress(zmq.ZMQError):
            socket.close(linger=0)
    reply = decode_handshake_reply(frames)
    found = reply.payload.compatibility_hash
    if expected_hash is not None and found != expected_hash:
        raise NixlIncompatible({"compatibility_hash": (expected_hash, found)})
    metadata = decode_agent_metadata(reply.payload.agent_metadata_bytes)
    return Handshake(
        payload=reply.payload,
        metadata=metadata,
        layout=RemoteLayout.of(metadata),
        clock=clock_offset(sent_at, received_at, reply.engine_clock),
    )


async def verify_engine(
    context: zmq.asyncio.Context, host: str, port: int, expected: Expected, *, reply_timeout: float = 5.0
) -> Handshake:
    """The handshake of the engine an agent sits beside, at agent start: refused unless the
    engine is one this wire speaks. Raises NixlIncompatible naming every difference (the hash
    among them, so it is not checked first), and what fetch_handshake raises."""
    handshake = await fetch_handshake(context, host, port, reply_timeout=reply_timeout)
    check_compatible(handshake.payload, handshake.metadata, expected)
    return handshake
