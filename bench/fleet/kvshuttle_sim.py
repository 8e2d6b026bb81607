"""kvshuttle on the simulated fleet: its real router (`Router`: planner, committer, shuttle) over its
real registry (`Registry`, in-memory store, block index fed by KV events), driven by the
gateway's real `TurnRunner`, in process and in virtual time. What runs between them deployed
is modelled, with its delays:

* **Agents**, one per engine (`SimAgent`): register the engine's node (and its pool's, with
  parking or prefetch), heartbeat every `heartbeat_s` with the engine's load as last polled
  (`load_poll_s`), forward the engine's KV events to the registry's block index after their lag
  plus the forwarder's `linger`, and park or prefetch a retention into their host pool (DRAM
  beside the engine) when the shuttle asks: the read takes the engine's PCIe link (park, the
  agent's own engine) or the reading engine's NIC (prefetch, from another node).
* **The control plane's own time**: each PlanTurn waits a delay drawn from the distribution the
  load bench measured over real gRPC (bench/results/load-20261202T125724Z.json: the control
  plane's share of a turn's latency, gateway hops, PlanTurn and its registry calls included;
  p50 11.36 ms, p99 16.09 ms, fitted as a lognormal). kvshuttle pays for its hops; nothing else
  of the deployed system is charged.

The gateway's ports are implemented over the simulated engines: `_EnginePort` answers vLLM's
`/v1/completions` bodies (the prompt is the turn's own, `Prompt` with its chain keys; the body's
`kv_transfer_params` and `max_tokens` are read from the JSON) and streams the first token at its
time, the rest at the end; `_RouterPort` calls the router's domain object through the gRPC
servicer's own conversions.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import os
import random
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Final

import orjson
import structlog
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from bench.emulator.fleet.engine import Completion, KvSource, Prompt, SimEngine
from bench.emulator.fleet.fleet import Fleet
from bench.fleet.inproc import InProcessPort
from bench.fleet.replay import Served, SimTurn
from kvshuttle.core.errors import FailedPrecondition, KvshuttleError, NotFound, ResourceExhausted
from kvshuttle.core.kv_events import BlockRemoved, BlockStored, EventBatch
from kvshuttle.core.limits import MAX_EVENT_BLOCKS, MAX_EVENTS_PER_BATCH
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec, pool_node_name
from kvshuttle.core.prototime import to_duration
from kvshuttle.gateway.errors import RouterFailure
from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.gateway.turns.background import BackgroundTasks
from kvshuttle.gateway.turns.record import DecodeOutput, Turn
from kvshuttle.gateway.turns.runner import TurnRunner
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.router.cost import CostModel, ModelProfile
from kvshuttle.router.grpc import convert
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.model import Pooled
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.router.router import Router
from kvshuttle.router.turns import TurnCodec
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

__all__ = ["MEASURED_CONTROL_PLANE", "AgentModel", "Kvshuttle"]

EPOCH: Final = 1_800_000_000.0  # the registry's wall clock at virtual time 0
SIDE_CHANNEL_PORT: Final = 5600
MODEL: Final = "sim"


@dataclass(frozen=True, slots=True)
class Lognormal:
    median_s: float
    p99_s: float

    def draw(self, rng: random.Random) -> float:
        sigma = math.log(self.p99_s / self.median_s) / 2.3263
        return rng.lognormvariate(math.log(self.median_s), sigma)


MEASURED_CONTROL_PLANE: Final = Lognormal(0.01136, 0.01609)


@dataclass(frozen=True, slots=True)
class AgentModel:
    """The deployed agent's cadence (kvshuttle.agent.config's defaults)."""

    heartbeat_s: float = 2.0
    load_poll_s: float = 1.0
    linger_s: float = 0.05  # the KV-event forwarder's
    max_batches_per_report: int = 64  # ... and its report's
    lease_ttl_s: float = 10.0
    pool_gib: float = 0.0  # the agent's host pool (parking, prefetch); 0: none


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """kvshuttle's services log one line per RPC; a simulation of thousands of turns keeps only
    errors (KVSHUTTLE_FLEET_LOG_LEVEL=20 to see them all). The process's config comes back after."""
    saved = structlog.get_config()
    level = int(os.environ.get("KVSHUTTLE_FLEET_LOG_LEVEL", "40"))
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))
    try:
        yield
    finally:
        structlog.configure(**saved)


