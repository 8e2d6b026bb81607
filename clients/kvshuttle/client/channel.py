"""How a client reaches a service: one options object, one function that builds the channel.

A service of several replicas is one target: a list of addresses ("10.0.0.5:50051,10.0.0.6:50051",
IP literals) or one DNS name ("dns:///registry.kvshuttle:50051", every address it resolves to).
Either way the channel balances calls round robin over the replicas that are up (gRPC's
`round_robin` policy: a replica that stops answering is left out until it reconnects), and a
call that failed UNAVAILABLE is retried (`max_attempts`) on the next one.

A channel's TLS credentials are fixed when it is made (gRPC Python has no reloading channel
credentials), so a client that made its channel checks the certificate files every
`tls_reload_interval` seconds (`tls_files_signature`) and, when they changed (a renewal), makes
a new channel for the calls that follow and closes the old one once its calls are done
(kvshuttle.client._base).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from opentelemetry.trace import TracerProvider

__all__ = ["ChannelOptions", "TlsFilesSignature", "create_channel", "tls_files_signature"]

# What identifies one version of the TLS files: per file, (inode, size, mtime) or None when absent.
TlsFilesSignature = tuple[tuple[int, int, int] | None, ...]


@dataclass(frozen=True, slots=True)
class ChannelOptions:
    """Where a service is and how to call it.

    Attributes:
        target: "host:port" (or any gRPC target, e.g. "dns:///registry:50051"), or several
            replicas' "ip:port" joined by commas: balanced round robin (see the module).
        default_timeout: deadline in seconds for one call, retries included, when the call
            does not pass its own; None means no deadline.
        tls: use a secure channel. Implied when any of the three file paths is set.
        root_certificates: PEM file of the CAs that sign the server's certificate (the system
            roots when None).
        cert_chain, private_key: PEM files of the client certificate and its key (mTLS); both
            or neither.
        tls_server_name: the name to verify the server's certificate against, when it differs
            from the target's host (grpc.ssl_target_name_override).
        max_attempts: sends per call, first included; 1 disables retries.
        initial_backoff, max_backoff: seconds; the wait before retry n is uniform in
            [0, min(max_backoff, initial_backoff * backoff_multiplier ** (n - 1))].
        backoff_multiplier: growth of the backoff cap per retry.
        interceptors: extra grpc.aio client interceptors, outermost first.
        tracer_provider: traces every call (a CLIENT span per attempt, its context sent in
            the metadata) with this OpenTelemetry provider; None: no client spans.
        grpc_options: extra channel arguments, e.g. ("grpc.max_receive_message_length", n).
        token: a bearer token sent with every call (`authorization: Bearer <token>`), for a
            service that authenticates by tokens; kept out of repr.
        tls_reload_interval: seconds between checks of the three certificate files by a client
            that made its channel: changed files get a new channel (see the module); None:
            they are read once.
    """

    target: str
    default_timeout: float | None = 5.0
    tls: bool = False
    root_certificates: str | Path | None = None
    cert_chain: str | Path | None = None
    private_key: str | Path | None = None
    tls_server_name: str | None = None
    max_attempts: int = 3
    initial_backoff: float = 0.05
    max_backoff: float = 1.0
    backoff_multiplier: float = 2.0
    interceptors: Sequence[grpc.aio.ClientInterceptor] = field(default=())
    tracer_provider: TracerProvider | None = None
    grpc_options: Sequence[tuple[str, Any]] = field(default=())
    token: str | None = field(default=None, repr=False)
    tls_reload_interval: float | None = 10.0

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("target must not be empty")
        grpc_target(self.target)  # a list of replicas must be IP literals
        if self.default_timeout is not None and self.default_timeout <= 0:
            raise ValueError("default_timeout must be positive (or None for no deadline)")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.initial_backoff < 0 or self.max_backoff < self.initial_backoff:
            raise ValueError("backoff must satisfy 0 <= initial_backoff <= max_backoff")
        if self.backoff_multiplier < 1:
            raise ValueError("backoff_multiplier must be at least 1")
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("cert_chain and private_key go together (mTLS)")
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ValueError("a token is one word, not empty")
        if self.tls_reload_interval is not None and self.tls_reload_interval <= 0:
            raise ValueError("tls_reload_interval must be positive (or None: never reload)")

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call sends besides its trace context: the bearer token, if any."""
        return () if self.token is None else (("authorization", f"Bearer {self.token}"),)

    @property
    def secure(self) -> bool:
        """Whether the channel uses TLS."""
        return self.tls or any(
            p is not None for p in (self.root_certificates, self.cert_chain, self.private_key)
        )

    @classmethod
    def of(cls, target: str | ChannelOptions, **overrides: Any) -> ChannelOptions:
        """`target` as options: a string becomes ChannelOptions(target); overrides replace fields."""
        options = cls(target) if isinstance(target, str) else target
        return replace(options, **overrides) if overrides else options


