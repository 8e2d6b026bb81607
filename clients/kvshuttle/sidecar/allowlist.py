"""The SSRF guard: the sidecar sends a request (prefill) or lets its engine open a KV read
(the reuse params' `remote_host:remote_port`) only to an endpoint of a node the registry lists
as live. Headers come from the network; without this, anyone who can reach the sidecar could
make it POST to any address, or make vLLM connect to one.

The list is the registry's ListNodes (every role), read at most `ttl_s` ago, with one refresh
per `miss_refresh_s` when a target is not in it (a node that just registered); refreshes are
single-flight. When the registry cannot be reached the last list serves until it is
`max_stale_s` old; then, and before any list was read, nothing is allowed. Endpoints compare in
canonical `host:port` form (kvshuttle.core.endpoints.host_port), so `[fd00::1]:8000` and
`[fd00:0::1]:8000` are one, and a name is not an address: a node registered by IP is reached by
that IP only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from kvshuttle.core.endpoints import endpoint_host_port, host_port
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb

__all__ = ["Endpoints", "RegisteredEndpoints"]

log = structlog.get_logger("kvshuttle.sidecar")

# Reads the live nodes, at most `limit`; raises on failure (any exception: the list stays).
NodeReader = Callable[[int], Awaitable[list[reg_pb.Node]]]


@dataclass(frozen=True, slots=True)
class Endpoints:
    """The live nodes' engine endpoints and NIXL side channels, canonical host:port."""

    http: frozenset[str]
    side_channels: frozenset[str]

    @classmethod
    def of(cls, nodes: list[reg_pb.Node]) -> Endpoints:
        http = {hp for n in nodes if n.http_endpoint and (hp := endpoint_host_port(n.http_endpoint))}
        side = {
            host_port(n.side_channel_host, n.side_channel_port)
            for n in nodes
            if n.side_channel_host and 0 < n.side_channel_port < 65536
        }
        return cls(frozenset(http), frozenset(side))


class RegisteredEndpoints:
    """The allow list, refreshed from the registry as the module says."""

    def __init__(
        self,
        read: NodeReader,
        *,
        ttl_s: float,
        miss_refresh_s: float,
        max_stale_s: float,
        max_nodes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._ttl_s = ttl_s
        self._miss_refresh_s = miss_refresh_s
        self._max_stale_s = max_stale_s
        self._max_nodes = max_nodes
        self._clock = clock
        self._endpoints = Endpoints(frozenset(), frozenset())
        self._read_at: float | None = None  # when the list was last read successfully
        self._tried_at: float | None = None  # when a read was last tried
        self._refreshing: asyncio.Task[None] | None = None

    async def allows_prefill(self, target: str) -> bool:
        """Whether `target` (canonical host:port) is a live node's engine endpoint."""
        return await self._allows(target, lambda e: e.http)

    async def allows_kv_source(self, host: str, port: int) -> bool:
        """Whether host:port is a live node's NIXL side channel."""
        if not host or not 0 < port < 65536:
            return False
        return await self._allows(host_port(host, port), lambda e: e.side_channels)

    async def _allows(self, target: str, kind: Callable[[Endpoints], frozenset[str]]) -> bool:
        now = self._clock()
        expired = self._read_at is None or now - self._read_at >= self._ttl_s
        missed = target not in kind(self._endpoints) and (
            self._tried_at is None or now - self._tried_at >= self._miss_refresh_s
        )
        if expired or missed:
            await self._refresh()
        if self._read_at is None or self._clock() - self._read_at >= self._max_stale_s:
            return False
        return target in kind(self._endpoints)

    async def _refresh(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._read_once())
        # Shielded: a request that leaves does not cancel the read the others wait for.
        await asyncio.shield(self._refreshing)

    async def _read_once(self) -> None:
        self._tried_at = self._clock()
        try:
            nodes = await self._read(self._max_nodes)
        except Exception as exc:  # the registry's failure: the list stays as it is
            log.warning("allowlist.read_failed", error=type(exc).__name__, message=str(exc)[:200])
            return
        self._endpoints = Endpoints.of(nodes[: self._max_nodes])
        self._read_at = self._clock()
