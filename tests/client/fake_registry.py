"""A small in-memory RegistryService that misbehaves on request, for client and CLI tests.

It is no reference for the real registry: just enough behaviour (leases with times, fencing,
claims, pages, errors with ErrorInfo) for the client's retries, deadlines, error parsing and
pagination, and for the CLI's formatting, to meet a real grpc.aio server.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any, NoReturn, TypeAlias

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvshuttle.core.hashing import common_prefix_blocks
from kvshuttle.core.prototime import to_timestamp
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc

DOMAIN = "registry.kvshuttle"

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


async def abort(
    context: Context,
    code: grpc.StatusCode,
    reason: str,
    message: str,
    *,
    domain: str = DOMAIN,
    **metadata: str,
) -> NoReturn:
    """End the RPC the way kvshuttle services do: a google.rpc.Status carrying an ErrorInfo."""
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata=metadata))
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    await context.abort_with_status(rpc_status.to_status(status))
    raise AssertionError("abort_with_status returned")  # pragma: no cover


@asynccontextmanager
async def serve(*servicers: tuple[Any, Any]) -> AsyncIterator[str]:
    """Run a grpc.aio server on 127.0.0.1, port 0, with (add_fn, servicer) pairs; yields its address."""
    server = grpc.aio.server()
    for add, servicer in servicers:
        add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


class FakeRegistry(pb_grpc.RegistryServiceServicer):
    """In-memory registry with knobs.

    failures[method]: status codes to answer, one per call, before behaving (e.g. UNAVAILABLE x2).
    delay[method]: seconds to sleep before answering.
    max_page_size: server-side page cap, to force pagination.
    watch_events: what WatchRetentions sends; with hold_watch_open it then waits until cancelled.
    calls / requests / received_metadata: what arrived, per method name.
    """

    def __init__(self) -> None:
        self.address = ""  # set by whoever serves it
        self.nodes: dict[str, pb.Node] = {}
        self.retentions: dict[str, pb.Retention] = {}
        self.fences: dict[str, int] = {}
        self.block_index: dict[str, list[int]] = {}
        self.failures: dict[str, list[grpc.StatusCode]] = defaultdict(list)
        self.delay: dict[str, float] = {}
        self.max_page_size = 100
        self.watch_events: list[pb.WatchRetentionsResponse] = []
        self.hold_watch_open = False
        self.watch_started = asyncio.Event()
        self.calls: Counter[str] = Counter()
        self.requests: dict[str, list[Message]] = defaultdict(list)
        self.received_metadata: dict[str, list[tuple[tuple[str, Any], ...]]] = defaultdict(list)
        self._by_request_id: dict[str, Message] = {}

    # Test helpers

    def fail(self, method: str, *codes: grpc.StatusCode) -> None:
        self.failures[method].extend(codes)

    def add_node(self, name: str, **fields: Any) -> pb.Node:
        now = time.time()
        node = pb.Node(
            name=name,
            role=fields.pop("role", pb.NODE_ROLE_DECODE),
            engine_id=fields.pop("engine_id", f"engine-{name.removeprefix('nodes/')}"),
            http_endpoint=fields.pop("http_endpoint", "http://127.0.0.1:8000"),
            side_channel_host="127.0.0.1",
            side_channel_port=5600,
            model=fields.pop("model", "demo-model"),
            block_size=16,
            kv_bytes_per_token=1024,
            incarnation=1,
            register_time=to_timestamp(now),
            expire_time=to_timestamp(now + 30),
            **fields,
        )
        self.nodes[name] = node
        return node

    def add_retention(self, parent: str, generation: int, node: str, **fields: Any) -> pb.Retention:
        now = time.time()
        retention = pb.Retention(
            name=f"{parent}/retentions/{generation}",
            node=node,
            generation=generation,
            model="demo-model",
            block_size=16,
            num_tokens=fields.pop("num_tokens", 64),
            block_hashes=fields.pop("block_hashes", [1, 2, 3, 4]),
            state=pb.RETENTION_STATE_ACTIVE,
            create_time=to_timestamp(now),
            expire_time=to_timestamp(now + 60),
            **fields,
        )
        self.retentions[retention.name] = retention
        self.fences[parent] = max(self.fences.get(parent, 0), generation)
        return retention

    # Plumbing

    async def _enter(self, method: str, request: Message, context: Context) -> None:
        self.calls[method] += 1
        self.requests[method].append(request)
        self.received_metadata[method].append(tuple(context.invocation_metadata() or ()))
        if method in self.delay:
            await asyncio.sleep(self.delay[method])
        if self.failures[method]:
            code = self.failures[method].pop(0)
            await context.abort(code, f"injected {code.name}")

    def _replay(self, request_id: str) -> Message | None:
        return self._by_request_id.get(request_id) if request_id else None

    def _remember(self, request_id: str, response: Message) -> None:
        if request_id:
            self._by_request_id[request_id] = response

    def _page(self, items: list[Any], page_size: int, page_token: str) -> tuple[list[Any], str]:
        start = int(page_token or 0)
        size = min(page_size or 100, self.max_page_size)
        end = start + size
        return items[start:end], (str(end) if end < len(items) else "")

    async def _node(self, name: str, context: Context) -> pb.Node:
        if name not in self.nodes:
            await abort(context, grpc.StatusCode.NOT_FOUND, "NODE_NOT_FOUND", f"node {name} not found")
        return self.nodes[name]

    async def _retention(self, name: str, context: Context) -> pb.Retention:
        if name not in self.retentions:
            await abort(
                context, grpc.StatusCode.NOT_FOUND, "RETENTION_NOT_FOUND", f"retention {name} not found"
            )
        return self.retentions[name]

    # Nodes

    async def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: Context
    ) -> pb.RegisterNodeResponse:
        await self._enter("RegisterNode", request, context)
        if not request.node.name.startswith("nodes/"):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_ARGUMENT",
                "node.name: must look like nodes/{node}",
                field="node.name",
            )
        now = time.time()
        node = pb.Node()
        node.CopyFrom(request.node)
        previous = self.nodes.get(node.name)
        node.incarnation = (previous.incarnation if previous else 0) + 1
        node.register_time.CopyFrom(to_timestamp(now))
        ttl = request.ttl.ToTimedelta().total_seconds() if request.HasField("ttl") else 10.0
        node.expire_time.CopyFrom(to_timestamp(now + ttl))
        self.nodes[node.name] = node
        return pb.RegisterNodeResponse(node=node)

    async def HeartbeatNode(
        self, request: pb.HeartbeatNodeRequest, context: Context
    ) -> pb.HeartbeatNodeResponse:
        await self._enter("HeartbeatNode", request, context)
        node = await self._node(request.name, context)
        if request.incarnation != node.incarnation:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "NODE_INCARNATION_MISMATCH",
                f"{request.name} is at incarnation {node.incarnation}",
            )
        ttl = request.ttl.ToTimedelta().total_seconds() if request.HasField("ttl") else 10.0
        node.expire_time.CopyFrom(to_timestamp(time.time() + ttl))
        node.load.CopyFrom(request.load)
        return pb.HeartbeatNodeResponse(expire_time=node.expire_time)

    async def DeregisterNode(
        self, request: pb.DeregisterNodeRequest, context: Context
    ) -> pb.DeregisterNodeResponse:
        await self._enter("DeregisterNode", request, context)
        await self._node(request.name, context)
        del self.nodes[request.name]
        gone = [n for n, r in self.retentions.items() if r.node == request.name]
        for name in gone:
            del self.retentions[name]
        return pb.DeregisterNodeResponse(removed_retentions=len(gone))

    async def GetNode(self, request: pb.GetNodeRequest, context: Context) -> pb.GetNodeResponse:
        await self._enter("GetNode", request, context)
        return pb.GetNodeResponse(node=await self._node(request.name, context))

    async def ListNodes(self, request: pb.ListNodesRequest, context: Context) -> pb.ListNodesResponse:
        await self._enter("ListNodes", request, context)
        nodes = [
            n
            for _, n in sorted(self.nodes.items())
            if (not request.model or n.model == request.model)
            and (request.role in (pb.NODE_ROLE_UNSPECIFIED, n.role) or n.role == pb.NODE_ROLE_BOTH)
        ]
        page, token = self._page(nodes, request.page_size, request.page_token)
        return pb.ListNodesResponse(nodes=page, next_page_token=token)

    # Retentions

    async def PutRetention(
        self, request: pb.PutRetentionRequest, context: Context
    ) -> pb.PutRetentionResponse:
        await self._enter("PutRetention", request, context)
        replay = self._replay(request.request_id)
        if isinstance(replay, pb.PutRetentionResponse):
            return replay
        await self._node(request.retention.node, context)
        generation = request.retention.generation
        if generation <= self.fences.get(request.parent, 0):
            await abort(
                context,
                grpc.StatusCode.ABORTED,
                "FENCING_GENERATION_STALE",
                f"generation {generation} is not above {self.fences[request.parent]}",
            )
        replaced = [n for n in self.retentions if n.startswith(f"{request.parent}/retentions/")]
        for name in replaced:
            del self.retentions[name]
        now = time.time()
        retention = pb.Retention()
        retention.CopyFrom(request.retention)
        retention.name = f"{request.parent}/retentions/{generation}"
        retention.state = pb.RETENTION_STATE_ACTIVE
        retention.create_time.CopyFrom(to_timestamp(now))
        ttl = request.ttl.ToTimedelta().total_seconds() if request.HasField("ttl") else 60.0
        retention.expire_time.CopyFrom(to_timestamp(now + ttl))
        self.retentions[retention.name] = retention
        self.fences[request.parent] = generation
        response = pb.PutRetentionResponse(retention=retention, replaced=replaced[0] if replaced else "")
        self._remember(request.request_id, response)
        return response

    async def GetRetention(
        self, request: pb.GetRetentionRequest, context: Context
    ) -> pb.GetRetentionResponse:
        await self._enter("GetRetention", request, context)
        return pb.GetRetentionResponse(retention=await self._retention(request.name, context))

    async def GetConversation(
        self, request: pb.GetConversationRequest, context: Context
    ) -> pb.GetConversationResponse:
        await self._enter("GetConversation", request, context)
        if request.name not in self.fences:
            await abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                "CONVERSATION_NOT_FOUND",
                f"conversation {request.name} not found",
            )
        live = [r for n, r in self.retentions.items() if n.startswith(f"{request.name}/retentions/")]
        conversation = pb.Conversation(
            name=request.name,
            fence_generation=self.fences[request.name],
            retention=live[0] if live else None,
        )
        return pb.GetConversationResponse(conversation=conversation)

    async def RenewRetention(
        self, request: pb.RenewRetentionRequest, context: Context
    ) -> pb.RenewRetentionResponse:
        await self._enter("RenewRetention", request, context)
        retention = await self._retention(request.name, context)
        if retention.state == pb.RETENTION_STATE_CLAIMED:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "RETENTION_CLAIMED",
                f"{request.name} is claimed",
            )
        ttl = request.ttl.ToTimedelta().total_seconds()
        retention.expire_time.CopyFrom(to_timestamp(time.time() + ttl))
        return pb.RenewRetentionResponse(retention=retention)

    async def ClaimRetention(
        self, request: pb.ClaimRetentionRequest, context: Context
    ) -> pb.ClaimRetentionResponse:
        await self._enter("ClaimRetention", request, context)
        replay = self._replay(request.request_id)
        if isinstance(replay, pb.ClaimRetentionResponse):
            return replay
        retention = await self._retention(request.name, context)
        if retention.state == pb.RETENTION_STATE_CLAIMED:
            await abort(
                context,
                grpc.StatusCode.ABORTED,
                "RETENTION_ALREADY_CLAIMED",
                f"{request.name} is claimed by {retention.claim.holder}",
            )
        now = time.time()
        ttl = request.claim_ttl.ToTimedelta().total_seconds() if request.HasField("claim_ttl") else 5.0
        retention.state = pb.RETENTION_STATE_CLAIMED
        retention.claim.CopyFrom(
            pb.Claim(
                claim_id=str(uuid.uuid4()),
                holder=request.holder,
                claim_time=to_timestamp(now),
                expire_time=to_timestamp(now + ttl),
            )
        )
        retention.expire_time.CopyFrom(retention.claim.expire_time)
        response = pb.ClaimRetentionResponse(retention=retention)
        self._remember(request.request_id, response)
        return response

    async def ReleaseRetention(
        self, request: pb.ReleaseRetentionRequest, context: Context
    ) -> pb.ReleaseRetentionResponse:
        await self._enter("ReleaseRetention", request, context)
        retention = await self._retention(request.name, context)
        claimed = retention.state == pb.RETENTION_STATE_CLAIMED
        if claimed and not request.force and request.claim_id != retention.claim.claim_id:
            await abort(
                context, grpc.StatusCode.FAILED_PRECONDITION, "CLAIM_MISMATCH", "claim_id does not match"
            )
        del self.retentions[request.name]
        return pb.ReleaseRetentionResponse()

    async def MoveRetention(
        self, request: pb.MoveRetentionRequest, context: Context
    ) -> pb.MoveRetentionResponse:
        await self._enter("MoveRetention", request, context)
        replay = self._replay(request.request_id)
        if isinstance(replay, pb.MoveRetentionResponse):
            return replay
        retention = await self._retention(request.name, context)
        if retention.state != pb.RETENTION_STATE_CLAIMED or retention.claim.claim_id != request.claim_id:
            await abort(
                context, grpc.StatusCode.FAILED_PRECONDITION, "CLAIM_MISMATCH", "claim_id does not match"
            )
        await self._node(request.node, context)
        ttl = request.ttl.ToTimedelta().total_seconds() if request.HasField("ttl") else 300.0
        retention.node = request.node
        retention.kv_transfer_params.CopyFrom(request.kv_transfer_params)
        retention.kv_bytes = request.kv_bytes
        retention.state = pb.RETENTION_STATE_ACTIVE
        retention.ClearField("claim")
        retention.ClearField("pin_expire_time")
        retention.expire_time.CopyFrom(to_timestamp(time.time() + ttl))
        response = pb.MoveRetentionResponse(retention=retention)
        self._remember(request.request_id, response)
        return response

    async def EvictRetention(
        self, request: pb.EvictRetentionRequest, context: Context
    ) -> pb.EvictRetentionResponse:
        await self._enter("EvictRetention", request, context)
        retention = await self._retention(request.name, context)
        if retention.node != request.node:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "NODE_MISMATCH", "held by another node")
        if retention.state == pb.RETENTION_STATE_CLAIMED:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "RETENTION_ALREADY_CLAIMED", "claimed")
        del self.retentions[request.name]
        return pb.EvictRetentionResponse()

    async def FindRetention(
        self, request: pb.FindRetentionRequest, context: Context
    ) -> pb.FindRetentionResponse:
        """The tenant's latest retention whose transcript has the key (chains: not modelled)."""
        await self._enter("FindRetention", request, context)
        for name, r in sorted(self.retentions.items(), key=lambda kv: kv[1].generation, reverse=True):
            if name.startswith(f"{request.parent}/") and r.transcript.lookup_key == request.transcript_key:
                return pb.FindRetentionResponse(retention=r)
        await context.abort(grpc.StatusCode.NOT_FOUND, "no retention found")
        raise AssertionError("unreachable")

    async def ListRetentions(
        self, request: pb.ListRetentionsRequest, context: Context
    ) -> pb.ListRetentionsResponse:
        await self._enter("ListRetentions", request, context)
        found = [
            r
            for n, r in sorted(self.retentions.items())
            if n.startswith(f"{request.parent}/") and (not request.node or r.node == request.node)
        ]
        page, token = self._page(found, request.page_size, request.page_token)
        return pb.ListRetentionsResponse(retentions=page, next_page_token=token)

    async def WatchRetentions(
        self, request: pb.WatchRetentionsRequest, context: Context
    ) -> AsyncIterator[pb.WatchRetentionsResponse]:
        await self._enter("WatchRetentions", request, context)
        self.watch_started.set()
        for event in self.watch_events:
            if (request.parent and event.retention.name.startswith(f"{request.parent}/")) or (
                request.node and event.retention.node == request.node
            ):
                yield event
        if self.hold_watch_open:
            await asyncio.Event().wait()

    # Block index

    async def ReportBlockEvents(
        self, request: pb.ReportBlockEventsRequest, context: Context
    ) -> pb.ReportBlockEventsResponse:
        await self._enter("ReportBlockEvents", request, context)
        last = request.batches[-1].seq if request.batches else 0
        return pb.ReportBlockEventsResponse(applied_batches=len(request.batches), next_seq=last + 1)

    async def LookupBlocks(
        self, request: pb.LookupBlocksRequest, context: Context
    ) -> pb.LookupBlocksResponse:
        await self._enter("LookupBlocks", request, context)
        matches = [
            pb.NodePrefixMatch(node=node, matched_blocks=n)
            for node, chain in self.block_index.items()
            if (n := common_prefix_blocks(chain, list(request.block_hashes)))
        ]
        matches.sort(key=lambda m: -m.matched_blocks)
        return pb.LookupBlocksResponse(matches=matches)


def closed_port() -> int:
    """A local port nothing listens on (it was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def names(items: Iterable[Any]) -> list[str]:
    return [item.name for item in items]