# A service back from a restart is reconnected to within ~1 s: gRPC's default reconnect backoff
# grows by 1.6x per failed attempt up to 120 s, so a registry or router down for a minute would
# otherwise be tried again only tens of seconds after it returned (and reuse resume that late).
# `grpc_options` naming either key replaces it.
_RECONNECT_BACKOFF: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


# Several replicas: round robin over those that are up, instead of gRPC's default pick_first
# (which sends everything to the first address and fails over only when it is gone).
_ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})


def grpc_target(target: str) -> str:
    """The gRPC target for `target`: unchanged for one address or a scheme target; a
    comma-separated list of "ip:port" as gRPC's ipv4:/ipv6: list. Raises ValueError for a list
    naming host names (give one DNS name instead: "dns:///name:port")."""
    if "," not in target:
        return target
    parts = [p.strip() for p in target.split(",")]
    families = set()
    for part in parts:
        host, sep, port = part.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        try:
            families.add(ipaddress.ip_address(host).version if sep and port.isdigit() else 0)
        except ValueError:
            families.add(0)
    if 0 in families or len(families) != 1:
        raise ValueError(
            f"a list of replicas must be ip:port of one IP family, got {target!r}: "
            "for host names give one DNS name that resolves to every replica (dns:///name:port)"
        )
    return f"ipv{families.pop()}:{','.join(parts)}"


def balanced(target: str) -> bool:
    """Whether `target` may name several replicas (a list, or a name to resolve)."""
    return "," in target or target.startswith("dns:")


def tls_files_signature(options: ChannelOptions) -> TlsFilesSignature | None:
    """The current version of the channel's certificate files (their paths followed, as a
    Kubernetes secret volume swaps them); None when the channel reads none."""
    paths = (options.root_certificates, options.cert_chain, options.private_key)
    if all(p is None for p in paths):
        return None
    signature = []
    for path in paths:
        try:
            stat = Path(path).stat() if path is not None else None
        except FileNotFoundError:
            stat = None
        signature.append(None if stat is None else (stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return tuple(signature)


def _read(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def create_channel(options: ChannelOptions) -> grpc.aio.Channel:
    """A grpc.aio channel to `options.target`: secure when `options.secure`, with its interceptors.

    Certificate files are read here; a missing file raises OSError.
    """
    given = {key for key, _ in options.grpc_options}
    channel_args: list[tuple[str, Any]] = [
        *(arg for arg in _RECONNECT_BACKOFF if arg[0] not in given),
        *options.grpc_options,
    ]
    if options.tls_server_name:
        channel_args.append(("grpc.ssl_target_name_override", options.tls_server_name))
    if balanced(options.target) and "grpc.service_config" not in given:
        channel_args.append(("grpc.service_config", _ROUND_ROBIN))
    target = grpc_target(options.target)
    interceptors = list(options.interceptors) or None
    if not options.secure:
        return grpc.aio.insecure_channel(target, options=channel_args, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(options.root_certificates),
        private_key=_read(options.private_key),
        certificate_chain=_read(options.cert_chain),
    )
    return grpc.aio.secure_channel(target, credentials, options=channel_args, interceptors=interceptors)
