"""Settings every gRPC service shares. Each service nests them in its own pydantic-settings
object, so they come from that service's environment (e.g. KVSHUTTLE_REGISTRY_TELEMETRY__LOG_FORMAT).

Per-service defaults set on the nested model (e.g. `telemetry: TelemetrySettings =
TelemetrySettings(metrics_listen=...)`) survive a partial environment override only with
`nested_model_default_partial_update=True` in the service's SettingsConfigDict.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from kvshuttle.core.auth import ALL_TENANTS, Role

LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class TelemetrySettings(BaseModel):
    """Logs, traces and metrics of one service process."""

    # debug, info, warning, error or critical (either case).
    log_level: LogLevel = "info"
    # auto: a console renderer when stdout is a terminal, JSON lines otherwise.
    log_format: Literal["auto", "json", "console"] = "auto"
    # OTLP/gRPC collector, e.g. "http://otel-collector:4317"; None: spans are made (their ids
    # still reach the logs and the next hop) but not exported.
    otlp_endpoint: str | None = None
    # OTel service.name. None: the name the service passes in; set it to tell deployments apart.
    service_name: str | None = None
    # host:port of the Prometheus /metrics HTTP endpoint; "" turns it off.
    metrics_listen: str = ""

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: object) -> object:
        """Accept LOG_LEVEL=INFO as well as info."""
        return value.lower() if isinstance(value, str) else value


class ServerSettings(BaseModel):
    """Where and how a gRPC server listens."""

    # host:port of the gRPC server ("0.0.0.0:50051" in a pod: beyond loopback, auth is required).
    listen: str = "127.0.0.1:50051"
    # How long in-flight RPCs get to finish on stop before they are cancelled.
    grace_seconds: float = Field(default=5.0, ge=0)
    # Largest request message; a larger one is RESOURCE_EXHAUSTED (MESSAGE_TOO_LARGE).
    max_receive_message_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    # cert + key: serve TLS. client_ca as well: require and verify client certificates (mTLS).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    # host:port of a second, plaintext listener that serves grpc.health.v1.Health only (e.g.
    # "0.0.0.0:8081"), for probes that cannot speak TLS (Kubernetes' native grpc probe). None: off.
    health_listen: str | None = None

    @model_validator(mode="after")
    def _tls_complete(self) -> Self:
        """Refuse a half-configured TLS setup rather than silently serving plaintext."""
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        return self

    @model_validator(mode="after")
    def _health_port_of_its_own(self) -> Self:
        """The health listener on the main port would fail to bind at start; say so at load.
        Port 0 on both is fine: each bind draws a port of its own."""
        if self.health_listen is not None:
            port = _port_of(self.health_listen)
            if port is None:
                raise ValueError(f"health_listen {self.health_listen!r} is not host:port")
            if port != 0 and port == _port_of(self.listen):
                raise ValueError(
                    f"health_listen {self.health_listen!r} uses the port of listen {self.listen!r}"
                )
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def loopback(self) -> bool:
        """Whether `listen` binds only a loopback address (127.0.0.0/8, ::1, localhost)."""
        host = self.listen.rsplit(":", 1)[0].strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:  # a host name, "0.0.0.0", "[::]": not provably loopback
            return False


def _port_of(address: str) -> int | None:
    """The port of host:port ("[::]:8081" too); None when there is none."""
    _, sep, port = address.rpartition(":")
    return int(port) if sep and port.isdigit() else None


# An identity pattern ends in NODE_PLACEHOLDER and grants an agent PATTERN_NODE: the node its own
# identity names (kvshuttle.serving.identities).
NODE_PLACEHOLDER = "{node}"
PATTERN_NODE = "nodes/{node}"


class Grant(BaseModel):
    """What one identity may do: its role, and for a gateway the tenants it acts for ("*": all),
    for an agent the node it acts for."""

    role: Role
    tenants: list[str] = Field(default_factory=list)
    node: str | None = None

    @model_validator(mode="after")
    def _scoped(self) -> Self:
        if self.role is Role.GATEWAY and not self.tenants:
            raise ValueError(f"a gateway grant names its tenants (or {ALL_TENANTS!r} for all)")
        if self.role is Role.AGENT and not self.node:
            raise ValueError("an agent grant names its node (nodes/{node})")
        if self.role is not Role.GATEWAY and self.tenants:
            raise ValueError("only a gateway grant is scoped to tenants")
        if self.role is not Role.AGENT and self.node:
            raise ValueError("only an agent grant is scoped to a node")
        return self


class AuthSettings(BaseModel):
    """Who may call this service. No identities: authentication is off, which the server allows
    only on a loopback address (or with `insecure`, warned at every start).

    identities: identity -> grant. An identity is a client certificate's URI or DNS SAN
        ("spiffe://kvshuttle/router") or the name a bearer token stands for. A key ending in
        "{node}" granted {"role": "agent", "node": "nodes/{node}"} is a pattern of client
        certificate URI SANs: each is the agent of the node it names
        (kvshuttle.serving.identities).
    tokens: identity -> bearer token (e.g. KVSHUTTLE_REGISTRY_AUTH__TOKENS='{"router": "..."}').
    tokens_file: a JSON file of the same shape (a mounted secret); merged over `tokens`.
    insecure: serve a non-loopback address without TLS client certificates or identities.
    """

    identities: dict[str, Grant] = Field(default_factory=dict)
    tokens: dict[str, SecretStr] = Field(default_factory=dict)
    tokens_file: Path | None = None
    insecure: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.identities)

    @model_validator(mode="after")
    def _patterns(self) -> Self:
        """A pattern is `prefix{node}` granting an agent `nodes/{node}`, and no identity falls
        under two of them (or under one and a grant of its own)."""
        prefixes = []
        for identity, grant in self.identities.items():
            if NODE_PLACEHOLDER not in identity and NODE_PLACEHOLDER not in (grant.node or ""):
                continue
            prefix = identity.removesuffix(NODE_PLACEHOLDER)
            well_formed = identity.endswith(NODE_PLACEHOLDER) and prefix and NODE_PLACEHOLDER not in prefix
            if not well_formed or grant.role is not Role.AGENT:
                raise ValueError(
                    f"identity pattern {identity!r}: one {NODE_PLACEHOLDER} at the end, for an agent"
                )
            if grant.node != PATTERN_NODE:
                raise ValueError(f"identity pattern {identity!r}: its grant's node must be {PATTERN_NODE!r}")
            prefixes.append(prefix)
        for prefix in prefixes:
            overlapping = [p for p in prefixes if p != prefix and p.startswith(prefix)]
            named = [i for i in self.identities if NODE_PLACEHOLDER not in i and i.startswith(prefix)]
            if overlapping or named:
                raise ValueError(
                    f"identity pattern {prefix}{NODE_PLACEHOLDER} also covers "
                    f"{', '.join(overlapping + named)}: an identity has one grant"
                )
        return self
