"""The router's configuration: one object, from KVSHUTTLE_ROUTER_* environment variables
(nested with "__"), e.g.

    KVSHUTTLE_ROUTER_SERVER__LISTEN=0.0.0.0:50061
    KVSHUTTLE_ROUTER_REGISTRY__ADDRESS=registry:50051
    KVSHUTTLE_ROUTER_PROFILES_FILE=/etc/kvshuttle/profiles.toml
    KVSHUTTLE_ROUTER_TURN_SIGNING_KEY=...            (shared by every replica; >= 16 bytes)
    KVSHUTTLE_ROUTER_POLICY__CLAIM_TTL_S=20
    KVSHUTTLE_ROUTER_POLICY__PARKING__ENABLED=true       (park idle retentions in agents' pools)
    KVSHUTTLE_ROUTER_POLICY__PARKING__PREFETCH_ENABLED=true
    KVSHUTTLE_ROUTER_AGENTS__TOKEN_FILE=/run/secrets/router-agent-token
    KVSHUTTLE_ROUTER_PROFILES='[{"model": "m", "kv_bytes_per_token": 4096,
        "prefill": {"fixed_ms": 10, "per_token_ms": 0.02}, "link": {"bandwidth_gb_s": 20, "fixed_ms": 5}}]'

Model profiles come from a TOML file (one `[[profile]]` table per model, as in
deploy/profiles/), from inline JSON, or both; at least one is required, since a router
without a profile could plan nothing. A model named twice is refused at startup.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvshuttle.client.channel import ChannelOptions
from kvshuttle.client.settings import ServiceConnection
from kvshuttle.router.cost import EMULATOR_SECTIONS, ModelProfile
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.serving.settings import AuthSettings, ServerSettings, TelemetrySettings

MIN_SIGNING_KEY_BYTES = 16


class AgentConnection(ServiceConnection):
    """How the router reaches the agents it asks to park or prefetch (TLS, token, deadline,
    attempts as for any service); each agent's address is the one its node registered
    (NodeInfo.agent_endpoint), so `address` is not set here."""

    address: str = Field(default="", exclude=True)
    # One move READs a whole retention: a deadline of its own, longer than a registry call's.
    timeout: float = Field(default=30.0, gt=0)
    # Open channels kept, least recently used closed first.
    max_channels: int = Field(default=64, ge=1)

    def for_endpoint(self, endpoint: str) -> ChannelOptions:
        return self.model_copy(update={"address": endpoint}).channel_options()


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
    auth: AuthSettings = Field(default_factory=AuthSettings)
    registry: ServiceConnection = Field(default_factory=lambda: ServiceConnection(address="127.0.0.1:50051"))
    # TOML file of model profiles; None: only the inline `profiles`.
    profiles_file: Path | None = None
    # Inline model profiles (JSON in the environment), added to the file's.
    profiles: list[ModelProfile] = Field(default_factory=list)
    # HMAC key of turn handles, shared by every replica so any of them can commit or abort a
    # turn another planned. None: a random key per process (fine for one replica; with several,
    # a turn committed on another replica than its plan's is NOT_FOUND).
    turn_signing_key: SecretStr | None = None
    policy: RouterPolicy = Field(default_factory=RouterPolicy)
    # The agents the shuttle calls (policy.parking); their addresses come from the registry.
    agents: AgentConnection = Field(default_factory=AgentConnection)

    @field_validator("profiles", mode="before")
    @classmethod
    def _router_sections(cls, value: Any) -> Any:
        """An engine profile given inline (deploy/profiles: the emulator's decode, engine and
        hardware sections beside the router's) is read as the file loader reads it: those
        sections ignored, any other unknown key refused."""
        if isinstance(value, list):
            return [
                {k: v for k, v in p.items() if k not in EMULATOR_SECTIONS} if isinstance(p, dict) else p
                for p in value
            ]
        return value

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
        if min(policy.degraded_nodes_max_age_s, policy.node_miss_refresh_s) < 0:
            raise ValueError("policy: degraded_nodes_max_age_s and node_miss_refresh_s must be at least 0")
        if policy.commit_registry_timeout_s <= 0:
            raise ValueError("policy: commit_registry_timeout_s must be positive")
        if policy.found_fork_window_s < policy.parking.min_ttl_s:
            raise ValueError("policy: found_fork_window_s must be at least parking.min_ttl_s")
        _check_parking(policy)
        _check_next_turn(policy)
        w = policy.weights
        if not 0 <= w.short_lane_fraction < 1 or min(w.long_prefill_ms, w.short_lane_window_s) <= 0:
            raise ValueError(
                "policy.weights: 0 <= short_lane_fraction < 1, long_prefill_ms and short_lane_window_s > 0"
            )
        e = policy.extend
        if (
            e.interference_weight < 0
            or e.max_batch < 1
            or e.max_prefill_ms <= 0
            or not 0 <= e.max_kv_usage <= 1
        ):
            raise ValueError(
                "policy.extend: interference_weight >= 0, max_batch >= 1, max_prefill_ms > 0 "
                "and 0 <= max_kv_usage <= 1"
            )
        return self


def _check_parking(policy: RouterPolicy) -> None:
    p = policy.parking
    if (
        min(
            p.park_after_idle_s,
            p.max_idle_s,
            p.tick_s,
            p.prefetch_margin,
            p.min_ttl_s,
            p.holder_probe_timeout_s,
        )
        <= 0
    ):
        raise ValueError(
            "policy.parking: park_after_idle_s, max_idle_s, tick_s, prefetch_margin, min_ttl_s and "
            "holder_probe_timeout_s "
            "must be positive"
        )
    if p.move_wait_s < 0:
        raise ValueError("policy.parking: move_wait_s must be at least 0")
    if p.park_before_pin_s < 0 or not 0 < p.park_kv_usage_above <= 1:
        raise ValueError("policy.parking: park_before_pin_s >= 0 and 0 < park_kv_usage_above <= 1")
    if p.max_in_flight < 1 or p.max_scheduled < 1:
        raise ValueError("policy.parking: max_in_flight and max_scheduled must be at least 1")
    if p.max_idle_s <= p.park_after_idle_s + p.min_ttl_s:
        raise ValueError("policy.parking: max_idle_s must exceed park_after_idle_s + min_ttl_s")


def _check_next_turn(policy: RouterPolicy) -> None:
    n = policy.next_turn
    if n.keep_max_s <= 0 or not 0 <= n.min_return_p <= 1 or not 0 < n.keep_quantile < 1:
        raise ValueError("policy.next_turn: keep_max_s > 0, 0 <= min_return_p <= 1 and 0 < keep_quantile < 1")
    if min(n.min_samples, n.min_conversation_gaps, n.half_life, n.max_conversations, n.max_tenants) < 1:
        raise ValueError(
            "policy.next_turn: min_samples, min_conversation_gaps, half_life, max_conversations and "
            "max_tenants must be at least 1"
        )
    if n.min_conversation_gaps < 2:
        raise ValueError(
            "policy.next_turn: min_conversation_gaps must be at least 2 (a spread needs two gaps)"
        )
