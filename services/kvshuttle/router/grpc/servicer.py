"""RouterService over gRPC: translates protobuf to the router's domain and back, nothing more.

Domain errors propagate to the serving interceptor, which maps them to status codes with an
ErrorInfo (domain "router.kvshuttle"). What is bound here lands in the RPC's one `rpc.done`
line: the conversation, its id replaced by a digest (`log_name`, as the registry logs names:
conversation ids are the tenant's data and never reach a log), and `turn`, a short digest of
the turn handle: the handle itself is a bearer credential for CommitTurn and AbortTurn and stays
out of the logs, while the digest still ties a turn's plan, commit and abort lines together.
"""

from __future__ import annotations

import grpc
from structlog.contextvars import bind_contextvars

from kvshuttle.core.digest import log_digest, log_name
from kvshuttle.core.prototime import to_timestamp
from kvshuttle.router.grpc import convert
from kvshuttle.router.router import Router
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.router.v1 import router_service_pb2_grpc as pb_grpc


class RouterServicer(pb_grpc.RouterServiceServicer):
    def __init__(self, router: Router) -> None:
        self._router = router

    async def PlanTurn(
        self,
        request: pb.PlanTurnRequest,
        context: grpc.aio.ServicerContext[pb.PlanTurnRequest, pb.PlanTurnResponse],
    ) -> pb.PlanTurnResponse:
        bind_contextvars(conversation=log_name(request.conversation[:300]), model=request.model[:200])
        if request.hints.decode_endpoints:
            bind_contextvars(decode_endpoints=len(request.hints.decode_endpoints))
        plan = await self._router.plan_turn(
            convert.plan_request_from_pb(request, deadline_s=context.time_remaining())
        )
        bind_contextvars(turn=log_digest(plan.turn), generation=plan.generation)
        if plan.conversation != request.conversation:  # found by the prompt, or started here
            bind_contextvars(conversation=log_name(plan.conversation))
        return convert.plan_to_pb(plan)

    async def CommitTurn(
        self,
        request: pb.CommitTurnRequest,
        context: grpc.aio.ServicerContext[pb.CommitTurnRequest, pb.CommitTurnResponse],
    ) -> pb.CommitTurnResponse:
        bind_contextvars(turn=log_digest(request.turn))
        result = await self._router.commit_turn(convert.commit_request_from_pb(request))
        response = pb.CommitTurnResponse(retention=result.retention)
        if result.expire_at is not None:
            response.expire_time.CopyFrom(to_timestamp(result.expire_at))
        return response

    async def AbortTurn(
        self,
        request: pb.AbortTurnRequest,
        context: grpc.aio.ServicerContext[pb.AbortTurnRequest, pb.AbortTurnResponse],
    ) -> pb.AbortTurnResponse:
        bind_contextvars(turn=log_digest(request.turn))
        await self._router.abort_turn(request.turn, request.reason)
        return pb.AbortTurnResponse()

    async def ListReadyDecodes(
        self,
        request: pb.ListReadyDecodesRequest,
        context: grpc.aio.ServicerContext[pb.ListReadyDecodesRequest, pb.ListReadyDecodesResponse],
    ) -> pb.ListReadyDecodesResponse:
        bind_contextvars(model=request.model[:200])
        decodes = await self._router.ready_decodes(request.model)
        return pb.ListReadyDecodesResponse(decodes=[convert.placement_to_pb(node) for node in decodes])

    async def FindTranscript(
        self,
        request: pb.FindTranscriptRequest,
        context: grpc.aio.ServicerContext[pb.FindTranscriptRequest, pb.FindTranscriptResponse],
    ) -> pb.FindTranscriptResponse:
        bind_contextvars(model=request.model[:200])
        found = await self._router.find_transcript(request.tenant, request.model, request.lookup_key)
        bind_contextvars(
            conversation=log_name(found.conversation), transcript_tokens=len(found.transcript.token_ids)
        )
        return convert.transcript_to_pb(found)
