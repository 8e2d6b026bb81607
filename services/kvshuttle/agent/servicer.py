"""AgentService over gRPC: translates the agent's status to protobuf, nothing more.

Only GetStatus is implemented (the block pool's accounting included). PullBlocks, ParkRetention
and Prefetch (the NIXL moves) are not yet: the generated base answers them UNIMPLEMENTED.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from kvshuttle.agent.block_pool import PoolStats
from kvshuttle.agent.model import AgentStatus
from kvshuttle.agent.v1 import agent_service_pb2 as pb
from kvshuttle.agent.v1 import agent_service_pb2_grpc as pb_grpc
from kvshuttle.core.prototime import to_timestamp

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
        claimed_retentions=pool.claimed_retentions,
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


class AgentServicer(pb_grpc.AgentServiceServicer):
    def __init__(self, status: Callable[[], AgentStatus]) -> None:
        self._status = status

    async def GetStatus(
        self,
        request: pb.GetStatusRequest,
        context: grpc.aio.ServicerContext[pb.GetStatusRequest, pb.GetStatusResponse],
    ) -> pb.GetStatusResponse:
        return status_to_pb(self._status())


def add_to_server(servicer: AgentServicer, server: grpc.aio.Server) -> None:
    """Register AgentService. RPCs the servicer does not override answer UNIMPLEMENTED (the
    generated base raises NotImplementedError, which the serving interceptor maps)."""
    pb_grpc.add_AgentServiceServicer_to_server(servicer, server)
