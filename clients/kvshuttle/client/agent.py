"""Typed async client of kvshuttle.agent.v1.AgentService."""

from __future__ import annotations

from kvshuttle.agent.v1 import agent_service_pb2 as pb
from kvshuttle.client._base import ServiceClient, new_request_id
from kvshuttle.client.retry import AGENT_SERVICE
from kvshuttle.core.prototime import DurationLike, to_duration
from kvshuttle.vllm.v1 import kv_transfer_params_pb2 as vllm_pb

__all__ = ["AgentClient"]


class AgentClient(ServiceClient):
    """The sidecar agent of one vLLM worker.

    Same conventions as RegistryClient: each method returns the RPC's response message, a
    `request_id` of None becomes a uuid4 (so the KV-moving calls are retried safely on
    UNAVAILABLE), failures raise KvshuttleRpcError.
    """

    SERVICE = AGENT_SERVICE

    async def get_status(self, *, timeout: float | None = None) -> pb.GetStatusResponse:
        """The agent's view of its engine, KV-event stream and block pool."""
        return await self._unary("GetStatus", pb.GetStatusRequest(), pb.GetStatusResponse, timeout)

    async def pull_blocks(
        self,
        source: vllm_pb.KvTransferParams,
        *,
        ttl: DurationLike,
        notify_holder: bool = False,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> pb.PullBlocksResponse:
        """Read the blocks `source` describes (any holder's side channel) into the agent's pool
        for `ttl`, notifying the holder if asked; the answer's `pooled` params read them from
        the agent's pool node (`node`)."""
        request = pb.PullBlocksRequest(
            request_id=new_request_id(request_id),
            source=source,
            notify_holder=notify_holder,
            ttl=to_duration(ttl),
        )
        return await self._unary("PullBlocks", request, pb.PullBlocksResponse, timeout)

    async def park_retention(
        self,
        retention: str,
        *,
        source: vllm_pb.KvTransferParams,
        ttl: DurationLike,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> pb.ParkRetentionResponse:
        """Copy `retention`'s KV out of the agent's own engine into its pool, for `ttl` (plus
        the pool's serve grace). `source`: the retention's params addressed to the engine as
        registered. The answer's `pooled` params and pool `node` are what MoveRetention stores;
        the caller holds the retention's claim (the engine's copy is freed by the READ)."""
        request = pb.ParkRetentionRequest(
            request_id=new_request_id(request_id), retention=retention, source=source, ttl=to_duration(ttl)
        )
        return await self._unary("ParkRetention", request, pb.ParkRetentionResponse, timeout)

    async def prefetch(
        self,
        retention: str,
        target_node: str,
        *,
        source: vllm_pb.KvTransferParams,
        ttl: DurationLike,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> pb.PrefetchResponse:
        """Move `retention`'s KV from its holder (`source`: addressed to the holder as
        registered, a decode engine or another agent's pool node) into the pool of this agent,
        the agent of `target_node` ("nodes/{node}", the next prefill's node), for `ttl`. As
        park_retention otherwise."""
        request = pb.PrefetchRequest(
            request_id=new_request_id(request_id),
            retention=retention,
            target_node=target_node,
            source=source,
            ttl=to_duration(ttl),
        )
        return await self._unary("Prefetch", request, pb.PrefetchResponse, timeout)
