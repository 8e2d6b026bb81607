"""The sidecar's configuration: one object, from KVSHUTTLE_SIDECAR_* environment variables
(nested with "__"), e.g.

    KVSHUTTLE_SIDECAR_LISTEN=0.0.0.0:8000                   (what the InferencePool targets)
    KVSHUTTLE_SIDECAR_DECODE_ENDPOINT=http://127.0.0.1:8200 (this pod's vLLM)
    KVSHUTTLE_SIDECAR_NODE=nodes/decode-0                    (its node, as its agent registers it)
    KVSHUTTLE_SIDECAR_ROUTER__ADDRESS=router:50061
    KVSHUTTLE_SIDECAR_REGISTRY__ADDRESS=registry:50051
    KVSHUTTLE_SIDECAR_MODELS='{"Qwen/Qwen3-32B": "/models/qwen3-32b"}'
    KVSHUTTLE_SIDECAR_CACHE_SALT_KEY=...                     (the EPP's; secret)

Models, cache salt key and tenant must be the endpoint picker's: the sidecar tokenizes the
prompt and salts the engines' cache exactly as the EPP did for its PlanTurn, so the ids it
commits are the ids the plan was made for. A model in history mode exact_tokens starts the prompt
with a retained turn's transcript, as the EPP does; a prompt whose ids are not the planned ones
(`x-kvshuttle-prompt`) is served plain.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvshuttle.client.settings import ServiceConnection
from kvshuttle.core.endpoints import endpoint_host_port
from kvshuttle.core.limits import MAX_PROMPT_TOKENS
from kvshuttle.gateway.config import (
    DEFAULT_TENANT,
    EngineSettings,
    GatewaySettings,
    ModelSettings,
    RouterConnection,
    tenant_id,
    tokenizer_paths,
)
from kvshuttle.serving.settings import TelemetrySettings

__all__ = ["SidecarSettings"]


class SidecarSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVSHUTTLE_SIDECAR_",
        env_nested_delimiter="__",
        extra="forbid",
        nested_model_default_partial_update=True,
        hide_input_in_errors=True,
    )

    # host:port of the sidecar's HTTP server: the port the gateway sends the decode pod's traffic to.
    listen: str = "0.0.0.0:8000"
    # Base URL of this pod's decode engine (vLLM), reached locally.
    decode_endpoint: str = "http://127.0.0.1:8200"
    # This decode engine's node as registered ("nodes/{node}"): a plan placing decode elsewhere
    # is stale.
    node: str
    # The router (CommitTurn, AbortTurn), with a gateway identity.
    router: RouterConnection = Field(default_factory=lambda: RouterConnection(address="127.0.0.1:50061"))
    # The registry, read (ListNodes) for the SSRF guard: an identity with nodes.read (viewer).
    registry: ServiceConnection = Field(default_factory=lambda: ServiceConnection(address="127.0.0.1:50051"))
    engines: EngineSettings = Field(default_factory=EngineSettings)
    models: dict[str, ModelSettings] = Field(default_factory=dict)
    # The EPP's HMAC key of the tenants' cache salts (secret, at least 16 bytes).
    cache_salt_key: SecretStr | None = None
    # The tenant every request belongs to: the EPP's `tenant`.
    tenant: str = DEFAULT_TENANT
    # The EPP's `find_conversations`: both sides find a request's transcript alike.
    find_conversations: bool = True
    default_max_tokens: int | None = Field(default=None, ge=1)
    max_request_bytes: int = Field(default=32 * 2**20, ge=1024)
    max_prompt_tokens: int = Field(default=MAX_PROMPT_TOKENS, ge=1)
    drain_delay_s: float = Field(default=0.0, ge=0)
    grace_seconds: float = Field(default=30.0, ge=0)
    tokenizer_cache_bytes: int = Field(default=64 * 2**20, ge=0)
    tokenizer_verify_fraction: float = Field(default=0.01, ge=0, le=1)
    # The registered nodes' endpoints (the SSRF guard's allow list) are read at most this long
    # ago; a target not in the list is looked up again at most once per allowlist_miss_refresh_s.
    allowlist_ttl_s: float = Field(default=5.0, gt=0, le=300)
    allowlist_miss_refresh_s: float = Field(default=1.0, gt=0, le=60)
    # A list older than this (the registry out of reach) allows nothing: turns are served locally.
    allowlist_max_stale_s: float = Field(default=60.0, gt=0)
    # Nodes read into the list, at most (a deployment has tens).
    allowlist_max_nodes: int = Field(default=4096, ge=1)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)

    @field_validator("models", mode="before")
    @classmethod
    def _bare_paths(cls, value: object) -> object:
        return tokenizer_paths(value)

    @field_validator("tenant")
    @classmethod
    def _tenant_id(cls, value: str) -> str:
        return tenant_id(value)

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str) -> str:
        if not value.startswith("nodes/") or len(value) <= len("nodes/"):
            raise ValueError(f"node must be nodes/{{node}}, got {value[:100]!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> Self:
        if endpoint_host_port(self.decode_endpoint) is None:
            raise ValueError(f"decode_endpoint must be a base URL with a host, got {self.decode_endpoint!r}")
        if self.allowlist_max_stale_s < self.allowlist_ttl_s:
            raise ValueError("allowlist_max_stale_s must be at least allowlist_ttl_s")
        self.gateway_settings()  # the turn runner's half fails here, at startup
        return self

    def gateway_settings(self) -> GatewaySettings:
        """The settings of the gateway code that runs a planned turn (tokenizers, engines,
        router), built from these alone: no KVSHUTTLE_GATEWAY_* variable reaches them."""
        return GatewaySettings.model_validate(
            {
                "listen": self.listen,
                "router": self.router,
                "engines": self.engines,
                "models": self.models,
                "find_conversations": self.find_conversations,
                "cache_salt_key": self.cache_salt_key,
                "default_max_tokens": self.default_max_tokens,
                "max_request_bytes": self.max_request_bytes,
                "max_prompt_tokens": self.max_prompt_tokens,
                "grace_seconds": self.grace_seconds,
                "tokenizer_cache_bytes": self.tokenizer_cache_bytes,
                "tokenizer_verify_fraction": self.tokenizer_verify_fraction,
                "telemetry": self.telemetry,
            }
        )
