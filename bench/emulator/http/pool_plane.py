"""kvshuttle's agent pool on stand-in engines: a data plane (kvshuttle.agent.pool.data_plane) that
moves the stand-ins' KV (bench/emulator/http/kv.py: which tokens each block holds, no bytes) over
their side channel (HTTP standing in for NIXL, bench/emulator/http/engine.py) instead of NIXL.

* handshakes: `GET /kv/handshake` on a side channel (a stand-in engine's, or another agent's
  pool served here) read as NIXL's: the engine id, block size and blocks, the clock, and in
  place of NIXL's agent blob the side channel's URL (where its blocks are read). The blocks'
  bytes are the pool's layout (a stand-in's blocks hold tokens): one block of
  `block_size * kv_bytes_per_token`, as the agent's settings size it.
* reads (`StandinSlotReader`): `POST /kv/read` of the holder's blocks (their contents, and with
  `notify` the holder frees them), into the pool's slots; timed by a link of the agent's own,
  the model of its engine's (bench/emulator/core/link.py: the fixed cost, then the bytes at the
  bandwidth the agent's overlapping reads share).
* serving (`StandinReadServer`): the same two routes on a side channel of its own, so a
  stand-in prefill reads a pool node's params as it reads decode's (the read is the read-done
  notification: the slots are released), and another agent prefetches from it.

`python -m bench.emulator.http.agent` runs kvshuttle's agent with this plane.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import structlog
import zmq.asyncio
from aiohttp import web

from bench.emulator.core.link import Link
from kvshuttle.agent.config import PoolSettings
from kvshuttle.agent.pool.blocks import BlockPool, PoolLayout
from kvshuttle.agent.pool.data_plane import OpenedPool, Parked, PreparedRead, RetainedBlocks, check_readable
from kvshuttle.agent.pool.published import PublishedReads
from kvshuttle.agent.pool.side_channel import Handshake
from kvshuttle.core.errors import InvalidArgument, Unavailable
from kvshuttle.router.cost import LinkModel
from kvshuttle.vllm.nixl_compat import Expected
from kvshuttle.vllm.nixl_layout import RemoteLayout
from kvshuttle.vllm.nixl_wire import NixlAgentMetadata, NixlHandshakePayload, NixlIncompatible, clock_offset
from kvshuttle.vllm.shared_reads import read_of

__all__ = ["StandinDataPlane", "StandinReadServer", "StandinSlotReader", "handshake_of"]

log = structlog.get_logger("kvshuttle.agent")

_EXPIRY_MARGIN: Final = 1.0  # as NIXL's Parker: a READ must end this long before the pin does


def handshake_of(body: dict[str, Any], layout: PoolLayout, sent_at: float, received_at: float) -> Handshake:
    """A side channel's `GET /kv/handshake` answer as NIXL's handshake, its blocks in `layout`'s
    bytes. Raises InvalidArgument for a malformed answer."""
    try:
        meta = NixlAgentMetadata(
            engine_id=str(body["engine_id"]),
            agent_metadata=str(body["url"]).encode(),
            kv_caches_base_addr=tuple(r * layout.region_bytes for r in range(layout.regions)),
            device_id=0,
            num_blocks=int(body["num_blocks"]),
            block_lens=(layout.block_bytes,) * layout.regions,
            block_strides=(layout.block_bytes,) * layout.regions,
            kv_cache_layout="HND",
            block_size=int(body["block_size"]),
            ssm_sizes=(0, 0),
            attn_backend_name="standin",
            physical_blocks_per_logical_kv_block=1,
        )
        payload = NixlHandshakePayload(str(body["compatibility_hash"]), b"")
        clock = clock_offset(sent_at, received_at, float(body["clock"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument("handshake", f"not a stand-in's: {exc}") from None
    return Handshake(payload=payload, metadata=meta, layout=RemoteLayout.of(meta), clock=clock)


def _url(handshake: Handshake) -> str:
    return handshake.metadata.agent_metadata.decode()


@dataclass(frozen=True, slots=True)
class _Read:
    url: str  # the holder's side channel
    slots: tuple[int, ...]
    notify: bool
    deadline: float  # time.monotonic()


class StandinSlotReader:
    """Reads holders' blocks into `pool`, their contents kept in `contents` by slot."""

    def __init__(
        self,
        pool: BlockPool,
        contents: dict[int, tuple[int, ...]],
        session: aiohttp.ClientSession,
        link: Link | None,
        *,
        timeout: float,
    ) -> None:
        self._pool = pool
        self._contents = contents
        self._session = session
        self._link = link
        self._timeout = timeout

    def check(self, retained: RetainedBlocks, engine: Handshake) -> None:
        check_readable(self._pool, retained, engine, timeout=self._timeout, expiry_margin=_EXPIRY_MARGIN)

    def prepare(
        self, name: str, retained: RetainedBlocks, engine: Handshake, *, notify: bool = True
    ) -> PreparedRead[_Read]:
        self.check(retained, engine)
        if max(retained.block_ids) >= engine.metadata.num_blocks or min(retained.block_ids) < 0:
            raise InvalidArgument("kv_transfer_params.remote_block_ids", "outside the holder's blocks")
        deadline = time.monotonic() + self._timeout
        allocation = self._pool.allocate(name, len(retained.block_ids), expire_at=deadline)
        return PreparedRead(name, retained, _Read(_url(engine), allocation.slots, notify, deadline))

    async def read(self, prepared: PreparedRead[_Read], *, expire_at: float) -> Parked:
        name, retained, read = prepared.name, prepared.retained, prepared.read
        started = time.monotonic()
        try:
            async with asyncio.timeout(read.deadline - started):
                blocks = await self._fetch(read, retained)
                if self._link is not None:
                    await self._link.transfer(len(blocks) * self._pool.layout.slot_bytes)
        except BaseException as exc:
            self._pool.release(name)
            log.warning("agent.park_failed", retention=name, error=str(exc) or type(exc).__name__)
            if isinstance(exc, (aiohttp.ClientError, TimeoutError, ValueError, KeyError)):
                raise Unavailable(f"stand-in READ failed: {type(exc).__name__}: {exc}") from None
            raise
        for slot, block in zip(read.slots, blocks, strict=True):
            self._contents[slot] = block
        sealed = self._pool.seal(name, expire_at=expire_at)
        seconds = time.monotonic() - started
        log.info("agent.parked", retention=name, engine=retained.engine_id, blocks=sealed.blocks,
                 bytes=sealed.bytes, notified=read.notify, ms=round(seconds * 1000, 3))  # fmt: skip
        return Parked(sealed, retained.num_tokens, sealed.bytes, seconds)

    async def _fetch(self, read: _Read, retained: RetainedBlocks) -> list[tuple[int, ...]]:
        body = {"holding": retained.request_id, "block_ids": list(retained.block_ids), "notify": read.notify}
        async with self._session.post(f"{read.url}/kv/read", json=body) as response:
            if response.status != 200:
                raise ValueError(f"the holder answered {response.status}")
            blocks = (await response.json())["blocks"]
        if len(blocks) != len(read.slots):
            raise ValueError(f"{len(blocks)} blocks for {len(read.slots)} asked")
        return [tuple(int(t) for t in block) for block in blocks]


