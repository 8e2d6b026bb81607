"""One agent: the node lease, the engine poller, the KV-event receiver and forwarder, as tasks
on one event loop, and the status GetStatus reports. No grpc here: the registry is a port.

Every loop is supervised: an unexpected exception is logged and the loop restarts after a
pause, so a bug in one part never takes the sidecar (and the node's lease) down with it.

With a block pool, `start()` first checks the engine over its NIXL side channel: it waits (with
backoff) for an engine that does not answer yet, and raises for one it cannot read from; then
it serves the pool on a side channel of its own (kvshuttle.agent.pool.serve) unless configured off.
KV moves over the pool's data plane (kvshuttle.agent.pool.data_plane): NIXL's unless the agent is
given another (an emulated cluster's).
A served pool is registered as a node of its own (`pool_node_name(node)`, role POOL: a second
lease, heartbeated with the pool's use as its load), and KV moves into it through the mover
(kvshuttle.agent.pool.mover), which ParkRetention, Prefetch and PullBlocks call.

With node.engine_id_file, `start()` first waits for the engine's id there, and the agent follows
the file (kvshuttle.agent.engine_id): a new id is a new engine, so `follow_engine` registers the
node again with it (the registry drops the old engine's retentions and block index; the event
forwarder re-synchronises, the new engine's sequence starting over), and a pool starts anew
beside it: its node deregistered (what was parked from the old engine goes with it), the new
engine checked over its side channel, the pool registered again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import structlog
import zmq.asyncio

from kvshuttle.agent.config import AgentSettings
from kvshuttle.agent.engine import EnginePoller
from kvshuttle.agent.engine_id import EngineIdWatcher, wait_for_engine_id
from kvshuttle.agent.events import EventReceiver, ZmqReplayer
from kvshuttle.agent.forwarder import EventForwarder
from kvshuttle.agent.lease import NodeLease
from kvshuttle.agent.model import AgentStatus, Backoff, EventStreamStats, LiveBatch
from kvshuttle.agent.node_specs import node_spec, pool_node_spec
from kvshuttle.agent.pool.blocks import BlockPool
from kvshuttle.agent.pool.side_channel import Handshake, side_channel_endpoint
from kvshuttle.agent.ports import RegistryPort, ReplayPort
from kvshuttle.core.errors import FailedPrecondition, KvshuttleError, Unavailable
from kvshuttle.core.nodes import (
    NodeLoad,
)
from kvshuttle.vllm.kv_events import KvEventDecoder
from kvshuttle.vllm.nixl_compat import Expected

if TYPE_CHECKING:  # NIXL is imported only by an agent with a pool (see start)
    from kvshuttle.agent.pool.data_plane import DataPlane, OpenedPool, ReadServer, SlotReader
    from kvshuttle.agent.pool.mover import Mover

__all__ = ["Agent"]

log = structlog.get_logger("kvshuttle.agent")

# Pause before a crashed loop starts again.
_RESTART_PAUSE = 1.0
# Seconds between warnings while the engine's side channel does not answer.
_UNREACHABLE_LOG_EVERY = 30.0


class Agent:
    """The sidecar of one vLLM worker. `start()` once, `shutdown()` once."""

    def __init__(
        self,
        settings: AgentSettings,
        registry: RegistryPort,
        *,
        replay: ReplayPort | None = None,
        zmq_context: zmq.asyncio.Context | None = None,
        data_plane: DataPlane | None = None,
    ) -> None:
        """`replay` replaces the ZMQ replay client (tests); `zmq_context` is shared when given
        (and then not closed here); `data_plane`: how KV moves into and out of the pool (None:
        NIXL's)."""
        self.settings = settings
        self._registry = registry
        lease_cfg, events_cfg = settings.lease, settings.events
        self.poller = EnginePoller(
            settings.node.http_endpoint,
            interval=settings.engine.poll_interval,
            timeout=settings.engine.poll_timeout,
        )
        self.lease = NodeLease(
            registry,
            node_spec(settings),
            ttl=lease_cfg.ttl,
            heartbeat_interval=lease_cfg.heartbeat_interval,
            load=self.poller.load,
            backoff=Backoff(lease_cfg.retry_initial, lease_cfg.retry_max),
        )
        self.poller.add_listener(lambda _: self.lease.report_now())
        self.events = EventStreamStats(endpoint=events_cfg.endpoint or "")
        self.decoder = KvEventDecoder(group=events_cfg.kv_cache_group)
        self.queue: asyncio.Queue[LiveBatch | None] = asyncio.Queue(maxsize=events_cfg.queue_size)
        layout = settings.pool_layout()
        # ZMQ for the event stream, and for the NIXL side channel when there is a pool.
        needs_zmq = events_cfg.endpoint is not None or layout is not None
        self._owns_context = zmq_context is None and needs_zmq
        self._context = zmq_context or (zmq.asyncio.Context() if needs_zmq else None)
        self.receiver: EventReceiver | None = None
        self.forwarder: EventForwarder | None = None
        if events_cfg.endpoint is not None and self._context is not None:
            if replay is None and events_cfg.replay_endpoint is not None:
                replay = ZmqReplayer(
                    self._context,
                    events_cfg.replay_endpoint,
                    self.decoder,
                    timeout=events_cfg.replay_timeout,
                    max_batches=events_cfg.replay_max_batches,
                )
            self.receiver = EventReceiver(
                self._context,
                events_cfg.endpoint,
                events_cfg.topic,
                self.queue,
                self.events,
                self.decoder,
                receive_hwm=events_cfg.receive_hwm,
            )
            self.forwarder = EventForwarder(
                registry,
                self.lease,
                self.queue,
                self.events,
                replay=replay,
                max_batches=events_cfg.max_batches_per_report,
                linger=events_cfg.linger,
                max_request_bytes=events_cfg.max_report_bytes,
                backoff=Backoff(lease_cfg.retry_initial, lease_cfg.retry_max),
            )
        self.pool = BlockPool(layout) if layout is not None else None
        # Set by start() once the engine passed the check; released at shutdown().
        self.engine_nixl: Handshake | None = None
        self._data_plane = data_plane
        self.opened: OpenedPool | None = None
        self.parker: SlotReader[Any] | None = None
        self.server: ReadServer | None = None
        self.mover: Mover | None = None
        self.pool_lease: NodeLease | None = None  # the served pool's node
        self.engine_ids: EngineIdWatcher | None = None  # with node.engine_id_file
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def start(self, *, agent_endpoint: str = "") -> None:
        """Start the loops; the node registers with `agent_endpoint` as its agent's address."""
        if self._tasks:
            raise RuntimeError("the agent is already started")
        self.lease.spec.agent_endpoint = agent_endpoint
        node, engine = self.settings.node, self.settings.engine
        if node.engine_id_file is not None:
            engine_id = await wait_for_engine_id(
                node.engine_id_file, wait_s=engine.id_wait_timeout, interval=engine.id_poll_interval
            )
            self.lease.spec.engine_id = engine_id
            self.engine_ids = EngineIdWatcher(
                node.engine_id_file, engine_id, self.follow_engine, interval=engine.id_poll_interval
            )
        if self.pool is not None:
            await self._start_pool(self.pool)
        self._spawn("lease", self.lease.run)
        self._spawn("engine", self.poller.run)
        if self.receiver is not None and self.forwarder is not None:
            self._spawn("events.receive", self.receiver.run)
            self._spawn("events.forward", self.forwarder.run)
        if self.engine_ids is not None:
            self._spawn("engine_id", self.engine_ids.run)
        log.info(
            "agent.started",
            node=self.lease.spec.name,
            engine=self.settings.node.http_endpoint,
            engine_id=self.lease.spec.engine_id,
            events=self.settings.events.endpoint,
            replay=self.settings.events.replay_endpoint,
            agent_endpoint=agent_endpoint,
            pool_bytes=self.pool.layout.total_bytes if self.pool is not None else 0,
        )

    async def follow_engine(self, engine_id: str) -> None:
        """The engine beside the agent restarted as `engine_id`: register the node again with
        it, and start the pool anew beside the new engine. Safe to call again after a failure."""
        if self.pool is not None:
            await self._stop_pool(self.pool)
        self.lease.spec.engine_id = engine_id
        self.lease.register_again("engine_id_changed")
        if self.pool is not None:
            await self._start_pool(self.pool)
        log.info("agent.engine_followed", node=self.lease.spec.name, engine_id=engine_id)

    async def _start_pool(self, pool: BlockPool) -> None:
        """Check the engine, then serve the pool and register its node (when configured)."""
        # Here, not at module import: an agent without a pool runs without NIXL installed.
        from kvshuttle.agent.pool.mover import Mover  # noqa: PLC0415

        plane = self._data_plane
        if plane is None:
            from kvshuttle.agent.pool.nixl_plane import NixlDataPlane  # noqa: PLC0415

            plane = self._data_plane = NixlDataPlane()
        self.engine_nixl = await self._verify_engine(pool, plane)
        # A fresh NIXL name per start: peers cache remote agents by name.
        node = self.lease.spec.name.removeprefix("nodes/")
        pool_cfg = self.settings.pool
        assert self._context is not None  # made for the pool in __init__
        self.opened = await plane.open(
            pool, self.engine_nixl, pool_cfg, self._context, name=f"kvshuttle-{node}-{uuid.uuid4().hex[:12]}"
        )
        self.parker, self.server = self.opened.reader, self.opened.server
        if self.server is not None:
            spec = pool_node_spec(
                self.lease.spec,
                engine_id=self.server.engine_id,
                host=self.server.host,
                port=self.server.port,
                capacity_bytes=pool.layout.total_bytes,
            )
            self.mover = Mover(
                pool=pool,
                parker=self.parker,
                server=self.server,
                registry=self._registry,
                engine=self.engine_nixl,
                context=self._context,
                fetch=plane.fetch_holder,
                node=self.lease.spec.name,
                pool_node=spec.name,
                serve_grace=pool_cfg.serve_grace,
                max_ttl=pool_cfg.max_move_ttl,
                handshake_timeout=pool_cfg.holder_handshake_timeout,
                remembered=pool_cfg.remembered_moves,
            )
            lease_cfg = self.settings.lease
            self.pool_lease = NodeLease(
                self._registry,
                spec,
                ttl=lease_cfg.ttl,
                heartbeat_interval=lease_cfg.heartbeat_interval,
                load=self.pool_load,
                backoff=Backoff(lease_cfg.retry_initial, lease_cfg.retry_max),
            )
            self._spawn("pool.lease", self.pool_lease.run)
        self._spawn("pool.expire", functools.partial(self._expire_pool, pool))

    async def _stop_pool(self, pool: BlockPool) -> None:
        """Undo _start_pool (whatever of it was done): the pool node deregistered, its server
        closed, its memory released; the pool empty."""
        await self._cancel("pool.lease", "pool.expire")
        if self.pool_lease is not None:
            await self.pool_lease.deregister(deadline_s=self.settings.lease.deregister_timeout)
        self.pool_lease, self.mover, self.parker, self.server = None, None, None, None
        if self.opened is not None:
            await self.opened.close()  # waits for a READ in flight
            self.opened = None
        self.engine_nixl = None
        self.pool = BlockPool(pool.layout)

    async def _verify_engine(self, pool: BlockPool, plane: DataPlane) -> Handshake:
        """The engine's NIXL handshake, checked against the pin and the pool's layout. Retries
        while the side channel does not answer (the engine may still be starting); raises
        NixlIncompatible, FailedPrecondition (the pool does not mirror the engine's blocks) or
        InvalidArgument (what answers is no vLLM side channel), logged as agent.engine_refused."""
        node = self.settings.node
        where = side_channel_endpoint(node.side_channel_host, node.side_channel_port)
        expected = Expected(
            block_size=node.block_size,
            engine_id=self.lease.spec.engine_id,
            nixl_version=importlib.metadata.version("nixl"),
        )
        backoff = Backoff(self.settings.lease.retry_initial, self.settings.lease.retry_max)
        attempts, warned_at = 0, -_UNREACHABLE_LOG_EVERY
        assert self._context is not None  # made for the pool in __init__
        while True:
            try:
                handshake = await plane.verify_engine(
                    self._context,
                    node.side_channel_host,
                    node.side_channel_port,
                    expected,
                    reply_timeout=self.settings.engine.poll_timeout,
                )
                pool.layout.check_mirrors([r.block_len for r in handshake.layout.regions])
            except Unavailable as exc:
                attempts += 1
                delay = backoff.next()
                if time.monotonic() - warned_at >= _UNREACHABLE_LOG_EVERY:
                    warned_at = time.monotonic()
                    log.warning(
                        "agent.engine_unreachable",
                        side_channel=where,
                        attempts=attempts,
                        error=exc.message,
                        retrying="with backoff until it answers",
                    )
                await asyncio.sleep(delay)
                continue
            except KvshuttleError as exc:
                log.error("agent.engine_refused", side_channel=where, reason=exc.message, **exc.metadata)
                raise
            log.info(
                "agent.engine_verified",
                side_channel=where,
                engine_id=handshake.metadata.engine_id,
                regions=len(handshake.layout.regions),
                attempts=attempts + 1,
            )
            return handshake

    async def _expire_pool(self, pool: BlockPool) -> None:
        while True:
            expired = pool.expire(time.monotonic())
            for allocation in expired:
                log.info("agent.pool.expired", retention=allocation.name, blocks=allocation.blocks)
            if self.mover is not None:
                self.mover.expired(expired)
            await asyncio.sleep(self.settings.pool.expire_interval)

    def pool_load(self) -> NodeLoad:
        """The pool node's load: healthy while its side channel serves, usage = slots held."""
        if self.pool is None:
            return NodeLoad()
        stats = self.pool.stats()
        return NodeLoad(
            kv_cache_usage=stats.used_blocks / stats.total_blocks,
            engine_healthy=self.server is not None and self.server.serving,
        )

    def moves(self) -> Mover:
        """The mover, for the NIXL moves' RPCs. Raises FailedPrecondition when the agent has
        no pool or does not serve it, Unavailable while it is starting."""
        if self.pool is None:
            raise FailedPrecondition("the agent has no pool (pool.size_bytes is 0)")
        if self.settings.pool.serve_port is None:
            raise FailedPrecondition(
                "the agent does not serve its pool (pool.serve_port unset): nothing could read moved KV"
            )
        if self.mover is None:
            raise Unavailable("the agent's pool is starting")
        return self.mover

    def _spawn(self, name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._tasks[name] = asyncio.create_task(self._supervise(name, loop), name=f"agent.{name}")

    @staticmethod
    async def _supervise(name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        while True:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("agent.loop_crashed", loop=name, restart_in=_RESTART_PAUSE)
                await asyncio.sleep(_RESTART_PAUSE)

    async def _cancel(self, *names: str) -> None:
        tasks = [t for n in names if (t := self._tasks.pop(n, None)) is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def shutdown(self) -> None:
        """Stop receiving and polling, forward what is queued (within
        shutdown_flush_timeout), stop heartbeating, deregister. Never raises."""
        await self._cancel("engine_id", "events.receive", "engine", "pool.expire", "pool.lease")
        forward = self._tasks.pop("events.forward", None)
        if forward is not None and self.forwarder is not None:
            self.forwarder.stop()
            try:
                await asyncio.wait_for(asyncio.shield(forward), self.settings.shutdown_flush_timeout)
            except TimeoutError:
                log.warning("agent.flush_timeout", queued=self.queue.qsize())
            forward.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await forward
        await self._cancel("lease")
        deadline = self.settings.lease.deregister_timeout
        if self.pool_lease is not None:
            # First: its retentions go with it, before the pool stops serving them.
            await self.pool_lease.deregister(deadline_s=deadline)
        await self.lease.deregister(deadline_s=deadline)
        if self.opened is not None:
            # Waits for a READ in flight: none may still write into the memory.
            await self.opened.close()
        if self._owns_context and self._context is not None:
            self._context.destroy(linger=0)
        log.info("agent.stopped", node=self.lease.spec.name)

    def status(self) -> AgentStatus:
        return AgentStatus(
            lease=self.lease.state,
            http_endpoint=self.settings.node.http_endpoint,
            engine_id=self.lease.spec.engine_id,
            engine=self.poller.state,
            events=self.events,
            pool=self.pool.stats() if self.pool is not None else None,
        )
