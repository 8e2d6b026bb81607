"""AgentService over gRPC: translates requests to the agent's domain calls and answers to
protobuf, nothing more. GetStatus reads the agent's status; ParkRetention, Prefetch and
PullBlocks call the mover (kvshuttle.agent.pool.mover), whose domain errors the serving interceptor
maps to statuses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from kvshuttle.agent.model import AgentStatus
from kvshuttle.agent.pool.blocks import PoolStats
from kvshuttle.agent.v1 import agent_service_pb2 as pb
from kvshuttle.agent.v1 import agent_service_pb2_grpc as pb_grpc
from kvshuttle.core.errors import FailedPrecondition, InvalidArgument
from kvshuttle.core.prototime import duration_seconds, to_duration, to_timestamp
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

if TYPE_CHECKING:  # the mover needs NIXL, which an agent without a pool may lack
    from kvshuttle.agent.pool.mover import Mover

__all__ = ["AgentServicer", "add_to_server", "pool_to_pb", "status_to_pb"]


def pool_to_pb(pool: PoolStats | None) -> pb.PoolStatus:
    if pool is None:
        return pb.PoolStatus()
    return pb.PoolStatus(
        capacity_bytes=pool.capacity_bytes,
        used_bytes=pool.used_bytes,
        parked_retentions=pool.parked_retentions,
        total_blocks=pool.total_blocks,
        used_blocks=pool.used_blocks,
        free_blocks=pool.free_blocks,
        block_bytes=pool.slot_bytes,
        regions=pool.regions,
        filling_retentions=pool.filling_retentions,
        expired_retentions=pool.expired_retentions,
        failed_allocations=pool.failed_allocations,
    )


def status_to_pb(status: AgentStatus) -> pb.GetStatusResponse:
    engine, events, lease = status.engine, status.events, status.lease
    engine_pb = pb.EngineStatus(
        http_endpoint=status.http_endpoint,
        engine_id=status.engine_id,
        healthy=engine.healthy,
        running_requests=engine.running_requests,
        waiting_requests=engine.waiting_requests,
        kv_cache_usage=engine.kv_cache_usage,
    )
    if engine.last_poll_time is not None:
        engine_pb.last_poll_time.CopyFrom(to_timestamp(engine.last_poll_time))
    return pb.GetStatusResponse(
        node=lease.name,
        incarnation=lease.incarnation,
        registered=lease.registered,
        engine=engine_pb,
        events=pb.EventStreamStatus(
            endpoint=events.endpoint,
            last_seq=events.last_seq or 0,
            batches_received=events.batches_received,
            batches_forwarded=events.batches_forwarded,
            batches_dropped=events.batches_dropped,
            gaps_detected=events.gaps_detected,
            gaps_filled=events.gaps_filled,
            engine_restarts=events.engine_restarts,
        ),
        pool=pool_to_pb(status.pool),
    )


def _ttl(request: pb.ParkRetentionRequest | pb.PrefetchRequest | pb.PullBlocksRequest) -> float:
    ttl = duration_seconds(request.ttl, "ttl")
    if ttl is None:
        raise InvalidArgument("ttl", "required: how long the pool keeps the KV")
    return ttl


def _source(
    request: pb.ParkRetentionRequest | pb.PrefetchRequest | pb.PullBlocksRequest,
) -> KvTransferParams:
    if not request.HasField("source"):
        raise InvalidArgument("source", "required: the retention's params, addressed to its holder")
    return request.source


class AgentServicer(pb_grpc.AgentServiceServicer):
    def __init__(self, status: Callable[[], AgentStatus], moves: Callable[[], Mover] | None = None) -> None:
        """`moves`: the agent's mover (raising when the agent has none; None: no pool at all)."""
        self._status = status
        self._moves = moves

    def _mover(self) -> Mover:
        if self._moves is None:
            raise FailedPrecondition("the agent has no pool")
        return self._moves()

    async def GetStatus(
        self,
        request: pb.GetStatusRequest,
        context: grpc.aio.ServicerContext[pb.GetStatusRequest, pb.GetStatusResponse],
    ) -> pb.GetStatusResponse:
        return status_to_pb(self._status())

    async def ParkRetention(
        self,
        request: pb.ParkRetentionRequest,
        context: grpc.aio.ServicerContext[pb.ParkRetentionRequest, pb.ParkRetentionResponse],
    ) -> pb.ParkRetentionResponse:
        moved = await self._mover().park(
            request.retention, _source(request), ttl=_ttl(request), request_id=request.request_id
        )
        response = pb.ParkRetentionResponse(
            retention=moved.name, bytes=moved.bytes, pooled=moved.pooled, node=moved.node
        )
        response.expire_time.CopyFrom(to_timestamp(moved.expire_time))
        return response

    async def Prefetch(
        self,
        request: pb.PrefetchRequest,
        context: grpc.aio.ServicerContext[pb.PrefetchRequest, pb.PrefetchResponse],
    ) -> pb.PrefetchResponse:
        moved = await self._mover().prefetch(
            request.retention,
            request.target_node,
            _source(request),
            ttl=_ttl(request),
            request_id=request.request_id,
        )
        return pb.PrefetchResponse(
            retention=moved.name,
            bytes=moved.bytes,
            duration=to_duration(moved.read_seconds),
            pooled=moved.pooled,
            node=moved.node,
        )

    async def PullBlocks(
        self,
        request: pb.PullBlocksRequest,
        context: grpc.aio.ServicerContext[pb.PullBlocksRequest, pb.PullBlocksResponse],
    ) -> pb.PullBlocksResponse:
        if not request.request_id:
            raise InvalidArgument("request_id", "required: the pulled blocks are held as pull/{request_id}")
        moved = await self._mover().pull(
            _source(request),
            ttl=_ttl(request),
            notify_holder=request.notify_holder,
            request_id=request.request_id,
        )
        return pb.PullBlocksResponse(
            pooled=moved.pooled, bytes=moved.bytes, duration=to_duration(moved.read_seconds), node=moved.node
        )


def add_to_server(servicer: AgentServicer, server: grpc.aio.Server) -> None:
    """Register AgentService."""
    pb_grpc.add_AgentServiceServicer_to_server(servicer, server)
