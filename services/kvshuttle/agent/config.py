"""The agent's configuration: one object, from KVSHUTTLE_AGENT_* environment variables (nested
with "__"), e.g. for the decode worker of a P/D pair:

    KVSHUTTLE_AGENT_SERVER__LISTEN=0.0.0.0:50071
    KVSHUTTLE_AGENT_REGISTRY__ADDRESS=registry:50051
    KVSHUTTLE_AGENT_NODE__NAME=decode-0                  (or nodes/decode-0)
    KVSHUTTLE_AGENT_NODE__ROLE=decode                    (prefill | decode | both)
    KVSHUTTLE_AGENT_NODE__ENGINE_ID=...                  (vLLM kv_transfer_config.engine_id)
    KVSHUTTLE_AGENT_NODE__ENGINE_ID_FILE=/run/engine/id  (or: a file holding it, followed; see below)
    KVSHUTTLE_AGENT_NODE__HTTP_ENDPOINT=http://10.0.0.7:8000
    KVSHUTTLE_AGENT_NODE__SIDE_CHANNEL_HOST=10.0.0.7     (VLLM_NIXL_SIDE_CHANNEL_HOST)
    KVSHUTTLE_AGENT_NODE__SIDE_CHANNEL_PORT=5600
    KVSHUTTLE_AGENT_NODE__MODEL=Qwen/Qwen3-32B           (the served model name)
    KVSHUTTLE_AGENT_NODE__BLOCK_SIZE=16
    KVSHUTTLE_AGENT_NODE__KV_BYTES_PER_TOKEN=262144
    KVSHUTTLE_AGENT_NODE__LABELS='{"zone": "a"}'
    KVSHUTTLE_AGENT_NODE__AGENT_ENDPOINT=10.0.0.7:50071  (what others dial; default: the listen
                                                          address when its host is not a wildcard)
    KVSHUTTLE_AGENT_EVENTS__ENDPOINT=tcp://127.0.0.1:5557         (vLLM kv_events_config.endpoint)
    KVSHUTTLE_AGENT_EVENTS__REPLAY_ENDPOINT=tcp://127.0.0.1:5558  (its replay_endpoint)
    KVSHUTTLE_AGENT_EVENTS__TOPIC=kv-events
    KVSHUTTLE_AGENT_LEASE__TTL=10
    KVSHUTTLE_AGENT_ENGINE__POLL_INTERVAL=1
    KVSHUTTLE_AGENT_ENGINE__ID_POLL_INTERVAL=2           (how often node.engine_id_file is read)
    KVSHUTTLE_AGENT_ENGINE__ID_WAIT_TIMEOUT=600          (how long start waits for that file)
    KVSHUTTLE_AGENT_POOL__SIZE_BYTES=8589934592          (host memory for parked KV; 0: no pool)
    KVSHUTTLE_AGENT_POOL__REGIONS=128                    (the engine's NIXL regions: one per layer)
    KVSHUTTLE_AGENT_POOL__SERVE_HOST=10.0.0.7            (the side channel prefill reads parked KV
    KVSHUTTLE_AGENT_POOL__SERVE_PORT=5660                 through; port 0: any free one)
    KVSHUTTLE_AGENT_POOL__MAX_MOVE_TTL=3600              (the longest ttl a park may ask for)

Exactly one of node.engine_id and node.engine_id_file. With the file (written by whatever starts
the engine, with a fresh id per start), the agent waits for it at start and follows it: when its
content changes, the engine restarted, and the agent registers the node again with the new id
(kvshuttle.agent.engine_id).

With a pool and a serve port, the agent also registers its pool as node `{node.name}-pool`
(role pool), which parked and prefetched retentions are moved to.

With a pool, the agent checks its engine at start (NIXL handshake on the side channel): it
waits for an engine that does not answer yet, and refuses to start beside one it cannot read.

vLLM binds its PUB and replay sockets when their endpoints hold `*` (`tcp://*:5557`); the agent
connects to the same ports on the engine's host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvshuttle.agent.pool.blocks import PoolLayout
from kvshuttle.client.settings import ServiceConnection
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.limits import MAX_EVENT_BATCHES
from kvshuttle.core.names import check_id
from kvshuttle.core.nodes import pool_node_name
from kvshuttle.serving.settings import AuthSettings, ServerSettings, TelemetrySettings

__all__ = [
    "AgentSettings",
    "EngineSettings",
    "EventsSettings",
    "LeaseSettings",
    "NodeSettings",
    "PoolSettings",
]

_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


class NodeSettings(BaseModel):
    """The vLLM worker this agent registers (what RegisterNode's Node carries)."""

    # "decode-0" or "nodes/decode-0".
    name: str
    role: Literal["prefill", "decode", "both"]
    # vLLM's NixlConnector engine id (kv_transfer_config.engine_id): readers name it as
    # remote_engine_id. Give a restarted engine a fresh one. Exactly one of engine_id and
    # engine_id_file: a file holding the id, read at start and followed while running.
    engine_id: str | None = None
    engine_id_file: Path | None = None
    # Base URL of the worker's OpenAI-compatible server; /health and /metrics are polled there.
    http_endpoint: str
    # The engine's NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT).
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = Field(default=5600, gt=0, lt=65536)
    # Served model name.
    model: str
    block_size: int = Field(gt=0, le=4096)
    kv_bytes_per_token: int = Field(gt=0)
    labels: dict[str, str] = Field(default_factory=dict)
    # host:port other services dial for this agent; None: the listen address, unless its host
    # is a wildcard (then none is advertised: set it).
    agent_endpoint: str | None = None

    @field_validator("name")
    @classmethod
    def _node_name(cls, value: str) -> str:
        node = value.removeprefix("nodes/")
        try:
            check_id(node, "node.name")
        except InvalidArgument as exc:
            raise ValueError(exc.message) from exc
        return f"nodes/{node}"

    @model_validator(mode="after")
    def _one_engine_id(self) -> Self:
        if (self.engine_id is None) == (self.engine_id_file is None):
            raise ValueError("set exactly one of engine_id and engine_id_file")
        return self

    @field_validator("http_endpoint")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/")


class LeaseSettings(BaseModel):
    """The node's liveness lease."""

    # Lease duration (seconds); the registry accepts 1..300 by default.
    ttl: float = Field(default=10.0, gt=0)
    # Seconds between heartbeats; must be under ttl / 3 (two may fail before the lease lapses).
    heartbeat_interval: float = Field(default=2.0, gt=0)
    # Backoff of registration and report retries while the registry cannot be reached.
    retry_initial: float = Field(default=0.1, gt=0)
    retry_max: float = Field(default=2.0, gt=0)
    # Deadline of the DeregisterNode sent on shutdown.
    deregister_timeout: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.heartbeat_interval >= self.ttl / 3:
            raise ValueError("heartbeat_interval must be below ttl / 3")
        if self.retry_max < self.retry_initial:
            raise ValueError("retry_max must be at least retry_initial")
        return self


class EventsSettings(BaseModel):
    """The engine's KV-event stream (vLLM --kv-events-config) and its forwarding."""

    # The engine's ZMQ publisher, e.g. "tcp://127.0.0.1:5557"; None: no event stream.
    endpoint: str | None = None
    # The engine's replay ROUTER, e.g. "tcp://127.0.0.1:5558"; None: gaps are not filled.
    replay_endpoint: str | None = None
    # vLLM's kv_events_config.topic ("" by default: every message).
    topic: str = ""
    # Batches waiting to be forwarded; past this the newest are dropped (and counted).
    queue_size: int = Field(default=4096, gt=0)
    # One ReportBlockEvents carries at most this many batches and about this many bytes.
    max_batches_per_report: int = Field(default=64, gt=0, le=MAX_EVENT_BATCHES)
    max_report_bytes: int = Field(default=2 * 1024 * 1024, gt=0)
    # Seconds a report waits after its first batch for more to join it.
    linger: float = Field(default=0.05, ge=0)
    # A replay fetch: its deadline (seconds) and the most batches it asks for.
    replay_timeout: float = Field(default=2.0, gt=0)
    replay_max_batches: int = Field(default=10_000, gt=0)
    # The KV-cache group whose events are forwarded (hybrid models publish one per group);
    # None: all of them.
    kv_cache_group: int | None = 0
    # ZMQ receive high-water mark of the SUB socket (messages).
    receive_hwm: int = Field(default=10_000, gt=0)


class EngineSettings(BaseModel):
    """Polling of the engine's /health and /metrics, and of its id file."""

    # Seconds between polls of the engine's /health and /metrics (its load).
    poll_interval: float = Field(default=1.0, gt=0)
    # Deadline of one HTTP request.
    poll_timeout: float = Field(default=1.0, gt=0)
    # node.engine_id_file: seconds between reads of it, and how long start waits for it (the
    # engine beside the agent writes it as it starts; past this the agent refuses to start).
    id_poll_interval: float = Field(default=2.0, gt=0)
    id_wait_timeout: float = Field(default=600.0, gt=0)


class PoolSettings(BaseModel):
    """The DRAM block pool parked KV lives in: host memory registered with NIXL (UCX)."""

    # Bytes of host memory; 0: no pool (nothing registered with NIXL, nothing parked). Rounded
    # down to whole slots.
    size_bytes: int = Field(default=0, ge=0)
    # The engine's KV layout, which slots mirror so blocks move one for one: vLLM registers one
    # region per attention layer (block_lens / region_names in its NIXL handshake).
    regions: int = Field(default=1, gt=0)
    # Bytes of one block in one region; None: node.block_size * node.kv_bytes_per_token / regions.
    block_bytes: int | None = Field(default=None, gt=0)
    # Seconds between expiry sweeps of parked retentions.
    expire_interval: float = Field(default=1.0, gt=0)
    # Deadline of one park's NIXL READ (seconds); the engine's pin on the blocks must outlast it.
    park_timeout: float = Field(default=10.0, gt=0)
    # The side channel prefill engines read parked KV through (kvshuttle.agent.pool.serve): bound and
    # advertised as is, so a host they reach, never a wildcard. Port 0: any free port; None:
    # parked KV is not served.
    serve_host: str = "127.0.0.1"
    serve_port: int | None = Field(default=0, ge=0, lt=65536)
    # A reader's heartbeat (prefill waiting to read) holds its allocation serve_lease +
    # serve_grace seconds longer; a moved retention is held its move's ttl + serve_grace, so past
    # the registry's expiry of it (prefill declines reads within 5 s of the advertised end).
    serve_lease: float = Field(default=30.0, gt=5.0)
    serve_grace: float = Field(default=10.0, ge=0)
    # Moves (ParkRetention, Prefetch, PullBlocks): the longest ttl a caller may ask for (the
    # pool holds a move ttl + serve_grace), the deadline of a holder's NIXL handshake, how many
    # holders' NIXL agents stay added, and how many answers are kept for repeated request ids.
    max_move_ttl: float = Field(default=86_400.0, gt=0)
    holder_handshake_timeout: float = Field(default=5.0, gt=0)
    max_remote_agents: int = Field(default=16, gt=0, le=1024)
    remembered_moves: int = Field(default=1024, gt=0, le=100_000)

    @field_validator("serve_host")
    @classmethod
    def _reachable(cls, host: str) -> str:
        if host in _WILDCARD_HOSTS:
            raise ValueError("serve_host is advertised to prefill engines: give a host they reach")
        return host


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVSHUTTLE_AGENT_",
        env_nested_delimiter="__",
        extra="forbid",
        # A partial override (SERVER__GRACE_SECONDS) keeps the agent's own listen default.
        nested_model_default_partial_update=True,
    )

    server: ServerSettings = ServerSettings(listen="127.0.0.1:50071")
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    registry: ServiceConnection = Field(default_factory=lambda: ServiceConnection(address="127.0.0.1:50051"))
    node: NodeSettings
    lease: LeaseSettings = Field(default_factory=LeaseSettings)
    events: EventsSettings = Field(default_factory=EventsSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    # On shutdown: seconds to forward the batches still queued before deregistering.
    shutdown_flush_timeout: float = Field(default=1.0, ge=0)

    @model_validator(mode="after")
    def _check_pool(self) -> Self:
        if self.pool_layout() is not None and self.pool.serve_port is not None:
            # A served pool registers as a node of its own: its name must be one.
            try:
                pool_node_name(self.node.name, "node.name")
            except InvalidArgument as exc:
                raise ValueError(f"{exc.message} (the name of the pool node the agent registers)") from exc
        return self

    def pool_layout(self) -> PoolLayout | None:
        """The pool's layout, or None without a pool. Raises ValueError when the sizes disagree."""
        pool = self.pool
        if pool.size_bytes == 0:
            return None
        block_bytes = pool.block_bytes
        if block_bytes is None:
            engine_block = self.node.block_size * self.node.kv_bytes_per_token
            if engine_block % pool.regions:
                raise ValueError(
                    f"pool.regions ({pool.regions}) does not divide one engine block "
                    f"({engine_block} bytes): set pool.block_bytes"
                )
            block_bytes = engine_block // pool.regions
        blocks = pool.size_bytes // (pool.regions * block_bytes)
        if blocks == 0:
            raise ValueError(f"pool.size_bytes holds no slot of {pool.regions * block_bytes} bytes")
        return PoolLayout(regions=pool.regions, blocks=blocks, block_bytes=block_bytes)

    def advertised_endpoint(self, port: int | None = None) -> str:
        """The agent endpoint to register: node.agent_endpoint, or the listen address (with the
        bound `port` when given) unless its host is a wildcard."""
        if self.node.agent_endpoint is not None:
            return self.node.agent_endpoint
        host, _, listen_port = self.server.listen.rpartition(":")
        if host in _WILDCARD_HOSTS:
            return ""
        return f"{host}:{port if port is not None else listen_port}"