class _SimClock:
    def now(self) -> float:
        return EPOCH + asyncio.get_running_loop().time()


def _monotonic() -> float:
    return asyncio.get_running_loop().time()


@dataclass(slots=True)
class _Held:
    contents: list[int]
    expire_at: float
    parked_at: float
    retention: str  # the registry's name of what it holds


class _Pool(KvSource):
    """An agent's host pool: parked retentions by name, read once, bounded by blocks. Short of
    room, the agent evicts as kvshuttle.agent.pool.mover does: the oldest parked first (the
    conversation least likely to come back), then the largest, each once the registry dropped
    it (a claimed one stays)."""

    def __init__(self, name: str, engine: SimEngine, capacity_blocks: int) -> None:
        self.name = name
        self.nic = engine.nic
        self.engine = engine
        self.capacity_blocks = capacity_blocks
        self._held: dict[str, _Held] = {}
        # Slots set aside for moves whose READ is under way (the agent allocates before it reads).
        self._reserved: dict[str, int] = {}

    def used_blocks(self) -> int:
        now = asyncio.get_running_loop().time()
        for name in [n for n, h in self._held.items() if h.expire_at <= now]:
            del self._held[name]
        return sum(len(h.contents) for h in self._held.values()) + sum(self._reserved.values())

    def reserve(self, name: str, blocks: int) -> bool:
        if not self.fits(blocks):
            return False
        self._reserved[name] = blocks
        return True

    def unreserve(self, name: str) -> None:
        self._reserved.pop(name, None)

    def fits(self, blocks: int) -> bool:
        return self.used_blocks() + blocks <= self.capacity_blocks

    def eviction_order(self) -> list[tuple[str, str]]:
        """(holding, retention) of what it holds, the first to evict first."""
        ordered = sorted(self._held.items(), key=lambda kv: (kv[1].parked_at, -len(kv[1].contents)))
        return [(name, h.retention) for name, h in ordered]

    def drop(self, holding: str) -> None:
        self._held.pop(holding, None)

    def put(self, contents: list[int], ttl: float, name: str, retention: str) -> None:
        """What a move reserved room for (`reserve`), read."""
        self.unreserve(name)
        now = asyncio.get_running_loop().time()
        self._held[name] = _Held(contents, now + ttl, now, retention)

    def take(self, holding: str, upto_blocks: int) -> list[int] | None:
        held = self._held.pop(holding, None)
        now = asyncio.get_running_loop().time()
        if held is None or held.expire_at <= now or upto_blocks > len(held.contents):
            return None
        return held.contents[:upto_blocks]


