"""RegistryService over gRPC: translates protobuf to the domain and back, nothing more.

Domain errors propagate to the serving interceptor, which maps them to status codes. Retention
names are bound for the `rpc.done` line with their conversation id replaced by its digest
(`log_name`): conversation ids are the tenant's data and never reach a log.
"""

from __future__ import annotations

from array import array
from collections.abc import AsyncIterator

import grpc
from structlog.contextvars import bind_contextvars

from kvshuttle.client.registry_convert import load_from_pb
from kvshuttle.core.digest import log_name
from kvshuttle.core.prototime import duration_seconds, to_timestamp
from kvshuttle.registry.api import convert
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc


class RegistryServicer(pb_grpc.RegistryServiceServicer):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def RegisterNode(
        self,
        request: pb.RegisterNodeRequest,
        context: grpc.aio.ServicerContext[pb.RegisterNodeRequest, pb.RegisterNodeResponse],
    ) -> pb.RegisterNodeResponse:
        bind_contextvars(node=request.node.name)
        node = await self._registry.register_node(
            convert.node_spec_from_pb(request.node), duration_seconds(request.ttl, "ttl")
        )
        return pb.RegisterNodeResponse(
            node=convert.node_to_pb(node, self._registry.indexed_blocks(node.name))
        )

    async def HeartbeatNode(
        self,
        request: pb.HeartbeatNodeRequest,
        context: grpc.aio.ServicerContext[pb.HeartbeatNodeRequest, pb.HeartbeatNodeResponse],
    ) -> pb.HeartbeatNodeResponse:
        bind_contextvars(node=request.name)
        node = await self._registry.heartbeat_node(
            request.name,
            request.incarnation,
            duration_seconds(request.ttl, "ttl"),
            load_from_pb(request.load),
        )
        return pb.HeartbeatNodeResponse(expire_time=to_timestamp(node.expire_at))

    async def DeregisterNode(
        self,
        request: pb.DeregisterNodeRequest,
        context: grpc.aio.ServicerContext[pb.DeregisterNodeRequest, pb.DeregisterNodeResponse],
    ) -> pb.DeregisterNodeResponse:
        bind_contextvars(node=request.name)
        removed = await self._registry.deregister_node(request.name, request.incarnation)
        return pb.DeregisterNodeResponse(removed_retentions=removed)

    async def GetNode(
        self,
        request: pb.GetNodeRequest,
        context: grpc.aio.ServicerContext[pb.GetNodeRequest, pb.GetNodeResponse],
    ) -> pb.GetNodeResponse:
        node = await self._registry.get_node(request.name)
        return pb.GetNodeResponse(node=convert.node_to_pb(node, self._registry.indexed_blocks(node.name)))

    async def ListNodes(
        self,
        request: pb.ListNodesRequest,
        context: grpc.aio.ServicerContext[pb.ListNodesRequest, pb.ListNodesResponse],
    ) -> pb.ListNodesResponse:
        nodes, token = await self._registry.list_nodes(
            role=convert.role_from_pb(request.role, "role", required=False),
            model=request.model,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListNodesResponse(
            nodes=[convert.node_to_pb(n, self._registry.indexed_blocks(n.name)) for n in nodes],
            next_page_token=token,
        )

    async def PutRetention(
        self,
        request: pb.PutRetentionRequest,
        context: grpc.aio.ServicerContext[pb.PutRetentionRequest, pb.PutRetentionResponse],
    ) -> pb.PutRetentionResponse:
        result = await self._registry.put_retention(
            request_id=request.request_id,
            parent=request.parent,
            retention=convert.retention_from_pb(request.retention),
            ttl=duration_seconds(request.ttl, "ttl"),
        )
        bind_contextvars(retention=log_name(result.retention.name))
        return pb.PutRetentionResponse(
            retention=convert.retention_to_pb(result.retention),
            replaced=result.replaced,
        )

    async def GetRetention(
        self,
        request: pb.GetRetentionRequest,
        context: grpc.aio.ServicerContext[pb.GetRetentionRequest, pb.GetRetentionResponse],
    ) -> pb.GetRetentionResponse:
        retention = await self._registry.get_retention(request.name)
        return pb.GetRetentionResponse(retention=convert.retention_to_pb(retention, transcript=True))

    async def FindRetention(
        self,
        request: pb.FindRetentionRequest,
        context: grpc.aio.ServicerContext[pb.FindRetentionRequest, pb.FindRetentionResponse],
    ) -> pb.FindRetentionResponse:
        found = await self._registry.find_retention(
            parent=request.parent,
            model=request.model,
            block_size=request.block_size,
            block_hashes=array("Q", request.block_hashes),
            transcript_key=request.transcript_key,
        )
        bind_contextvars(retention=log_name(found.retention.name))
        return pb.FindRetentionResponse(
            retention=convert.retention_to_pb(found.retention, transcript=True),
            matched_blocks=found.matched_blocks,
        )

    async def GetConversation(
        self,
        request: pb.GetConversationRequest,
        context: grpc.aio.ServicerContext[pb.GetConversationRequest, pb.GetConversationResponse],
    ) -> pb.GetConversationResponse:
        conversation = await self._registry.get_conversation(request.name)
        out = pb.Conversation(name=conversation.name, fence_generation=conversation.fence_generation)
        if conversation.retention is not None:
            out.retention.CopyFrom(convert.retention_to_pb(conversation.retention, transcript=True))
        return pb.GetConversationResponse(conversation=out)

    async def RenewRetention(
        self,
        request: pb.RenewRetentionRequest,
        context: grpc.aio.ServicerContext[pb.RenewRetentionRequest, pb.RenewRetentionResponse],
    ) -> pb.RenewRetentionResponse:
        bind_contextvars(retention=log_name(request.name))
        retention = await self._registry.renew_retention(request.name, duration_seconds(request.ttl, "ttl"))
        return pb.RenewRetentionResponse(retention=convert.retention_to_pb(retention))

    async def ClaimRetention(
        self,
        request: pb.ClaimRetentionRequest,
        context: grpc.aio.ServicerContext[pb.ClaimRetentionRequest, pb.ClaimRetentionResponse],
    ) -> pb.ClaimRetentionResponse:
        bind_contextvars(retention=log_name(request.name), holder=request.holder[:300])
        retention = await self._registry.claim_retention(
            request_id=request.request_id,
            name=request.name,
            holder=request.holder,
            claim_ttl=duration_seconds(request.claim_ttl, "claim_ttl"),
            shared=request.shared,
        )
        return pb.ClaimRetentionResponse(retention=convert.retention_to_pb(retention))

    async def ReleaseRetention(
        self,
        request: pb.ReleaseRetentionRequest,
        context: grpc.aio.ServicerContext[pb.ReleaseRetentionRequest, pb.ReleaseRetentionResponse],
    ) -> pb.ReleaseRetentionResponse:
        bind_contextvars(retention=log_name(request.name))
        await self._registry.release_retention(
            request.name, claim_id=request.claim_id, force=request.force, keep=request.keep
        )
        return pb.ReleaseRetentionResponse()

    async def MoveRetention(
        self,
        request: pb.MoveRetentionRequest,
        context: grpc.aio.ServicerContext[pb.MoveRetentionRequest, pb.MoveRetentionResponse],
    ) -> pb.MoveRetentionResponse:
        bind_contextvars(retention=log_name(request.name), node=request.node)
        retention = await self._registry.move_retention(
            request_id=request.request_id,
            move=convert.move_from_pb(request),
            ttl=duration_seconds(request.ttl, "ttl"),
        )
        return pb.MoveRetentionResponse(retention=convert.retention_to_pb(retention))

    async def EvictRetention(
        self,
        request: pb.EvictRetentionRequest,
        context: grpc.aio.ServicerContext[pb.EvictRetentionRequest, pb.EvictRetentionResponse],
    ) -> pb.EvictRetentionResponse:
        bind_contextvars(retention=log_name(request.name), node=request.node)
        await self._registry.evict_retention(request.name, node=request.node)
        return pb.EvictRetentionResponse()

    async def ListRetentions(
        self,
        request: pb.ListRetentionsRequest,
        context: grpc.aio.ServicerContext[pb.ListRetentionsRequest, pb.ListRetentionsResponse],
    ) -> pb.ListRetentionsResponse:
        retentions, token = await self._registry.list_retentions(
            parent=request.parent,
            node=request.node,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListRetentionsResponse(
            retentions=[convert.retention_to_pb(r) for r in retentions], next_page_token=token
        )

    async def WatchRetentions(
        self,
        request: pb.WatchRetentionsRequest,
        context: grpc.aio.ServicerContext[pb.WatchRetentionsRequest, pb.WatchRetentionsResponse],
    ) -> AsyncIterator[pb.WatchRetentionsResponse]:
        subscription = self._registry.watch(
            parent=request.parent, node=request.node, resume_token=request.resume_token
        )
        try:
            async for change in subscription:
                yield convert.change_to_pb(change)
        finally:
            self._registry.unwatch(subscription)

    async def ReportBlockEvents(
        self,
        request: pb.ReportBlockEventsRequest,
        context: grpc.aio.ServicerContext[pb.ReportBlockEventsRequest, pb.ReportBlockEventsResponse],
    ) -> pb.ReportBlockEventsResponse:
        bind_contextvars(node=request.node, batches=len(request.batches))
        result = await self._registry.report_block_events(
            request.node, request.incarnation, convert.event_batches_from_pb(request.batches)
        )
        return pb.ReportBlockEventsResponse(
            applied_batches=result.applied_batches,
            next_seq=result.next_seq,
            gap_detected=result.gap_detected,
            engine_restarted=result.engine_restarted,
        )

    async def LookupBlocks(
        self,
        request: pb.LookupBlocksRequest,
        context: grpc.aio.ServicerContext[pb.LookupBlocksRequest, pb.LookupBlocksResponse],
    ) -> pb.LookupBlocksResponse:
        matches = await self._registry.lookup_blocks(
            request.block_hashes,
            model=request.model,
            role=convert.role_from_pb(request.role, "role", required=False),
        )
        return pb.LookupBlocksResponse(
            matches=[pb.NodePrefixMatch(node=n, matched_blocks=m) for n, m in matches]
        )
