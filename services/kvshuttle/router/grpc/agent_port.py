"""AgentPort over the agents' gRPC API (kvshuttle.client.agent.AgentClient): one channel per
agent endpoint, the least recently used closed past `max_channels`; the agents' errors as
domain errors carrying their reason.

Error mapping (KvshuttleRpcError code -> what the shuttle sees):

* NOT_FOUND, FAILED_PRECONDITION, ABORTED, RESOURCE_EXHAUSTED -> the domain error of that code
  with the agent's reason: the agent refused and read nothing (NODE_MISMATCH, a full pool...).
* UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED -> Unavailable: the agent's answer is unknown (it
  may have read the blocks, so the shuttle leaves its claim to lapse).
* anything else (INVALID_ARGUMENT, PERMISSION_DENIED, INTERNAL...) -> FailedPrecondition with
  the agent's reason (logged): a refusal all the same, nothing was read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog
from opentelemetry.sdk.trace import TracerProvider

from kvshuttle.client.agent import AgentClient
from kvshuttle.client.errors import KvshuttleRpcError
from kvshuttle.core.errors import (
    Aborted,
    FailedPrecondition,
    KvshuttleError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvshuttle.router.config import AgentConnection
from kvshuttle.router.model import Pooled
from kvshuttle.vllm.kv_transfer_params import from_vllm, to_vllm
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

__all__ = ["GrpcAgentPort"]

log = structlog.get_logger("kvshuttle.router")

_REFUSED: dict[grpc.StatusCode, type[KvshuttleError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}
_UNKNOWN = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


def agent_error(err: KvshuttleRpcError, endpoint: str) -> KvshuttleError:
    """The domain error of a failed agent call (the mapping above)."""
    metadata = {**err.metadata, "agent": endpoint}
    if err.code in _UNKNOWN:
        return Unavailable(
            f"agent {endpoint} unavailable ({err.code_name}): {err.message}", metadata=metadata
        )
    kind = _REFUSED.get(err.code)
    if kind is None:
        log.warning("shuttle.agent_refused", agent=endpoint, error=repr(err)[:500])
        kind = FailedPrecondition
    return kind(err.message, reason=err.reason or err.code_name, metadata=metadata)


def _pooled(node: str, params: KvTransferParams) -> Pooled:
    return Pooled(node=node, kv_transfer_params=to_vllm(params))


class GrpcAgentPort:
    def __init__(self, connection: AgentConnection, *, tracer_provider: TracerProvider | None = None) -> None:
        self._connection = connection
        self._tracer_provider = tracer_provider
        self._clients: OrderedDict[str, AgentClient] = OrderedDict()
        self._busy: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._clients)

    def _client(self, endpoint: str) -> AgentClient:
        client = self._clients.get(endpoint)
        if client is not None:
            self._clients.move_to_end(endpoint)
            return client
        client = AgentClient.connect(
            self._connection.for_endpoint(endpoint), tracer_provider=self._tracer_provider
        )
        self._clients[endpoint] = client
        # Close the least recently used idle channels past the bound (a busy one stays open).
        for name in list(self._clients):
            if len(self._clients) <= self._connection.max_channels:
                break
            if name != endpoint and not self._busy.get(name):
                old = self._clients.pop(name)
                task = asyncio.get_running_loop().create_task(old.close())
                task.add_done_callback(lambda t: t.exception())
        return client

    @contextlib.asynccontextmanager
    async def _calling(self, endpoint: str) -> AsyncIterator[AgentClient]:
        """The endpoint's client, kept open while in use; its errors as domain errors."""
        client = self._client(endpoint)
        self._busy[endpoint] = self._busy.get(endpoint, 0) + 1
        try:
            yield client
        except KvshuttleRpcError as err:
            raise agent_error(err, endpoint) from err
        finally:
            left = self._busy[endpoint] - 1
            if left:
                self._busy[endpoint] = left
            else:
                del self._busy[endpoint]

    async def park(
        self, endpoint: str, retention: str, *, source: dict[str, Any], ttl: float, request_id: str
    ) -> Pooled:
        async with self._calling(endpoint) as client:
            response = await client.park_retention(
                retention, source=from_vllm(source, "source"), ttl=ttl, request_id=request_id
            )
        return _pooled(response.node, response.pooled)

    async def prefetch(
        self,
        endpoint: str,
        retention: str,
        target_node: str,
        *,
        source: dict[str, Any],
        ttl: float,
        request_id: str,
    ) -> Pooled:
        async with self._calling(endpoint) as client:
            response = await client.prefetch(
                retention, target_node, source=from_vllm(source, "source"), ttl=ttl, request_id=request_id
            )
        return _pooled(response.node, response.pooled)

    async def serving(self, endpoint: str, *, deadline_s: float) -> bool:
        try:
            async with self._calling(endpoint) as client:
                status = await client.get_status(timeout=deadline_s)
        except KvshuttleError:
            return False
        return status.pool.capacity_bytes > 0

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), OrderedDict()
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
