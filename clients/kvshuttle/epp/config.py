"""The endpoint picker's configuration: one object, from KVSHUTTLE_EPP_* environment variables
(nested with "__"), e.g.

    KVSHUTTLE_EPP_SERVER__LISTEN=0.0.0.0:9002                 (Envoy's ext_proc calls)
    KVSHUTTLE_EPP_SERVER__HEALTH_LISTEN=0.0.0.0:9003          (plaintext gRPC health, for the kubelet)
    KVSHUTTLE_EPP_SERVER__TLS_CERT_FILE=/run/tls/tls.crt      (and TLS_KEY_FILE)
    KVSHUTTLE_EPP_AUTH__INSECURE=true                         (Envoy presents no client certificate)
    KVSHUTTLE_EPP_ROUTER__ADDRESS=router-0.router:50061,router-1.router:50061
    KVSHUTTLE_EPP_MODELS='{"Qwen/Qwen3-32B": "/models/qwen3-32b"}'
    KVSHUTTLE_EPP_CACHE_SALT_KEY=...                          (the gateway's and the sidecar's key)
    KVSHUTTLE_EPP_TENANT=default
    KVSHUTTLE_EPP_MAX_CONCURRENT_PICKS=256

The picker plans each request as the gateway would (kvshuttle.gateway.config: the same models,
router connection and cache-salt key), so the settings that shape a plan mean what the gateway's
do. A model in history mode exact_tokens starts a prompt with a retained turn's transcript (its
exact ids, kept in the registry) where the history repeats that turn: the decode-side sidecar
does the same, and runs a plan only on the ids the picker planned (x-kvshuttle-prompt).
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvshuttle.core.limits import MAX_PROMPT_TOKENS
from kvshuttle.gateway.config import (
    DEFAULT_TENANT,
    ModelSettings,
    RouterConnection,
    tenant_id,
    tokenizer_paths,
)
from kvshuttle.serving.settings import AuthSettings, ServerSettings, TelemetrySettings

__all__ = ["EppSettings"]


class EppSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVSHUTTLE_EPP_",
        env_nested_delimiter="__",
        extra="forbid",
        # A partial override (SERVER__HEALTH_LISTEN) keeps the picker's own listen default.
        nested_model_default_partial_update=True,
        hide_input_in_errors=True,
    )

    # ext_proc (envoy.service.ext_proc.v3.ExternalProcessor) and gRPC health; 9002 as the
    # Inference Extension's own picker.
    server: ServerSettings = ServerSettings(listen="127.0.0.1:9002")
    # Who may call it. No identities: anyone who reaches the port (a NetworkPolicy admitting
    # only the gateway's Envoy pods), which beyond loopback needs `insecure`; with identities,
    # Envoy's client certificate must be granted the gateway role for `tenant`.
    auth: AuthSettings = Field(default_factory=AuthSettings)
    router: RouterConnection = Field(default_factory=lambda: RouterConnection(address="127.0.0.1:50061"))
    # Client-facing model name -> its tokenizer (at least one), as the gateway's.
    models: dict[str, ModelSettings] = Field(default_factory=dict)
    # The tenant every request of this pool belongs to (the sidecar's `tenant` too).
    tenant: str = DEFAULT_TENANT
    # As the gateway's: a request with no conversation id gets the conversation its prompt
    # continues (its transcript's, else the router's by the prompt's chain) or a new one; False:
    # it is plain P->D and nothing is retained.
    find_conversations: bool = True
    # HMAC key of the tenants' vLLM cache salts, the gateway's and the sidecar's. Secret. None:
    # a random key per process (warned): plans then never verify against the sidecar's salt.
    cache_salt_key: SecretStr | None = None
    # Request bodies larger than this are refused (413): the picker holds a body until it ends.
    max_request_bytes: int = Field(default=32 * 2**20, ge=1024)
    # Prompts longer than this are refused (400) before the router sees them.
    max_prompt_tokens: int = Field(default=MAX_PROMPT_TOKENS, ge=1)
    # Requests being planned at once (body received, pick not yet sent); one more is shed (429).
    max_concurrent_picks: int = Field(default=256, ge=1)
    # How long the router's list of ready decode engines (ListReadyDecodes) serves the picks
    # that need no plan (GET /v1/models, bodyless requests); 0: each such pick asks the router.
    ready_cache_s: float = Field(default=1.0, ge=0, le=60)
    # As the gateway's: the chat-template segment cache and its sampled re-check.
    tokenizer_cache_bytes: int = Field(default=64 * 2**20, ge=0)
    tokenizer_verify_fraction: float = Field(default=0.01, ge=0, le=1)
    # As the gateway's: the think time a chat turn with tools is planned with, when the client
    # sends no X-Kvshuttle-Expected-Think-Time.
    agent_think_time_s: float | None = Field(default=None, ge=0, le=86_400)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)

    @field_validator("models", mode="before")
    @classmethod
    def _bare_paths(cls, value: object) -> object:
        return tokenizer_paths(value)

    @field_validator("tenant")
    @classmethod
    def _tenant_id(cls, value: str) -> str:
        return tenant_id(value)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not self.models:
            raise ValueError("set models: a picker without a model plans nothing")
        for name in self.models:
            if not name or len(name) > 256:
                raise ValueError(f"model name {name[:300]!r} must be 1..256 characters")
        if self.cache_salt_key is not None and len(self.cache_salt_key.get_secret_value().encode()) < 16:
            raise ValueError("cache_salt_key needs at least 16 bytes")
        return self

    def served_name(self, model: str) -> str:
        return self.models[model].served_name or model
