"""One agent: the node lease, the engine poller, the KV-event receiver and forwarder, as tasks
on one event loop, and the status GetStatus reports. No grpc here: the registry is a port.

Every loop is supervised: an unexpected exception is logged and the loop restarts after a
pause, so a bug in one part never takes the sidecar (and the node's lease) down with it.

With a block pool, `start()` first checks the engine over its NIXL side channel: it waits (with
backoff) for an engine that does not answer yet, and raises for one it cannot read from; then
it serves the pool on a side channel of its own (kvshuttle.agent.serve) unless configured off.
A served pool is registered as a node of its own (`pool_node_name(node)`, role POOL: a second
lease, heartbeated with the pool's use as its load), and KV moves into it through the mover
(kvshuttle.agent.mover), which ParkRetention, Prefetch and PullBlocks call.
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

from kvshuttle.agent.block_pool import BlockPool
from kvshuttle.agent.config import AgentSettings
from kvshuttle.agent.engine import EnginePoller
from kvshuttle.agent.events import EventReceiver, ZmqReplayer
from kvshuttle.agent.forwarder import EventForwarder
from kvshuttle.agent.lease import NodeLease
from kvshuttle.agent.model import AgentStatus, Backoff, EventStreamStats, LiveBatch
from kvshuttle.agent.ports import RegistryPort, ReplayPort
from kvshuttle.agent.side_channel import Handshake, side_channel_endpoint, verify_engine
from kvshuttle.core.errors import FailedPrecondition, KvshuttleError, Unavailable
from kvshuttle.core.nodes import (
    POOL_CAPACITY_LABEL,
    POOL_OF_LABEL,
    NodeLoad,
    NodeRole,
    NodeSpec,
    pool_node_name,
)
from kvshuttle.vllm.kv_events import KvEventDecoder
from kvshuttle.vllm.nixl_compat import Expected

if TYPE_CHECKING:  # NIXL is imported only by an agent with a pool (see start)
    from kvshuttle.agent.mover import Mover
    from kvshuttle.agent.nixl_memory import NixlPoolMemory
    from kvshuttle.agent.park import Parker
    from kvshuttle.agent.serve import PoolServer

__all__ = ["Agent", "node_spec", "pool_node_spec"]

log = structlog.get_logger("kvshuttle.agent")

# Pause before a crashed loop starts again.
_RESTART_PAUSE = 1.0
# Seconds between warnings while the engine's side channel does not answer.
_UNREACHABLE_LOG_EVERY = 30.0


def node_spec(settings: AgentSettings, agent_endpoint: str = "") -> NodeSpec:
    node = settings.node
    return NodeSpec(
        name=node.name,
        role=NodeRole(node.role),
        engine_id=node.engine_id,
        http_endpoint=node.http_endpoint,
        side_channel_host=node.side_channel_host,
        side_channel_port=node.side_channel_port,
        agent_endpoint=agent_endpoint,
        model=node.model,
        block_size=node.block_size,
        kv_bytes_per_token=node.kv_bytes_per_token,
        labels=dict(node.labels),
    )


def pool_node_spec(
    engine: NodeSpec, *, engine_id: str, host: str, port: int, capacity_bytes: int
) -> NodeSpec:
    """The node an agent's served pool registers as: named after the engine's node, role POOL,
    the pool server's engine id and side channel, the engine's model and block geometry."""
    return NodeSpec(
        name=pool_node_name(engine.name),
        role=NodeRole.POOL,
        engine_id=engine_id,
        http_endpoint=engine.http_endpoint,
        side_channel_host=host,
        side_channel_port=port,
        agent_endpoint=engine.agent_endpoint,
        model=engine.model,
        block_size=engine.block_size,
        kv_bytes_per_token=engine.kv_bytes_per_token,
        labels={POOL_OF_LABEL: engine.name, POOL_CAPACITY_LABEL: str(capacity_bytes)},
    )


class Agent:
    """The sidecar of one vLLM worker. `start()` once, `shutdown()` once."""

    def __init__(
        self,
        settings: AgentSettings,
        registry: RegistryPort,
        *,
        replay: ReplayPort | None = None,
        zmq_context: zmq.asyncio.Context | None = None,
    ) -> None:
        """`replay` replaces the ZMQ replay client (tests); `zmq_context` is shared when given
        (and then not closed here)."""
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
        self.pool_memory: NixlPoolMemory | None = None
        self.parker: Parker | None = None
        self.server: PoolServer | None = None
        self.mover: Mover | None = None
        self.pool_lease: NodeLease | None = None  # the served pool's node
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def start(self, *, agent_endpoint: str = "") -> None:
        """Start the loops; the node registers with `agent_endpoint` as its agent's address."""
        if self._tasks:
            raise RuntimeError("the agent is already started")
        self.lease.spec.agent_endpoint = agent_endpoint
        if self.pool is not None:
            # Here, not at module import: an agent without a pool runs without NIXL installed.
            from kvshuttle.agent.mover import Mover  # noqa: PLC0415
            from kvshuttle.agent.nixl_memory import NixlPoolMemory  # noqa: PLC0415
            from kvshuttle.agent.park import Parker  # noqa: PLC0415
            from kvshuttle.agent.serve import PoolServer  # noqa: PLC0415

            self.engine_nixl = await self._verify_engine(self.pool)
            # A fresh NIXL name per start: peers cache remote agents by name.
            node = self.lease.spec.name.removeprefix("nodes/")
            self.pool_memory = NixlPoolMemory(
                self.pool.layout, agent_name=f"kvshuttle-{node}-{uuid.uuid4().hex[:12]}"
            )
            pool_cfg = self.settings.pool
            self.parker = Parker(
                self.pool,
                self.pool_memory,
                timeout=pool_cfg.park_timeout,
                max_remotes=pool_cfg.max_remote_agents,
            )
            if pool_cfg.serve_port is not None:
                assert self._context is not None  # made for the pool in __init__
                self.server = PoolServer(
                    self.pool,
                    self.pool_memory,
                    self.engine_nixl,
                    self._context,
                    host=pool_cfg.serve_host,
                    port=pool_cfg.serve_port,
                    lease=pool_cfg.serve_lease,
                    grace=pool_cfg.serve_grace,
                )
                await self.server.start()
                spec = pool_node_spec(
                    self.lease.spec,
                    engine_id=self.server.engine_id,
                    host=self.server.host,
                    port=self.server.port,
                    capacity_bytes=self.pool.layout.total_bytes,
                )
                self.mover = Mover(
                    pool=self.pool,
                    parker=self.parker,
                    server=self.server,
                    registry=self._registry,
                    engine=self.engine_nixl,
                    context=self._context,
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
            self._spawn("pool.expire", functools.partial(self._expire_pool, self.pool))
        self._spawn("lease", self.lease.run)
        self._spawn("engine", self.poller.run)
        if self.receiver is not None and self.forwarder is not None:
            self._spawn("events.receive", self.receiver.run)
            self._spawn("events.forward", self.forwarder.run)
        log.info(
            "agent.started",
            node=self.lease.spec.name,
            engine=self.settings.node.http_endpoint,
            events=self.settings.events.endpoint,
            replay=self.settings.events.replay_endpoint,
            agent_endpoint=agent_endpoint,
            pool_bytes=self.pool.layout.total_bytes if self.pool is not None else 0,
        )

    async def _verify_engine(self, pool: BlockPool) -> Handshake:
        """The engine's NIXL handshake, checked against the pin and the pool's layout. Retries
        while the side channel does not answer (the engine may still be starting); raises
        NixlIncompatible, FailedPrecondition (the pool does not mirror the engine's blocks) or
        InvalidArgument (what answers is no vLLM side channel), logged as agent.engine_refused."""
        node = self.settings.node
        where = side_channel_endpoint(node.side_channel_host, node.side_channel_port)
        expected = Expected(
            block_size=node.block_size,
            engine_id=node.engine_id,
            nixl_version=importlib.metadata.version("nixl"),
        )
        backoff = Backoff(self.settings.lease.retry_initial, self.settings.lease.retry_max)
        attempts, warned_at = 0, -_UNREACHABLE_LOG_EVERY
        assert self._context is not None  # made for the pool in __init__
        while True:
            try:
                handshake = await verify_engine(
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
        await self._cancel("events.receive", "engine", "pool.expire", "pool.lease")
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
        if self.server is not None:
            await self.server.close()
        if self._owns_context and self._context is not None:
            self._context.destroy(linger=0)
        if self.pool_memory is not None:
            # Waits for a READ in flight: none may still write into the memory.
            await asyncio.to_thread(self.pool_memory.close)
        log.info("agent.stopped", node=self.lease.spec.name)

    def status(self) -> AgentStatus:
        return AgentStatus(
            lease=self.lease.state,
            http_endpoint=self.settings.node.http_endpoint,
            engine_id=self.settings.node.engine_id,
            engine=self.poller.state,
            events=self.events,
            pool=self.pool.stats() if self.pool is not None else None,
        )
