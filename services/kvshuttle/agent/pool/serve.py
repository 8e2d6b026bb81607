"""Serve: vLLM's prefill (or another agent) reads pooled KV out of the agent's pool through its
normal D->P path.

The agent stands in for an engine's NIXL side channel (kvshuttle.vllm.nixl_wire): a ZMQ ROUTER
that answers get_meta for rank (0, 0) with the engine's own handshake as a template (its
compatibility hash copied, so prefill accepts it; region names, block lens, layout and block
size kept, which prefill asserts) and the agent's fresh engine id, NIXL agent metadata, base
addresses, block counts, strides and memory type (DRAM) in place of the engine's.

What publishing, a reader's heartbeat and its read-done notification mean (the read ids, the
single-use guard, the advertised deadlines) is kvshuttle.agent.pool.published's; here, how they
travel over NIXL.

The side channel is unauthenticated: requests are size-capped by ZMQ and decoded strictly; a
malformed one or one for another rank gets no answer (the asker's REQ times out), never a
crash. Every NIXL call, the pool's progress and notifications included, runs on the memory's
one NIXL thread (NixlPoolMemory.run).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Final

import structlog
import zmq
import zmq.asyncio

from kvshuttle.agent.pool.blocks import BlockPool
from kvshuttle.agent.pool.nixl_memory import NixlPoolMemory
from kvshuttle.agent.pool.published import PREFILL_EXPIRY_MARGIN, PublishedReads, Served
from kvshuttle.agent.pool.side_channel import Handshake
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.vllm.nixl_wire import (
    Heartbeat,
    NixlHandshakePayload,
    decode_get_meta_request,
    decode_notification,
    encode_agent_metadata,
    encode_handshake_payload,
    encode_handshake_reply,
)

__all__ = ["PREFILL_EXPIRY_MARGIN", "PoolServer", "Served"]

log = structlog.get_logger("kvshuttle.agent")

# A get_meta request is ~16 bytes; anything much bigger drops the peer's connection.
_MAX_REQUEST_BYTES: Final = 256
_FAST_POLL: Final = 1e-3  # while a reader may be on the pool: UCX moves only when polled
_IDLE_POLL: Final = 0.05


class PoolServer(PublishedReads):
    """The agent's NIXL side channel for its pool. `start()` once, `close()` once (before the
    memory closes)."""

    def __init__(
        self,
        pool: BlockPool,
        memory: NixlPoolMemory,
        engine: Handshake,
        context: zmq.asyncio.Context,
        *,
        host: str,
        port: int = 0,
        lease: float = 30.0,
        grace: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`engine`: the handshake of the engine whose blocks the pool mirrors (the template);
        the rest as PublishedReads."""
        super().__init__(
            pool, engine, host=host, port=port, lease=lease, grace=grace, clock=clock, monotonic=monotonic
        )
        self._memory = memory
        self._context = context
        self._payload = b""
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.answered = 0
        self.refused = 0

    @property
    def serving(self) -> bool:
        """Whether the side channel is up and answering."""
        return self._socket is not None and all(not t.done() for t in self._tasks)

    async def start(self) -> None:
        agent_metadata = await self._memory.run(self._memory.metadata)
        self._payload = encode_handshake_payload(
            NixlHandshakePayload(self._engine.payload.compatibility_hash, self._metadata(agent_metadata))
        )
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        address = f"tcp://[{self.host}]" if ":" in self.host else f"tcp://{self.host}"
        if ":" in self.host:
            socket.setsockopt(zmq.IPV6, 1)
        try:
            if self.port:
                socket.bind(f"{address}:{self.port}")
            else:
                self.port = socket.bind_to_random_port(address)
        except zmq.ZMQError:
            socket.close(linger=0)
            raise
        self._socket = socket
        self._tasks = [
            asyncio.create_task(self._answer(socket), name="agent.serve.side_channel"),
            asyncio.create_task(self._poll(), name="agent.serve.notifications"),
        ]
        log.info("agent.serve.started", host=self.host, port=self.port, engine_id=self.engine_id)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def _metadata(self, agent_metadata: bytes) -> bytes:
        layout, memory, meta = self._pool.layout, self._memory, self._engine.metadata
        regions = range(layout.regions)
        counts = None if meta.region_num_blocks is None else (layout.blocks,) * layout.regions
        return encode_agent_metadata(
            replace(
                meta,
                engine_id=self.engine_id,
                agent_metadata=agent_metadata,
                kv_caches_base_addr=tuple(memory.base_address + r * layout.region_bytes for r in regions),
                num_blocks=layout.blocks,
                region_num_blocks=counts,
                block_strides=(layout.block_bytes,) * layout.regions,
                # The pool is host memory, whatever the engine's cache is: readers address it so.
                region_mem_types=None if meta.region_mem_types is None else ("DRAM",) * layout.regions,
            )
        )

    async def _answer(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            frames = await socket.recv_multipart()
            # REQ peers send [identity, b"", request]; anything else is no vLLM reader.
            try:
                if len(frames) != 3 or frames[1]:
                    raise InvalidArgument("get_meta", f"{len(frames)} frames, expected a REQ's 3")
                ranks = decode_get_meta_request(frames[2])
                if ranks != (0, 0):
                    raise InvalidArgument("get_meta", f"rank {ranks}: the agent serves only (0, 0)")
            except InvalidArgument as exc:
                self.refused += 1
                log.warning("agent.serve.refused", error=exc.message)
                continue
            reply = encode_handshake_reply(self._payload, self._clock())
            try:
                await socket.send_multipart([frames[0], b"", *reply])
            except zmq.ZMQError as exc:  # the asker went away: its REQ retries or times out
                log.warning("agent.serve.reply_failed", error=str(exc))
                continue
            self.answered += 1

    async def _poll(self) -> None:
        while True:
            try:
                await self._memory.run(self._memory.pump)
            except Exception:  # NIXL's bindings raise many types; serving must outlive one
                log.exception("agent.serve.progress_failed")
            for peer, message in self._memory.take_notifications():
                self._notified(peer, message)
            self._sweep()
            await asyncio.sleep(_FAST_POLL if self._served else _IDLE_POLL)

    def _notified(self, peer: str, message: bytes) -> None:
        try:
            notification = decode_notification(message)
        except InvalidArgument as exc:
            log.warning("agent.serve.bad_notification", peer=peer, error=exc.message)
            return
        if isinstance(notification, Heartbeat):
            self.heartbeat(notification.request_ids)
        else:
            self.read_done(peer, notification.request_id, notification.consumers)
