"""Serve: vLLM's prefill reads parked KV out of the agent's pool through its normal D->P path.

The agent stands in for an engine's NIXL side channel (kvshuttle.vllm.nixl_wire): a ZMQ ROUTER
that answers get_meta for rank (0, 0) with the engine's own handshake as a template (its
compatibility hash copied, so prefill accepts it; region names, block lens, layout and block
size kept, which prefill asserts) and the agent's fresh engine id, NIXL agent metadata, base
addresses, block counts and strides in place of the engine's. `serve()` claims a parked
retention and returns kv_transfer_params that name the agent; prefill then READs the slots and
notifies `"{remote_request_id}:{consumers}"`, which releases them once that many arrived.

Deadlines: prefill compares `remote_blocks_expiry_time` with its perf_counter rebased by the
clock offset it measured in the handshake, i.e. in the clock of whoever answered the handshake:
the agent's own perf_counter, which stamps every reply here. Prefill declines a read that would
start within 5 s of it, so the advertised lease keeps more than that. A served retention
neither read nor renewed by a heartbeat by its deadline (+ a grace for a read prefill started
just inside it) is released: claiming consumed it.

The side channel is unauthenticated: requests are size-capped by ZMQ and decoded strictly; a
malformed one or one for another rank gets no answer (the asker's REQ times out), never a
crash. Every NIXL call, the pool's progress and notifications included, runs on the memory's
one NIXL thread (NixlPoolMemory.run).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final

import structlog
import zmq
import zmq.asyncio

from kvshuttle.agent.block_pool import BlockPool
from kvshuttle.agent.nixl_memory import NixlPoolMemory
from kvshuttle.agent.side_channel import Handshake
from kvshuttle.core.errors import InvalidArgument, NotFound
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

# vLLM 0.32's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN: prefill declines a read this close to the expiry.
PREFILL_EXPIRY_MARGIN: Final = 5.0
# A get_meta request is ~16 bytes; anything much bigger drops the peer's connection.
_MAX_REQUEST_BYTES: Final = 256
_FAST_POLL: Final = 1e-3  # while a reader may be on the pool: UCX moves only when polled
_IDLE_POLL: Final = 0.05


@dataclass(slots=True)
class Served:
    """A claimed retention prefill may read, by the request id its notification names."""

    name: str  # the pool allocation
    request_id: str
    expiry_time: float  # advertised, on the agent's perf_counter
    hold_until: float  # released unread after this (perf_counter)
    notified: int = 0


class PoolServer:
    """The agent's side channel for its pool. `start()` once, `close()` once (before the memory
    closes). Bounded: a served retention is a claimed allocation, so there are never more than
    the pool has slots."""

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
    ) -> None:
        """`engine`: the handshake of the engine whose blocks the pool mirrors (the template).
        `port` 0: any free port (see `port` after start). `lease`: seconds a served retention
        is advertised for; more than PREFILL_EXPIRY_MARGIN."""
        if lease <= PREFILL_EXPIRY_MARGIN or grace < 0:
            raise ValueError(f"lease must exceed prefill's {PREFILL_EXPIRY_MARGIN:g} s margin, grace >= 0")
        pool.layout.check_mirrors(engine.metadata.block_lens)
        self._pool = pool
        self._memory = memory
        self._engine = engine
        self._context = context
        self.host = host
        self.port = port
        self._lease = lease
        self._grace = grace
        self._clock = clock
        # Fresh per server: prefill caches a remote's layout by engine id.
        self.engine_id = f"kvshuttle-{uuid.uuid4().hex}"
        self._served: dict[str, Served] = {}
        self._payload = b""
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.answered = 0
        self.refused = 0

    @property
    def served(self) -> dict[str, Served]:
        return dict(self._served)

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

    def serve(self, name: str, num_tokens: int) -> dict[str, Any]:
        """Claim `name`'s parked slots for a reader and return the kv_transfer_params that make
        prefill read them from this agent (as the router hands them to prefill). Raises what
        BlockPool.claim raises (NotFound; FailedPrecondition when not PARKED, already claimed
        among them), InvalidArgument (num_tokens outside the slots)."""
        allocation = self._pool.get(name)
        block_size = self._engine.metadata.block_size
        if not 0 < num_tokens <= allocation.blocks * block_size:
            raise InvalidArgument("num_tokens", f"must be within 1..{allocation.blocks * block_size}")
        allocation = self._pool.claim(name)
        now = self._clock()
        served = Served(
            name=name,
            request_id=f"kvshuttle-serve-{uuid.uuid4().hex}",
            expiry_time=now + self._lease,
            hold_until=now + self._lease + self._grace,
        )
        self._served[served.request_id] = served
        meta = self._engine.metadata
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": [list(allocation.slots)],
            "remote_num_tokens": num_tokens,
            "remote_request_id": served.request_id,
            "remote_blocks_expiry_time": served.expiry_time,
            "tp_size": 1,
            "pp_size": 1,
            "dcp_size": meta.dcp_size,
        }

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
            until = self._clock() + self._lease + self._grace
            for request_id in notification.request_ids:
                if (served := self._served.get(request_id)) is not None:
                    served.hold_until = max(served.hold_until, until)
            return
        served = self._served.get(notification.request_id)
        if served is None:
            log.warning("agent.serve.unknown_read", peer=peer, request_id=notification.request_id[:64])
            return
        served.notified += 1
        if served.notified >= notification.consumers:
            self._release(served, "read")

    def _sweep(self) -> None:
        now = self._clock()
        for served in [s for s in self._served.values() if s.hold_until <= now]:
            self._release(served, "expired")

    def _release(self, served: Served, why: str) -> None:
        del self._served[served.request_id]
        try:
            allocation = self._pool.release(served.name)
        except NotFound:  # released meanwhile by its owner
            return
        log.info("agent.serve.released", retention=served.name, blocks=allocation.blocks, why=why)
