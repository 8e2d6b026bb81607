"""What the turn runner needs from the router and from the engines. kvshuttle.gateway.turns.router_port
implements RouterPort over the router's gRPC client and kvshuttle.gateway.turns.engines implements
EnginePort over aiohttp; unit tests implement both in memory, no sockets.

Failures: a router call raises RouterFailure (kvshuttle.gateway.errors); an engine call raises
GatewayError, already what the client sees (engine_error, engine_timeout).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

__all__ = ["EnginePort", "RouterPort", "TranscriptPort"]


class RouterPort(Protocol):
    async def plan_turn(
        self,
        model: str,
        prompt_token_ids: Iterable[int],
        *,
        conversation: str,
        request_id: str,
        cache_salt_sha256: bytes,
        expected_think_time_s: float | None = None,
        decode_endpoints: Sequence[str] = (),
        tenant: str = "",
    ) -> pb.PlanTurnResponse:
        """PlanTurn; `request_id` is its idempotency key, `cache_salt_sha256` the SHA-256 of the
        cache salt the engines get (b"": none), `expected_think_time_s` the hint of how long
        until the conversation's next turn (None: none), `decode_endpoints` the decode engines
        the plan may place on (hints.decode_endpoints: `host:port`s or bare hosts; empty: any),
        `tenant` ("tenants/{t}") for a turn of no conversation that the router is to find one
        for (the plan's `conversation`)."""
        ...

    async def commit_turn(
        self,
        turn: str,
        *,
        conversation: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        decode_kv_transfer_params: KvTransferParams | None,
        timings: pb.TurnTimings,
        turn_end: pb.TurnEnd.ValueType = pb.TURN_END_UNSPECIFIED,
        transcript: pb.TranscriptSpec | None = None,
    ) -> pb.CommitTurnResponse:
        """CommitTurn of the turn `turn` (its handle) of `conversation` ("": none), which
        routes it to the router replica that planned it; the sequence is the prompt plus the
        output (which the router may be sent alone: the replica that planned holds the prompt);
        `turn_end`: how the answer ended; `transcript`: which ids to keep as the transcript."""
        ...

    async def abort_turn(self, turn: str, *, conversation: str, reason: str) -> None: ...


class TranscriptPort(Protocol):
    async def find_transcript(
        self, tenant: str, model: str, lookup_key: bytes, *, conversation: str = ""
    ) -> pb.FindTranscriptResponse | None:
        """FindTranscript (`tenant`: "tenants/{t}"; `conversation`: the request's, "" for none,
        which router replica to ask first); None when there is none or the router cannot say (a
        request is then tokenized as usual)."""
        ...


class EnginePort(Protocol):
    """`/v1/completions` of the engine at `endpoint` (its base URL); `role` ("prefill" or
    "decode") names it in errors."""

    async def complete(
        self, role: str, endpoint: str, body: bytes, headers: Mapping[str, str], *, timeout_s: float
    ) -> dict[str, Any]:
        """One non-streaming completion; its JSON body."""
        ...

    def stream(
        self, role: str, endpoint: str, body: bytes, headers: Mapping[str, str]
    ) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        """A streaming completion: entered once the engine answered 200, it yields the chunks'
        JSON in order; leaving it early closes the request (the engine aborts it)."""
        ...
