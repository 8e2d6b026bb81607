"""Typed async client of kvshuttle.registry.v1.RegistryService."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Sequence

from kvshuttle.client._base import ServiceClient, new_request_id
from kvshuttle.client.retry import REGISTRY_SERVICE
from kvshuttle.core.prototime import DurationLike, to_duration
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

__all__ = ["RegistryClient"]

DEFAULT_PAGE_SIZE = 100


class RegistryClient(ServiceClient):
    """Nodes, retentions and the block index of a kvshuttle registry.

    Every RPC method returns the RPC's response message (e.g. `GetNodeResponse`, whose `node`
    is the node), so responses can grow fields without changing these signatures; the
    `iter_*` helpers yield the listed items themselves across all pages. Durations are
    `timedelta` or seconds; None leaves them unset (the server's default applies). Methods
    with a `request_id` fill in a uuid4 when it is None, which makes them safe to retry.
    Failures raise KvshuttleRpcError.

        async with RegistryClient.connect("127.0.0.1:50051") as registry:
            node = (await registry.get_node("nodes/decode-0")).node
    """

    SERVICE = REGISTRY_SERVICE

    # Nodes

    async def register_node(
        self, node: pb.Node, *, ttl: DurationLike | None = None, timeout: float | None = None
    ) -> pb.RegisterNodeResponse:
        """Create or replace `node`'s lease; the response's node carries the new incarnation.

        Never retried: each call starts a new incarnation.
        """
        request = pb.RegisterNodeRequest(node=node)
        if ttl is not None:
            request.ttl.CopyFrom(to_duration(ttl))
        return await self._unary("RegisterNode", request, pb.RegisterNodeResponse, timeout)

    async def heartbeat_node(
        self,
        name: str,
        incarnation: int,
        *,
        ttl: DurationLike | None = None,
        load: pb.NodeLoad | None = None,
        timeout: float | None = None,
    ) -> pb.HeartbeatNodeResponse:
        """Renew the lease of `name` ("nodes/{node}") at `incarnation`, reporting `load`."""
        request = pb.HeartbeatNodeRequest(name=name, incarnation=incarnation, load=load)
        if ttl is not None:
            request.ttl.CopyFrom(to_duration(ttl))
        return await self._unary("HeartbeatNode", request, pb.HeartbeatNodeResponse, timeout)

    async def deregister_node(
        self, name: str, *, incarnation: int = 0, timeout: float | None = None
    ) -> pb.DeregisterNodeResponse:
        """End the lease of `name` now (only `incarnation`'s when non-zero)."""
        request = pb.DeregisterNodeRequest(name=name, incarnation=incarnation)
        return await self._unary("DeregisterNode", request, pb.DeregisterNodeResponse, timeout)

    async def get_node(self, name: str, *, timeout: float | None = None) -> pb.GetNodeResponse:
        """One live node, "nodes/{node}"."""
        return await self._unary("GetNode", pb.GetNodeRequest(name=name), pb.GetNodeResponse, timeout)

    async def list_nodes(
        self,
        *,
        role: pb.NodeRole.ValueType = pb.NODE_ROLE_UNSPECIFIED,
        model: str = "",
        page_size: int = DEFAULT_PAGE_SIZE,
        page_token: str = "",
        timeout: float | None = None,
    ) -> pb.ListNodesResponse:
        """One page of live nodes in name order (of `role` and NODE_ROLE_BOTH, serving `model`)."""
        request = pb.ListNodesRequest(role=role, model=model, page_size=page_size, page_token=page_token)
        return await self._unary("ListNodes", request, pb.ListNodesResponse, timeout)

    async def iter_nodes(
        self,
        *,
        role: pb.NodeRole.ValueType = pb.NODE_ROLE_UNSPECIFIED,
        model: str = "",
        page_size: int = DEFAULT_PAGE_SIZE,
        timeout: float | None = None,
    ) -> AsyncGenerator[pb.Node, None]:
        """Every live node, following next_page_token; `timeout` applies to each page."""
        token = ""
        while True:
            page = await self.list_nodes(
                role=role, model=model, page_size=page_size, page_token=token, timeout=timeout
            )
            for node in page.nodes:
                yield node
            token = page.next_page_token
            if not token:
                return

    # Retentions

    async def put_retention(
        self,
        parent: str,
        retention: pb.Retention,
        *,
        ttl: DurationLike | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> pb.PutRetentionResponse:
        """Record `retention` for conversation `parent` ("tenants/{t}/conversations/{c}").

        Fails with ABORTED (FENCING_GENERATION_STALE) unless its generation is the
        conversation's highest yet. Retried on UNAVAILABLE under its request_id.
        """
        request = pb.PutRetentionRequest(
            request_id=new_request_id(request_id), parent=parent, retention=retention
        )
        if ttl is not None:
            request.ttl.CopyFrom(to_duration(ttl))
        return await self._unary("PutRetention", request, pb.PutRetentionResponse, timeout)

    async def get_retention(self, name: str, *, timeout: float | None = None) -> pb.GetRetentionResponse:
        """One live retention, "tenants/{t}/conversations/{c}/retentions/{generation}"."""
        request = pb.GetRetentionRequest(name=name)
        return await self._unary("GetRetention", request, pb.GetRetentionResponse, timeout)

    async def get_conversation(
        self, name: str, *, timeout: float | None = None
    ) -> pb.GetConversationResponse:
        """A conversation's fencing generation and live retention, "tenants/{t}/conversations/{c}"."""
        request = pb.GetConversationRequest(name=name)
        return await self._unary("GetConversation", request, pb.GetConversationResponse, timeout)

    async def find_retention(
        self,
        parent: str,
        *,
        model: str,
        block_size: int = 0,
        block_hashes: Sequence[int] = (),
        transcript_key: bytes = b"",
        timeout: float | None = None,
    ) -> pb.FindRetentionResponse:
        """The tenant's ("tenants/{t}") live retention whose chain is the longest prefix of
        `block_hashes`, or whose transcript has `transcript_key` (set one)."""
        request = pb.FindRetentionRequest(
            parent=parent,
            model=model,
            block_size=block_size,
            block_hashes=block_hashes,
            transcript_key=transcript_key,
        )
        return await self._unary("FindRetention", request, pb.FindRetentionResponse, timeout)

    async def renew_retention(
        self, name: str, ttl: DurationLike, *, timeout: float | None = None
    ) -> pb.RenewRetentionResponse:
        """Extend a retention's lease to now + `ttl` (capped by its pin and the server's max)."""
        request = pb.RenewRetentionRequest(name=name, ttl=to_duration(ttl))
        return await self._unary("RenewRetention", request, pb.RenewRetentionResponse, timeout)

    async def claim_retention(
        self,
        name: str,
        holder: str,
        claim_ttl: DurationLike | None = None,
        *,
        request_id: str | None = None,
        shared: bool = False,
        timeout: float | None = None,
    ) -> pb.ClaimRetentionResponse:
        """Take retention `name` for one reader, `holder`, pinned for `claim_ttl`; with
        `shared`, as one of several readers of a pool-held retention.

        ABORTED (RETENTION_ALREADY_CLAIMED) when someone else holds it. Retried on UNAVAILABLE
        under its request_id, so a lost response does not lose the claim.
        """
        request = pb.ClaimRetentionRequest(
            request_id=new_request_id(request_id), name=name, holder=holder, shared=shared
        )
        if claim_ttl is not None:
            request.claim_ttl.CopyFrom(to_duration(claim_ttl))
        return await self._unary("ClaimRetention", request, pb.ClaimRetentionResponse, timeout)

    async def release_retention(
        self,
        name: str,
        *,
        claim_id: str = "",
        force: bool = False,
        keep: bool = False,
        timeout: float | None = None,
    ) -> pb.ReleaseRetentionResponse:
        """Remove retention `name`; a claimed one needs its `claim_id`, or `force`. With `keep`,
        give the claim `claim_id` back instead (the caller read nothing): the retention stays."""
        request = pb.ReleaseRetentionRequest(name=name, claim_id=claim_id, force=force, keep=keep)
        return await self._unary("ReleaseRetention", request, pb.ReleaseRetentionResponse, timeout)

    async def move_retention(
        self,
        name: str,
        *,
        claim_id: str,
        node: str,
        kv_transfer_params: KvTransferParams,
        kv_bytes: int,
        ttl: DurationLike | None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> pb.MoveRetentionResponse:
        """Hand claimed retention `name` to `node` (an agent's pool node), whose
        `kv_transfer_params` readers use from now on; its lease runs `ttl` from now (None: the
        server's default). Ends the claim `claim_id`.

        FAILED_PRECONDITION: CLAIM_MISMATCH (not claimed with claim_id), RETENTION_EXPIRED (the
        claim lapsed), NODE_MISMATCH (params or model not the node's); NOT_FOUND: NODE_NOT_FOUND,
        RETENTION_NOT_FOUND. Retried on UNAVAILABLE under its request_id.
        """
        request = pb.MoveRetentionRequest(
            request_id=new_request_id(request_id),
            name=name,
            claim_id=claim_id,
            node=node,
            kv_transfer_params=kv_transfer_params,
            kv_bytes=kv_bytes,
        )
        if ttl is not None:
            request.ttl.CopyFrom(to_duration(ttl))
        return await self._unary("MoveRetention", request, pb.MoveRetentionResponse, timeout)

    async def evict_retention(
        self, name: str, *, node: str, timeout: float | None = None
    ) -> pb.EvictRetentionResponse:
        """Remove retention `name` from `node` (the caller's pool node) to make room.

        FAILED_PRECONDITION: NODE_MISMATCH (another node holds it), RETENTION_ALREADY_CLAIMED (a
        reader claimed it: keep it). NOT_FOUND (RETENTION_NOT_FOUND) means it is gone already,
        which is also what a retry after a lost success answers: treat it as evicted.
        """
        request = pb.EvictRetentionRequest(name=name, node=node)
        return await self._unary("EvictRetention", request, pb.EvictRetentionResponse, timeout)

    async def list_retentions(
        self,
        parent: str,
        *,
        node: str = "",
        page_size: int = DEFAULT_PAGE_SIZE,
        page_token: str = "",
        timeout: float | None = None,
    ) -> pb.ListRetentionsResponse:
        """One page of the live retentions of `parent` ("tenants/{t}" or a conversation)."""
        request = pb.ListRetentionsRequest(
            parent=parent, node=node, page_size=page_size, page_token=page_token
        )
        return await self._unary("ListRetentions", request, pb.ListRetentionsResponse, timeout)

    async def iter_retentions(
        self,
        parent: str,
        *,
        node: str = "",
        page_size: int = DEFAULT_PAGE_SIZE,
        timeout: float | None = None,
    ) -> AsyncGenerator[pb.Retention, None]:
        """Every live retention of `parent`, following next_page_token; `timeout` applies to each page."""
        token = ""
        while True:
            page = await self.list_retentions(
                parent, node=node, page_size=page_size, page_token=token, timeout=timeout
            )
            for retention in page.retentions:
                yield retention
            token = page.next_page_token
            if not token:
                return

    async def watch_retentions(
        self, *, parent: str = "", node: str = "", resume_token: str = "", timeout: float | None = None
    ) -> AsyncGenerator[pb.WatchRetentionsResponse, None]:
        """Retention changes of tenant `parent` ("tenants/{t}") or of `node`, until the caller stops.

        Exactly one of parent and node. No deadline unless `timeout` is given; never retried
        (a broken stream raises KvshuttleRpcError: watch again with the last change's
        `resume_token` to get what followed it; FAILED_PRECONDITION WATCH_RESUME_EXPIRED means
        the registry no longer holds that: re-list, then watch without a token). Close it with
        `contextlib.aclosing` or by closing the client, which cancels the stream.
        """
        request = pb.WatchRetentionsRequest(parent=parent, node=node, resume_token=resume_token)
        async for change in self._server_stream(
            "WatchRetentions", request, pb.WatchRetentionsResponse, timeout
        ):
            yield change

    # Block index

    async def report_block_events(
        self,
        node: str,
        incarnation: int,
        batches: Iterable[pb.BlockEventBatch],
        *,
        timeout: float | None = None,
    ) -> pb.ReportBlockEventsResponse:
        """Apply `node`'s KV-cache event batches, in sequence order (already-seen ones are skipped)."""
        request = pb.ReportBlockEventsRequest(node=node, incarnation=incarnation, batches=batches)
        return await self._unary("ReportBlockEvents", request, pb.ReportBlockEventsResponse, timeout)

    async def lookup_blocks(
        self,
        block_hashes: Iterable[int],
        *,
        model: str = "",
        role: pb.NodeRole.ValueType = pb.NODE_ROLE_UNSPECIFIED,
        timeout: float | None = None,
    ) -> pb.LookupBlocksResponse:
        """Per live node, how many leading blocks of the prefix-hash chain it holds (most first)."""
        request = pb.LookupBlocksRequest(block_hashes=block_hashes, model=model, role=role)
        return await self._unary("LookupBlocks", request, pb.LookupBlocksResponse, timeout)
