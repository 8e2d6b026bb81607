"""Serve: vLLM's prefill (or another agent) reads pooled KV out of the agent's pool through its
normal D->P path.

The agent stands in for an engine's NIXL side channel (kvshuttle.vllm.nixl_wire): a ZMQ ROUTER
that answers get_meta for rank (0, 0) with the engine's own handshake as a template (its
compatibility hash copied, so prefill accepts it; region names, block lens, layout and block
size kept, which prefill asserts) and the agent's fresh engine id, NIXL agent metadata, base
addresses, block counts, strides and memory type (DRAM) in place of the engine's.

`publish()` registers a sealed allocation under a fresh read id and returns kv_transfer_params
that name the agent; the router keeps them in the registry (the retention moved to the agent's
pool node) and hands them to a prefill once it claimed the retention there: the registry's
claim is the single-use guard. The reader READs the slots and notifies
`"{read_id}:{consumers}"`, which releases them once that many arrived.

Deadlines: prefill compares `remote_blocks_expiry_time` with its perf_counter rebased by the
clock offset it measured in the handshake, i.e. in the clock of whoever answered the handshake:
the agent's own perf_counter, which stamps every reply here. It is the allocation's own expiry
(the pool's sweep frees it then), and prefill declines a read that would start within 5 s of
it. A reader's heartbeat naming a read id keeps its allocation at least `lease + grace` longer.

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

from kvshuttle.agent.pool.blocks import Allocation, BlockPool, SlotState
from kvshuttle.agent.pool.nixl_memory import NixlPoolMemory
from kvshuttle.agent.pool.side_channel import Handshake
from kvshuttle.core.errors import FailedPrecondition, InvalidArgument, NotFound
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
    """A published allocation a reader may read, by the read id its notification names."""

    name: str  # the pool allocation
    read_id: str
    slots: tuple[int, ...]  # the allocation's: a later allocation of the same name is another
    expiry_time: float  # advertised, on the agent's perf_counter
    notified: int = 0
    active_until: float = 0.0  # time.monotonic(): a reader heartbeated or notified until then


class PoolServer:
    """The agent's side channel for its pool. `start()` once, `close()` once (before the memory
    closes). Bounded: a served entry is a live allocation's, so there are never more than the
    pool has slots."""

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
        """`engine`: the handshake of the engine whose blocks the pool mirrors (the template).
        `port` 0: any free port (see `port` after start). `lease` + `grace`: seconds a reader's
        heartbeat holds its allocation; `lease` more than PREFILL_EXPIRY_MARGIN. `clock` is
        what deadlines are advertised on, `monotonic` the pool's."""
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
        self._monotonic = monotonic
        # Fresh per server: prefill caches a remote's layout by engine id.
        self.engine_id = f"kvshuttle-{uuid.uuid4().hex}"
        self._served: dict[str, Served] = {}  # by read id
        self._by_name: dict[str, str] = {}  # allocation name -> read id
        self._payload = b""
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.answered = 0
        self.refused = 0
        self.reads = 0  # allocations released by their read-done notifications

    @property
    def served(self) -> dict[str, Served]:
        """Published allocations by read id."""
        return dict(self._served)

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

    def publish(self, name: str, num_tokens: int) -> dict[str, Any]:
        """Serve `name`'s sealed slots under a fresh read id, until the allocation's own expiry,
        and return the kv_transfer_params that make prefill read them from this agent. Raises
        NotFound (no such allocation), FailedPrecondition (not PARKED, or already published),
        InvalidArgument (num_tokens outside the slots)."""
        allocation = self._pool.get(name)
        if allocation.state is not SlotState.PARKED:
            raise FailedPrecondition(f"{name} is {allocation.state}, not sealed")
        if name in self._by_name:
            raise FailedPrecondition(f"{name} is served already")
        block_size = self._engine.metadata.block_size
        if not 0 < num_tokens <= allocation.blocks * block_size:
            raise InvalidArgument("num_tokens", f"must be within 1..{allocation.blocks * block_size}")
        served = Served(
            name=name,
            read_id=f"kvshuttle-pool-{uuid.uuid4().hex}",
            slots=allocation.slots,
            expiry_time=self._clock() + (allocation.expire_at - self._monotonic()),
        )
        self._served[served.read_id] = served
        self._by_name[name] = served.read_id
        meta = self._engine.metadata
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": [list(allocation.slots)],
            "remote_num_tokens": num_tokens,
            "remote_request_id": served.read_id,
            "remote_blocks_expiry_time": served.expiry_time,
            "tp_size": 1,
            "pp_size": 1,
            "dcp_size": meta.dcp_size,
        }

    def withdraw(self, name: str) -> None:
        """Stop serving `name` (its allocation was released by its owner)."""
        read_id = self._by_name.pop(name, None)
        if read_id is not None:
            self._served.pop(read_id, None)

    def active(self, name: str) -> bool:
        """Whether a reader is on `name`'s slots: it heartbeated or notified part of its reads
        within `lease + grace`. Such an allocation is never evicted."""
        read_id = self._by_name.get(name)
        served = None if read_id is None else self._served.get(read_id)
        return served is not None and served.active_until > self._monotonic()

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
        now = self._monotonic()
        hold = now + self._lease + self._grace
        if isinstance(notification, Heartbeat):
            for read_id in notification.request_ids:
                if (served := self._served.get(read_id)) is not None and self._current(served) is not None:
                    served.active_until = max(served.active_until, hold)
                    allocation = self._pool.get(served.name)
                    if allocation.expire_at < hold:
                        self._pool.renew(served.name, expire_at=hold)
            return
        served = self._served.get(notification.request_id)
        if served is None:
            log.warning("agent.serve.unknown_read", peer=peer, request_id=notification.request_id[:64])
            return
        served.notified += 1
        served.active_until = max(served.active_until, hold)
        if served.notified >= notification.consumers:
            self._release(served, "read")

    def _current(self, served: Served) -> Allocation | None:
        """`served`'s allocation while it is still the one published (sealed, same slots)."""
        try:
            allocation = self._pool.get(served.name)
        except NotFound:
            return None
        if allocation.slots != served.slots or allocation.state is not SlotState.PARKED:
            return None
        return allocation

    def _sweep(self) -> None:
        for served in [s for s in self._served.values() if self._current(s) is None]:
            self._forget(served)  # released meanwhile by its owner, or by expiry

    def _forget(self, served: Served) -> None:
        del self._served[served.read_id]
        if self._by_name.get(served.name) == served.read_id:
            del self._by_name[served.name]

    def _release(self, served: Served, why: str) -> None:
        self._forget(served)
        if self._current(served) is None:
            return
        allocation = self._pool.release(served.name)
        self.reads += 1
        log.info("agent.serve.released", retention=served.name, blocks=allocation.blocks, why=why)
