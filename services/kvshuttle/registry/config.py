"""The registry's configuration: one object, from KVSHUTTLE_REGISTRY_* environment variables
(nested with "__", e.g. KVSHUTTLE_REGISTRY_SERVER__LISTEN=0.0.0.0:50051,
KVSHUTTLE_REGISTRY_LIMITS__MAX_PAGE_SIZE=500,
KVSHUTTLE_REGISTRY_LIMITS__RETENTION_TTL='{"default": 300, "minimum": 1, "maximum": 3600}').

The store: KVSHUTTLE_REGISTRY_STORE=memory (the default: one process, state lost on restart) or
redis (kvshuttle.registry.store.redis.store, with KVSHUTTLE_REGISTRY_REDIS__URL and __KEY_PREFIX); Redis
is reached by __MODE: standalone (the default: __URL), sentinel (__SENTINELS='["h1:26379","h2:26379"]',
__SERVICE_NAME, optional __DB and __PASSWORD: the master Sentinel names) or cluster (__URL of any
seed node); with redis, WatchRetentions streams every replica's changes from one Redis Stream
(kvshuttle.registry.feeds.redis_change), bounded by __CHANGE_STREAM_MAXLEN, and each replica's block
index applies every replica's ReportBlockEvents from another (kvshuttle.registry.feeds.redis_index),
bounded by __BLOCK_STREAM_MAXLEN: agents may report to any replica."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.serving.settings import AuthSettings, ServerSettings, TelemetrySettings


class RedisSettings(BaseModel):
    """Where the Redis store keeps its state (store = "redis")."""

    model_config = {"extra": "forbid"}

    # standalone: one server at `url`. sentinel: the master named `service_name`, found through
    # `sentinels` ("host:port" each), with `db` and `password` (`url` unused). cluster: `url` of
    # any seed node (the store's scripts each touch one hash slot).
    mode: Literal["standalone", "sentinel", "cluster"] = "standalone"
    url: str = "redis://127.0.0.1:6379/0"
    sentinels: list[str] = Field(default_factory=list)
    service_name: str = ""
    db: int = Field(default=0, ge=0)
    # The master's password (sentinel mode): a secret, kept out of reprs and logs.
    password: SecretStr | None = None
    # Every key starts with it (and the global keys carry it as their hash tag): several
    # registries can share one Redis under different prefixes.
    key_prefix: str = Field(default="kvshuttle", min_length=1, pattern=r"^[^{}]+$")
    # The change stream (`{prefix}:changes`) keeps about this many changes (XADD MAXLEN ~): a
    # watcher further behind than that cannot resume (WATCH_RESUME_EXPIRED) and lists again.
    # Each entry is one retention's change with its block hashes: memory ~ this x their size.
    change_stream_maxlen: int = Field(default=100_000, gt=0)
    # The block-event stream (`{prefix}:blocks`) keeps about this many accepted reports: what a
    # replica that starts later can rebuild its block index from (older blocks are missing from
    # its index until stored again: prefix hits lost, never a wrong one). Memory ~ this x a
    # report's size (its BlockStored tokens: ~2 bytes a token; bench/block_index.py measures it).
    block_stream_maxlen: int = Field(default=100_000, gt=0)
    # A Redis that stops answering without closing its connections (a partition, a stopped
    # host) fails a call after socket_timeout_s (UNAVAILABLE) instead of holding it until the
    # caller's deadline, and the expiry loop and the feeds' readers with it. Longer than the
    # feeds' XREAD BLOCK (1 s), which waits on the socket by design.
    socket_timeout_s: float = Field(default=5.0, gt=1.0)
    socket_connect_timeout_s: float = Field(default=2.0, gt=0)

    @model_validator(mode="after")
    def _check_mode(self) -> RedisSettings:
        if self.mode != "sentinel":
            if self.sentinels or self.service_name:
                raise ValueError(
                    f"redis.sentinels and redis.service_name are for mode sentinel, not {self.mode}"
                )
            return self
        if not self.sentinels:
            raise ValueError('redis mode sentinel needs redis.sentinels (["host:port", ...])')
        if not self.service_name:
            raise ValueError("redis mode sentinel needs redis.service_name (the monitored master's name)")
        for address in self.sentinels:
            self.sentinel_address(address)
        return self

    @staticmethod
    def sentinel_address(address: str) -> tuple[str, int]:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"redis.sentinels: {address!r} is not host:port")
        return host, int(port)


class RegistrySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVSHUTTLE_REGISTRY_", env_nested_delimiter="__", extra="forbid"
    )

    server: ServerSettings = Field(default_factory=lambda: ServerSettings(listen="127.0.0.1:50051"))
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    limits: RegistryLimits = Field(default_factory=RegistryLimits)
    # Where the state lives: "memory" (one process; a restart loses it) or "redis" (redis.*).
    store: Literal["memory", "redis"] = "memory"
    redis: RedisSettings = Field(default_factory=RedisSettings)
    store_limits: StoreLimits = Field(default_factory=StoreLimits)
    # Blocks indexed per node before new BlockStored events are dropped.
    max_indexed_blocks_per_node: int = Field(default=1_000_000, gt=0)
    # The expiry timer wakes at least this often (seconds).
    expiry_max_sleep: float = Field(default=1.0, gt=0)