class StandinReadServer(PublishedReads):
    """The pool's side channel on stand-ins: `/kv/read` and `/kv/handshake` as an engine's."""

    def __init__(
        self,
        pool: BlockPool,
        contents: dict[int, tuple[int, ...]],
        engine: Handshake,
        link: dict[str, Any] | None,
        *,
        host: str,
        port: int,
        lease: float,
        grace: float,
    ) -> None:
        super().__init__(pool, engine, host=host, port=port, lease=lease, grace=grace)
        self._contents = contents
        self._link = link
        self._runner: web.AppRunner | None = None

    @property
    def serving(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/kv/read", self._read)
        app.router.add_get("/kv/handshake", self._handshake)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port).start()
        self.port = runner.addresses[0][1]
        self._runner = runner

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handshake(self, _: web.Request) -> web.Response:
        meta = self._engine.metadata
        return web.json_response(
            {
                "engine_id": self.engine_id,
                "block_size": meta.block_size,
                "num_blocks": self._pool.layout.blocks,
                "compatibility_hash": self._engine.payload.compatibility_hash,
                "url": f"http://{self.host}:{self.port}",
                "clock": time.perf_counter(),
                "link": self._link,
            }
        )

    async def _read(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._sweep()
        request_id = str(body.get("holding"))
        served = self.current(read_of(request_id)[0])  # a shared reader names it with its suffix
        if served is None:
            return web.json_response({"error": "no such holding"}, status=404)
        wanted = [int(b) for b in body.get("block_ids", [])]
        found = set(wanted) <= set(served.slots)
        blocks = [list(self._contents[slot]) for slot in wanted] if found else []
        if body.get("notify", True) is not False:
            self.read_done(request.remote or "", request_id, 1)
        if not found:
            return web.json_response({"error": "not the holding's blocks"}, status=404)
        return web.json_response({"blocks": blocks})


class StandinDataPlane:
    """The plane of one agent, whose pool has `layout` (its settings')."""

    def __init__(self, layout: PoolLayout) -> None:
        self._layout = layout
        self._engine_link: dict[str, Any] | None = None  # the own engine's, from its handshake

    async def fetch_holder(
        self,
        context: zmq.asyncio.Context,
        host: str,
        port: int,
        *,
        reply_timeout: float,
        expected_hash: str | None,
    ) -> Handshake:
        _, handshake = await self._fetch(host, port, reply_timeout)
        found = handshake.payload.compatibility_hash
        if expected_hash is not None and found != expected_hash:
            raise NixlIncompatible({"compatibility_hash": (expected_hash, found)})
        return handshake

    async def verify_engine(
        self,
        context: zmq.asyncio.Context,
        host: str,
        port: int,
        expected: Expected,
        *,
        reply_timeout: float,
    ) -> Handshake:
        body, handshake = await self._fetch(host, port, reply_timeout)
        self._engine_link = body.get("link")
        meta = handshake.metadata
        differences = {
            what: (str(want), str(got))
            for what, want, got in (
                ("block_size", expected.block_size, meta.block_size),
                ("engine_id", expected.engine_id, meta.engine_id),
            )
            if want is not None and want != got
        }
        if differences:
            raise NixlIncompatible(differences)
        return handshake

    async def _fetch(self, host: str, port: int, reply_timeout: float) -> tuple[dict[str, Any], Handshake]:
        url = f"http://{host}:{port}/kv/handshake"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=reply_timeout)) as session:
                sent_at = time.perf_counter()
                async with session.get(url) as response:
                    body = await response.json()
                received_at = time.perf_counter()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unavailable(f"no stand-in handshake from {url}: {type(exc).__name__}: {exc}") from None
        except ValueError as exc:
            raise InvalidArgument("handshake", f"not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidArgument("handshake", "not a JSON object")
        return body, handshake_of(body, self._layout, sent_at, received_at)

    async def open(
        self,
        pool: BlockPool,
        engine: Handshake,
        settings: PoolSettings,
        context: zmq.asyncio.Context,
        *,
        name: str,
    ) -> OpenedPool:
        del name  # no NIXL agent to name
        link_spec = self._engine_link
        link = None
        if link_spec is not None:
            model = LinkModel(bandwidth_gb_s=link_spec["bandwidth_gb_s"], fixed_ms=link_spec["fixed_ms"])
            link = Link(model, time_scale=link_spec["time_scale"])
        contents: dict[int, tuple[int, ...]] = {}
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=settings.park_timeout))
        reader = StandinSlotReader(pool, contents, session, link, timeout=settings.park_timeout)
        server = None
        if settings.serve_port is not None:
            server = StandinReadServer(
                pool,
                contents,
                engine,
                link_spec,
                host=settings.serve_host,
                port=settings.serve_port,
                lease=settings.serve_lease,
                grace=settings.serve_grace,
            )
            await server.start()

        async def close() -> None:
            if server is not None:
                await server.close()
            await session.close()

        return OpenedPool(reader=reader, server=server, close=close)