class SimAgent:
    def __init__(self, engine: SimEngine, registry: Registry, model: AgentModel, fleet: Fleet) -> None:
        self.engine = engine
        self.registry = registry
        self.model = model
        self.node = f"nodes/{engine.name}"
        self.incarnation = 0
        self._fleet = fleet
        self.pool: _Pool | None = None
        if model.pool_gib > 0:
            blocks = int(model.pool_gib * 2**30 // engine.block_bytes)
            self.pool = _Pool(f"{engine.name}-pool", engine, blocks)
            fleet.add_source(self.pool)
        self._load = NodeLoad(engine_healthy=True)
        self._events: list[Any] = []
        self._seq = 0
        self._flush: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._reports: set[asyncio.Task[None]] = set()  # KV-event reports in flight

    def spec(self) -> NodeSpec:
        e = self.engine
        return NodeSpec(
            name=self.node,
            role=NodeRole.PREFILL if e.config.role == "prefill" else NodeRole.DECODE,
            engine_id=e.name,
            http_endpoint=f"http://{e.name}:8000",
            side_channel_host=e.name,
            side_channel_port=SIDE_CHANNEL_PORT,
            agent_endpoint=f"{e.name}:9000",
            model=MODEL,
            block_size=e.config.block_size,
            kv_bytes_per_token=e.config.profile.kv_bytes_per_token,
        )

    async def start(self) -> None:
        spec = self.spec()
        node = await self.registry.register_node(spec, self.model.lease_ttl_s)
        self.incarnation = node.incarnation
        if self.pool is not None:
            await self.registry.register_node(
                replace(
                    spec,
                    name=pool_node_name(self.node),
                    role=NodeRole.POOL,
                    engine_id=self.pool.name,
                    side_channel_host=self.pool.name,
                    labels={"kvshuttle.io/pool-of": self.node},
                ),
                self.model.lease_ttl_s,
            )
        await self._poll_load()
        await self._heartbeat()
        loop = asyncio.get_running_loop()
        # Real agents start when their engines come up, not at one instant: each agent's ticks
        # fall at its own phase (fixed by its name), so that the fleet's loads do not all change
        # at the same even seconds and the router does not see every engine refresh at once.
        phase = zlib.crc32(self.node.encode()) / 2**32
        self._tasks = [loop.create_task(self._every(self.model.heartbeat_s, phase, self._heartbeat))]
        self._tasks.append(loop.create_task(self._every(self.model.load_poll_s, phase, self._poll_load)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @staticmethod
    async def _every(period: float, phase: float, call: Any) -> None:
        """`call` every `period` from `phase` (a fraction of it) into the first."""
        await asyncio.sleep(period * phase)
        while True:
            await call()
            await asyncio.sleep(period)

    async def _poll_load(self) -> None:
        e = self.engine
        self._load = NodeLoad(e.running - e.waiting, e.waiting, e.kv_usage(), True)

    async def _heartbeat(self) -> None:
        await self.registry.heartbeat_node(self.node, self.incarnation, self.model.lease_ttl_s, self._load)
        if self.pool is not None:
            pool = pool_node_name(self.node)
            got = await self.registry.get_node(pool)
            await self.registry.heartbeat_node(
                pool, got.incarnation, self.model.lease_ttl_s, NodeLoad(engine_healthy=True)
            )

    # -- KV events ---------------------------------------------------------------------------

    def on_event(
        self, engine: SimEngine, kind: str, keys: list[int], first: int, medium: str, tokens: Any
    ) -> None:
        """An event reaching the agent (after the fleet's KV-event lag): batched for `linger`."""
        if medium != "GPU":
            return
        bs = engine.config.block_size
        for start in range(0, len(keys), MAX_EVENT_BLOCKS):
            part = keys[start : start + MAX_EVENT_BLOCKS]
            if kind == "stored":
                at = first + start
                self._events.append(
                    BlockStored(
                        block_hashes=tuple(part),
                        parent_block_hash=tokens[1] if start == 0 else keys[start - 1],
                        token_ids=tokens[0][at * bs : (at + len(part)) * bs],
                        block_size=bs,
                        lora_id=None,
                        medium="GPU",
                    )
                )
            else:
                self._events.append(BlockRemoved(block_hashes=tuple(part), medium="GPU"))
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self.model.linger_s, self._report)

    def _report(self) -> None:
        """What the linger gathered, as the agent's forwarder sends it: batches of at most the
        registry's events per batch, reports of at most `max_batches_per_report` batches."""
        self._flush = None
        events, self._events = self._events, []
        loop = asyncio.get_running_loop()
        batches = []
        for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
            batches.append(
                EventBatch(
                    self._seq, EPOCH + loop.time(), tuple(events[start : start + MAX_EVENTS_PER_BATCH])
                )
            )
            self._seq += 1
        task = loop.create_task(self._send(batches))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _send(self, batches: list[EventBatch]) -> None:
        per_report = self.model.max_batches_per_report
        for start in range(0, len(batches), per_report):
            await self.registry.report_block_events(
                self.node, self.incarnation, batches[start : start + per_report]
            )

    # -- the pool ----------------------------------------------------------------------------

    async def move(self, retention: str, source: dict[str, Any], ttl: float, *, park: bool) -> Pooled:
        """Read `source`'s blocks (its own engine's when parking, a peer's or a pool's when
        prefetching) into this agent's pool; the params that read them there."""
        if self.pool is None:
            raise FailedPrecondition("this agent serves no pool")
        bs = self.engine.config.block_size
        n = int(source.get("remote_num_tokens") or 0)
        # Room first, as the agent allocates its slots before its READ: a move refused for room
        # leaves the retention where it is.
        name = f"{self.pool.name}/{retention}"
        await self._make_room(-(-n // bs))
        if not self.pool.reserve(name, -(-n // bs)):
            raise ResourceExhausted("the pool is full")
        holder = self._fleet.sources.get(str(source.get("remote_engine_id")))
        got = holder.take(str(source.get("remote_request_id")), -(-n // bs)) if holder is not None else None
        if got is None:
            self.pool.unreserve(name)
            raise FailedPrecondition("the holder no longer has the blocks")
        link = self.engine.pcie if park and self.engine.pcie is not None else self.engine.nic
        try:
            await link.transfer(len(got) * self.engine.block_bytes)
        except BaseException:
            self.pool.unreserve(name)
            raise
        self.pool.put(got, ttl, name, retention)
        params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_block_ids": [list(range(len(got)))],
            "remote_engine_id": self.pool.name,
            "remote_request_id": name,
            "remote_host": self.pool.name,
            "remote_port": SIDE_CHANNEL_PORT,
            "remote_num_tokens": min(n, len(got) * bs),
            "tp_size": 1,
        }
        return Pooled(pool_node_name(self.node), params)

    async def _make_room(self, blocks: int) -> None:
        pool = self.pool
        assert pool is not None
        if pool.fits(blocks):
            return
        for holding, retention in pool.eviction_order():
            if pool.fits(blocks):
                return
            try:
                await self.registry.evict_retention(retention, node=pool_node_name(self.node))
            except NotFound:
                pass  # gone from the registry already
            except FailedPrecondition:
                continue  # claimed (a reader is on it), or not moved here yet
            pool.drop(holding)


class _AgentPort:
    """The router's AgentPort over the simulated agents, by agent endpoint."""

    def __init__(self, agents: dict[str, SimAgent], by_node: dict[str, SimAgent]) -> None:
        self._agents = agents
        self._by_node = by_node

    async def park(
        self, endpoint: str, retention: str, *, source: dict[str, Any], ttl: float, request_id: str
    ) -> Pooled:
        return await self._agents[endpoint].move(retention, source, ttl, park=True)

    async def prefetch(
        self,
        endpoint: str,
        retention: str,
        target_node: str,
        *,
        source: dict[str, Any],
        ttl: float,
        request_id: str,
    ) -> Pooled:
        return await self._by_node[target_node].move(retention, source, ttl, park=False)

    async def serving(self, endpoint: str, *, deadline_s: float) -> bool:
        agent = self._agents.get(endpoint)
        return agent is not None and agent.pool is not None

    async def close(self) -> None:
        return None


# The turn being served, for the engine port: the body's prompt is this turn's.
_PROMPT: contextvars.ContextVar[Prompt] = contextvars.ContextVar("prompt")
_DONE: contextvars.ContextVar[dict[str, tuple[str, Completion]]] = contextvars.ContextVar("done")


class _EnginePort:
    def __init__(self, engines: dict[str, SimEngine]) -> None:
        self._engines = engines

    def _engine(self, endpoint: str) -> SimEngine:
        return self._engines[endpoint.removeprefix("http://").split(":")[0]]

    @staticmethod
    def _body(body: bytes) -> tuple[int, dict[str, Any]]:
        # The prompt (the turn's own) is skipped: only the fields after it are parsed.
        end = body.index(b"]") + 1
        fields = orjson.loads(b"{" + body[end + 1 :]) if body[end : end + 1] == b"," else {}
        return int(fields.get("max_tokens") or 16), dict(fields.get("kv_transfer_params") or {})

    async def complete(
        self, role: str, endpoint: str, body: bytes, headers: Mapping[str, str], *, timeout_s: float
    ) -> dict[str, Any]:
        engine = self._engine(endpoint)
        max_tokens, params = self._body(body)
        done = await engine.complete(_PROMPT.get(), max_tokens, params)
        _DONE.get()[role] = (engine.name, done)
        return _answer(done)

    def stream(
        self, role: str, endpoint: str, body: bytes, headers: Mapping[str, str]
    ) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        return self._stream(role, endpoint, body)

    @asynccontextmanager
    async def _stream(
        self, role: str, endpoint: str, body: bytes
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        engine = self._engine(endpoint)
        max_tokens, params = self._body(body)
        prompt = _PROMPT.get()
        done_box = _DONE.get()

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            done = await engine.complete(prompt, max_tokens, params)
            done_box[role] = (engine.name, done)
            yield _answer(done)

        yield chunks()


def _answer(done: Completion) -> dict[str, Any]:
    return {
        "choices": [{"text": "", "token_ids": done.output.tolist(), "finish_reason": "length", "index": 0}],
        "usage": {"prompt_tokens": 0, "completion_tokens": len(done.output)},
        "kv_transfer_params": dict(
            done.params or {},
            remote_prefill_cached_tokens=done.cached_tokens + done.read_tokens + done.host_tokens,
        )
        if done.params
        else None,
    }


class _RouterPort:
    """The gateway's router client over `routers` (the replicas): each conversation's calls go
    to one replica, as the gateway's default affinity sends them (a hash of the conversation
    standing in for its rendezvous hashing)."""

    def __init__(self, routers: Sequence[Router], rng: random.Random, delay: Lognormal | None) -> None:
        self._routers = list(routers)
        self._rng = rng
        self._delay = delay

    def _router(self, conversation: str) -> Router:
        return self._routers[zlib.crc32(conversation.encode()) % len(self._routers)]

    @asynccontextmanager
    async def _failures(self) -> AsyncIterator[None]:
        try:
            yield
        except KvshuttleError as err:
            raise RouterFailure(err.code.name, err.message, reason=err.reason) from err

    async def plan_turn(
        self,
        model: str,
        prompt_token_ids: Iterable[int],
        *,
        conversation: str,
        request_id: str,
        cache_salt_sha256: bytes,
        expected_think_time_s: float | None = None,
        decode_endpoints: Sequence[str] = (),
        tenant: str = "",
    ) -> pb.PlanTurnResponse:
        if self._delay is not None:
            await asyncio.sleep(self._delay.draw(self._rng))
        # The prompt is the turn's own (prompt_token_ids, as a list): the router gets its array,
        # as it would the request's repeated field, without a copy into a message and out again.
        request = pb.PlanTurnRequest(
            model=model,
            conversation=conversation,
            request_id=request_id,
            cache_salt_sha256=cache_salt_sha256,
            tenant=tenant,
        )
        if expected_think_time_s is not None:
            request.hints.expected_think_time.CopyFrom(to_duration(expected_think_time_s))
        plan = replace(convert.plan_request_from_pb(request), prompt_token_ids=_PROMPT.get().tokens)
        async with self._failures():
            return convert.plan_to_pb(await self._router(conversation).plan_turn(plan))

    async def commit_turn(
        self,
        turn: str,
        *,
        conversation: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        decode_kv_transfer_params: KvTransferParams | None,
        timings: pb.TurnTimings,
        turn_end: pb.TurnEnd.ValueType = pb.TURN_END_UNSPECIFIED,
        transcript: pb.TranscriptSpec | None = None,
    ) -> pb.CommitTurnResponse:
        """As the gateway commits (kvshuttle.gateway.turns.router_port): the output alone, the
        router holding the prompt since the plan; the whole sequence when it does not."""
        request = pb.CommitTurnRequest(
            turn=turn, timings=timings, request_id=f"c-{turn[-24:]}", turn_end=turn_end, transcript=transcript
        )
        if decode_kv_transfer_params is not None:
            request.decode_kv_transfer_params.CopyFrom(decode_kv_transfer_params)
        request.output_token_ids.token_ids.extend(output_token_ids)
        try:
            async with self._failures():
                result = await self._router(conversation).commit_turn(convert.commit_request_from_pb(request))
        except RouterFailure as err:
            if err.reason != "PROMPT_NOT_HELD":
                raise
            request.ClearField("output_token_ids")
            request.token_ids.extend(prompt_token_ids)
            request.token_ids.extend(output_token_ids)
            async with self._failures():
                result = await self._router(conversation).commit_turn(convert.commit_request_from_pb(request))
        return pb.CommitTurnResponse(retention=result.retention)

    async def abort_turn(self, turn: str, *, conversation: str, reason: str) -> None:
        async with self._failures():
            await self._router(conversation).abort_turn(turn, reason)


class Kvshuttle:
    """`policy`: the router's (RouterPolicy(): as shipped); the fleet's decode must retain
    (FleetConfig.retain_decode: vLLM's bidirectional_kv_xfer). `replicas`: router replicas the
    gateway spreads its calls over, round robin."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        name: str = "kvshuttle",
        policy: RouterPolicy | None = None,
        agent: AgentModel | None = None,
        seed: int = 0,
        control_plane: Lognormal | None = MEASURED_CONTROL_PLANE,
        replicas: int = 1,
    ) -> None:
        self.name = name
        self.fleet = fleet
        self.agent_model = agent or AgentModel()
        profile = fleet.config.profile
        self.clock = _SimClock()
        self.registry = Registry(InMemoryStore(), self.clock, BlockIndex(10_000_000), RegistryLimits())
        self.agents = [SimAgent(e, self.registry, self.agent_model, fleet) for e in fleet.engines]
        by_endpoint = {a.spec().agent_endpoint: a for a in self.agents}
        by_node = {a.node: a for a in self.agents}
        model_profile = ModelProfile(
            model=MODEL,
            kv_bytes_per_token=profile.kv_bytes_per_token,
            prefill=profile.prefill,
            link=profile.link,
            min_reuse_tokens=profile.min_reuse_tokens,
        )
        self.policy = policy or RouterPolicy()
        # Replicas share the registry and the turn-signing key; each has its own ledger, hints,
        # cost calibration and shuttle, as deployed.
        self.routers = [
            Router(
                InProcessPort(self.registry),
                self.clock,
                [CostModel(model_profile)],
                TurnCodec(b"fleet-simulator-turn-key"),
                self.policy,
                RouterMetrics(CollectorRegistry()),
                tracer_provider=trace.NoOpTracerProvider(),
                agents=_AgentPort(by_endpoint, by_node),
                monotonic=_monotonic,
                rng=random.Random(f"router-{seed}" if i == 0 else f"router-{seed}-{i}"),
            )
            for i in range(replicas)
        ]
        tracer = trace.get_tracer("kvshuttle.fleet", tracer_provider=trace.NoOpTracerProvider())
        self.runner = TurnRunner(
            _RouterPort(self.routers, random.Random(f"cp-{seed}"), control_plane),
            _EnginePort({e.name: e for e in fleet.engines}),
            tracer=tracer,
            metrics=GatewayMetrics(CollectorRegistry()),
            background=BackgroundTasks(),
            prefill_timeout_s=600.0,
            reuse_prefill_timeout_s=600.0,
            decode_timeout_s=3600.0,
            commit_wait_s=2.0,
            clock=_monotonic,
        )
        self._by_engine = {a.engine.name: a for a in self.agents}
        fleet.event_hooks.append(self._on_event)
        self._tasks: list[asyncio.Task[None]] = []
        self._n = 0

    def _on_event(
        self, engine: SimEngine, kind: str, keys: list[int], first: int, medium: str, tokens: Any
    ) -> None:
        self._by_engine[engine.name].on_event(engine, kind, keys, first, medium, tokens)

    async def start(self) -> None:
        for agent in self.agents:
            await agent.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(r.run_shuttle()) for r in self.routers]
        self._tasks.append(loop.create_task(self.registry.run_expiry()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for agent in self.agents:
            await agent.stop()

    async def serve(self, turn: SimTurn) -> Served:
        self._n += 1
        loop = asyncio.get_running_loop()
        done: dict[str, tuple[str, Completion]] = {}
        _PROMPT.set(turn.prompt)
        _DONE.set(done)
        record = Turn(
            request_id=f"t{self._n}",
            model=MODEL,
            conversation=f"tenants/sim/conversations/{turn.conversation}",
            prompt_ids=turn.ids(),
            prefill_params={},
            decode_params={"max_tokens": turn.output},
            arrived=loop.time(),
            # No think-time hint: the trace's next gap is what no client knows and no peer is
            # given (the shuttle's prefetch, which reads the hint, stays idle here). How the
            # answer ended is what the gateway reads from the answer itself (a parsed tool call).
            finish_reason=_finish(turn.stop.value),
        )
        await self.runner.complete(record)
        d_name, answer = done["decode"]
        p_name, pre = done.get("prefill", ("", None))
        return Served(
            answer,
            p_name,
            d_name,
            record.decision,
            record.reason,
            (pre.cached_tokens + pre.read_tokens + pre.host_tokens) if pre else answer.cached_tokens,
            pre,
        )


def _finish(reason: str) -> Callable[[DecodeOutput], str | None]:
    """The trace's stop reason as the answer's finish_reason (its values are vLLM's)."""
    return lambda _out: reason
