"""Engine endpoints as `host:port`, in one canonical form, and sets of them.

An engine registers its HTTP endpoint as a base URL ("http://10.0.0.5:8000"); the endpoint
picker protocol, llm-d's `x-prefiller-host-port` and the router's `hints.decode_endpoints`
name engines as `host:port` (`[addr]:port` for IPv6). Both compare here in one canonical form
(IP addresses compressed, names lower-cased), so `[fd00::1]:8000` and `[FD00:0::1]:8000` are
one endpoint, and a name is not an address: an engine registered by IP is matched by that IP only.

An EndpointSet is what a caller allows: whole `host:port`s, and bare hosts (any of their ports).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

__all__ = [
    "MAX_ENDPOINT_LENGTH",
    "EndpointSet",
    "bare_host",
    "endpoint_host_port",
    "host_port",
    "parse_host_port",
]

# Characters of one `host:port` (a DNS name's 253 and a port, with room to spare).
MAX_ENDPOINT_LENGTH = 300


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 address in brackets; IP addresses in their canonical form and
    names lower-cased, so two spellings of one endpoint compare equal."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return f"{host.lower().rstrip('.')}:{port}"
    return f"[{address.compressed}]:{port}" if address.version == 6 else f"{address.compressed}:{port}"


def parse_host_port(value: str) -> str:
    """The canonical form of a `host:port` value (see host_port). Raises ValueError for anything
    else: a scheme, a path, user info, a missing or out-of-range port, an unbracketed IPv6
    address."""
    if not value or len(value) > MAX_ENDPOINT_LENGTH or any(c in value for c in "/@?# \t\\"):
        raise ValueError("must be host:port")
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        if not sep:
            raise ValueError("an IPv6 address must be [addr]:port")
        try:
            if ipaddress.ip_address(host).version != 6:
                raise ValueError("only an IPv6 address goes in brackets")
        except ValueError:
            raise ValueError("the bracketed host is not an IPv6 address") from None
    else:
        host, sep, port = value.rpartition(":")
        if not sep or not host or ":" in host:
            raise ValueError("must be host:port (an IPv6 address as [addr]:port)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("the port must be 1..65535")
    return host_port(host, int(port))


def bare_host(value: str) -> str | None:
    """An address or name without a port ("10.0.0.5", "fd00::5", "[fd00::5]", "decode-0") in the
    canonical form a `host:port` has before its last colon; None for anything else."""
    host = value.strip().strip("[]")
    probe = f"[{host}]:1" if ":" in host else f"{host}:1"
    try:
        return parse_host_port(probe).removesuffix(":1")
    except ValueError:
        return None


@functools.lru_cache(maxsize=4096)
def endpoint_host_port(endpoint: str) -> str | None:
    """The canonical `host:port` of an engine's base URL ("http://10.0.0.5:8000",
    "http://[fd00::5]:8000/v1"); None when it names no host or port. (Remembered: a node's
    endpoint is asked for on every plan that names allowed decode endpoints.)"""
    try:
        parts = urlsplit(endpoint)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return host_port(parts.hostname, port)


class EndpointSet:
    """Endpoints a caller allows: canonical `host:port`s, and bare hosts (any of their ports)."""

    __slots__ = ("endpoints", "hosts")

    def __init__(self, endpoints: Iterable[str] = (), hosts: Iterable[str] = ()) -> None:
        self.endpoints = frozenset(endpoints)
        self.hosts = frozenset(hosts)

    @classmethod
    def parse(cls, entries: Iterable[str]) -> tuple[EndpointSet, list[int]]:
        """The set `entries` name (each a `host:port` or a bare host, any spelling), and the
        positions of the entries that are neither (left out)."""
        endpoints: list[str] = []
        hosts: list[str] = []
        bad: list[int] = []
        for i, raw in enumerate(entries):
            entry = raw.strip()
            try:
                endpoints.append(parse_host_port(entry))
                continue
            except ValueError:
                pass
            host = bare_host(entry) if entry and len(entry) <= MAX_ENDPOINT_LENGTH else None
            if host is None:
                bad.append(i)
            else:
                hosts.append(host)
        return cls(endpoints, hosts), bad

    def __len__(self) -> int:
        return len(self.endpoints) + len(self.hosts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EndpointSet):
            return NotImplemented
        return (self.endpoints, self.hosts) == (other.endpoints, other.hosts)

    def __hash__(self) -> int:
        return hash((self.endpoints, self.hosts))

    def __repr__(self) -> str:
        return f"EndpointSet({sorted(self.entries())!r})"

    def allows(self, endpoint: str) -> bool:
        """Whether `endpoint` (canonical host:port) is in the set."""
        return endpoint in self.endpoints or endpoint.rpartition(":")[0] in self.hosts

    def allows_url(self, url: str) -> bool:
        """Whether the engine whose base URL is `url` is in the set (a URL naming no host:port
        never is)."""
        endpoint = endpoint_host_port(url)
        return endpoint is not None and self.allows(endpoint)

    def entries(self) -> list[str]:
        """The set as `host:port`s and bare hosts, sorted (what EndpointSet.parse reads back)."""
        return sorted(self.endpoints) + sorted(self.hosts)
