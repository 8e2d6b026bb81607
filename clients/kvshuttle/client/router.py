"""Typed async client of kvshuttle.router.v1.RouterService."""

from __future__ import annotations

from collections.abc import Iterable

from kvshuttle.client._base import ServiceClient, new_request_id
from kvshuttle.client.retry import ROUTER_SERVICE
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.v1 import kv_transfer_params_pb2 as vllm_pb

__all__ = ["RouterClient"]


class RouterClient(ServiceClient):
    """Plans and commits the turns of conversations.

    Same conventions as RegistryClient: each method returns the RPC's response message, a
    `request_id` of None becomes a uuid4 (so PlanTurn and CommitTurn are retried safely on
    UNAVAILABLE), failures raise KvshuttleRpcError.

        async with RouterClient.connect("127.0.0.1:50052") as router:
            plan = await router.plan_turn(model, token_ids, conversation="tenants/a/conversations/c")
    """

    SERVICE = ROUTER_SERVICE

    async def plan_turn(
        self,
        model: str,
        prompt_token_ids: Iterable[int],
        *,
        conversation: str = "",
        hints: pb.PlanHints | None = None,
        request_id: str | None = None,
        cache_salt_sha256: bytes = b"",
        timeout: float | None = None,
        tenant: str = "",
    ) -> pb.PlanTurnResponse:
        """Plan one turn: reuse or recompute, P and D placement, the params to send to P.

        `conversation` is "tenants/{t}/conversations/{c}"; without one, `tenant`
        ("tenants/{t}") lets the router find the conversation the prompt continues (or start
        one: the response's `conversation`); neither is a plain P->D request.
        `cache_salt_sha256`: SHA-256 of the `cache_salt` both engines get (b"": none).
        """
        request = pb.PlanTurnRequest(
            request_id=new_request_id(request_id),
            conversation=conversation,
            model=model,
            prompt_token_ids=prompt_token_ids,
            hints=hints,
            cache_salt_sha256=cache_salt_sha256,
            tenant=tenant,
        )
        return await self._unary("PlanTurn", request, pb.PlanTurnResponse, timeout)

    async def commit_turn(
        self,
        turn: str,
        *,
        token_ids: Iterable[int] = (),
        decode_kv_transfer_params: vllm_pb.KvTransferParams | None = None,
        timings: pb.TurnTimings | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        output_token_ids: Iterable[int] | None = None,
        turn_end: pb.TurnEnd.ValueType = pb.TURN_END_UNSPECIFIED,
        transcript: pb.TranscriptSpec | None = None,
    ) -> pb.CommitTurnResponse:
        """Finish `turn` ("turns/{turn}"): store decode's retained KV (prompt + output `token_ids`).
        With `output_token_ids` instead, the output alone: the replica that planned the turn
        holds its prompt; another refuses it (FAILED_PRECONDITION, PROMPT_NOT_HELD). `turn_end`:
        how the answer ended (a tool call, a stop, a cut), which sets how long its KV stays on
        decode."""
        output = None if output_token_ids is None else pb.OutputTokenIds(token_ids=output_token_ids)
        request = pb.CommitTurnRequest(
            request_id=new_request_id(request_id),
            turn=turn,
            decode_kv_transfer_params=decode_kv_transfer_params,
            token_ids=token_ids,
            timings=timings,
            output_token_ids=output,
            turn_end=turn_end,
            transcript=transcript,
        )
        return await self._unary("CommitTurn", request, pb.CommitTurnResponse, timeout)

    async def find_transcript(
        self, tenant: str, model: str, lookup_key: bytes, *, timeout: float | None = None
    ) -> pb.FindTranscriptResponse:
        """The exact token ids a commit's transcript kept under `lookup_key`, in `tenant`
        ("tenants/{t}"), and their conversation; NOT_FOUND when none."""
        request = pb.FindTranscriptRequest(tenant=tenant, model=model, lookup_key=lookup_key)
        return await self._unary("FindTranscript", request, pb.FindTranscriptResponse, timeout)

    async def abort_turn(
        self, turn: str, *, reason: str = "", timeout: float | None = None
    ) -> pb.AbortTurnResponse:
        """Release what a planned `turn` holds. Never retried (it carries no request_id)."""
        request = pb.AbortTurnRequest(turn=turn, reason=reason)
        return await self._unary("AbortTurn", request, pb.AbortTurnResponse, timeout)

    async def list_ready_decodes(
        self, model: str, *, timeout: float | None = None
    ) -> pb.ListReadyDecodesResponse:
        """The decode engines a plan of `model` could place decode on now (registered, live,
        healthy), least loaded first; an empty list when there is none."""
        request = pb.ListReadyDecodesRequest(model=model)
        return await self._unary("ListReadyDecodes", request, pb.ListReadyDecodesResponse, timeout)
