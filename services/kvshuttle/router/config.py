"""The router's configuration: one object, from KVSHUTTLE_ROUTER_* environment variables
(nested with "__"), e.g.

    KVSHUTTLE_ROUTER_SERVER__LISTEN=0.0.0.0:50061
    KVSHUTTLE_ROUTER_REGISTRY__ADDRESS=registry:50051
    KVSHUTTLE_ROUTER_PROFILES_FILE=/etc/kvshuttle/profiles.toml
    KVSHUTTLE_ROUTER_TURN_SIGNING_KEY=...            (shared by every replica; >= 16 bytes)
    KVSHUTTLE_ROUTER_POLICY__CLAIM_TTL_S=20
    KVSHUTTLE_ROUTER_PROFILES='[{"model": "m", "kv_bytes_per_token": 4096,
        "prefill": {"fixed_ms": 10, "per_token_ms": 0.02}, "link": {"bandwidth_gb_s": 20, "fixed_ms": 5}}]'

Model profiles come from a TOML file (one `[[profile]]` table per model, as in
deploy/profiles/), from inline JSON, or both; at least one is required, since a router
without a profile could plan nothing. A model named twice is refused at startup.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvshuttle.client.channel import ChannelOptions
from kvshuttle.router.cost import ModelProfile
from kvshuttle.router.router import RouterPolicy
from kvshuttle.serving.settings import ServerSettings, TelemetrySettings

MIN_SIGNING_KEY_BYTES = 16


class RegistryConnection(BaseModel):
    """How the router reaches the registry (mirrors kvshuttle.client.ChannelOptions)."""

    address: str = "127.0.0.1:50051"
    # Deadline of one registry call, retries included (seconds). PlanTurn makes up to four.
    timeout: float = Field(default=2.0, gt=0)
    # Sends per call (first included) on UNAVAILABLE, for calls safe to repeat.
    max_attempts: int = Field(default=3, ge=1)
    tls: bool = False
    # PEM files: the CA of the registry's certificate; the router's certificate and key (mTLS).
    root_certificates: Path | None = None
    cert_chain: Path | None = None
    private_key: Path | None = None
    tls_server_name: str | None = None

    @model_validator(mode="after")
    def _mtls_complete(self) -> Self:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("cert_chain and private_key go together (mTLS)")
        return self

    def channel_options(self) -> ChannelOptions:
        return ChannelOptions(
            self.address,
            default_timeout=self.timeout,
            tls=self.tls,
            root_certificates=self.root_certificates,
            cert_chain=self.cert_chain,
            private_key=self.private_key,
            tls_server_name=self.tls_server_name,
            max_attempts=self.max_attempts,
        )


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVSHUTTLE_ROUTER_",
        env_nested_delimiter="__",
        extra="forbid",
        # A partial override (SERVER__GRACE_SECONDS) keeps the router's own listen default.
        nested_model_default_partial_update=True,
    )

    server: ServerSettings = ServerSettings(listen="127.0.0.1:50061")
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    registry: RegistryConnection = Field(default_factory=RegistryConnection)
    # TOML file of model profiles; None: only the inline `profiles`.
    profiles_file: Path | None = None
    # Inline model profiles (JSON in the environment), added to the file's.
    profiles: list[ModelProfile] = Field(default_factory=list)
    # HMAC key of turn handles, shared by every replica so any of them can commit or abort a
    # turn another planned. None: a random key per process (fine for one replica; with several,
    # a turn committed on another replica than its plan's is NOT_FOUND).
    turn_signing_key: SecretStr | None = None
    policy: RouterPolicy = Field(default_factory=RouterPolicy)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.profiles_file is None and not self.profiles:
            raise ValueError("set profiles_file or profiles: a router without a model profile plans nothing")
        key = self.turn_signing_key
        if key is not None and len(key.get_secret_value().encode()) < MIN_SIGNING_KEY_BYTES:
            raise ValueError(f"turn_signing_key needs at least {MIN_SIGNING_KEY_BYTES} bytes")
        policy = self.policy
        if policy.decoder_kv_blocks_ttl_s - policy.retention_margin_s < 1:
            raise ValueError("policy: decoder_kv_blocks_ttl_s - retention_margin_s must be at least 1 s")
        if min(policy.claim_ttl_s, policy.turn_ttl_s) <= 0 or policy.max_prompt_tokens <= 0:
            raise ValueError("policy: claim_ttl_s, turn_ttl_s and max_prompt_tokens must be positive")
        return self
