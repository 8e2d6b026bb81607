"""RouterPort over the router's gRPC client: the calls pass through as they are, and a failed
call (KvshuttleRpcError) becomes a RouterFailure with the status's code name, the server's
reason, message and field, which is all the turn and the client's error response use."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

from opentelemetry.sdk.trace import TracerProvider

from kvshuttle.client import KvshuttleRpcError, RouterClient
from kvshuttle.client.settings import ServiceConnection
from kvshuttle.core.prototime import to_duration
from kvshuttle.gateway.errors import RouterFailure
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

__all__ = ["GrpcRouterPort"]


@asynccontextmanager
async def _failures() -> AsyncIterator[None]:
    try:
        yield
    except KvshuttleRpcError as err:
        raise RouterFailure(err.code_name, err.message, reason=err.reason, field=err.field) from err


class GrpcRouterPort:
    """`connect()` opens the channel (on the serving loop), `close()` ends it."""

    def __init__(self, connection: ServiceConnection, *, tracer_provider: TracerProvider) -> None:
        self._connection = connection
        self._provider = tracer_provider
        self._client: RouterClient | None = None

    def connect(self) -> None:
        self._client = RouterClient.connect(
            self._connection.channel_options(), tracer_provider=self._provider
        )

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    @property
    def client(self) -> RouterClient:
        if self._client is None:
            raise RuntimeError("the gateway app has not started")
        return self._client

    async def plan_turn(
        self,
        model: str,
        prompt_token_ids: Iterable[int],
        *,
        conversation: str,
        request_id: str,
        cache_salt_sha256: bytes,
        expected_think_time_s: float | None = None,
    ) -> pb.PlanTurnResponse:
        hints = None
        if expected_think_time_s is not None:
            hints = pb.PlanHints(expected_think_time=to_duration(expected_think_time_s))
        async with _failures():
            return await self.client.plan_turn(
                model,
                prompt_token_ids,
                conversation=conversation,
                hints=hints,
                request_id=request_id,
                cache_salt_sha256=cache_salt_sha256,
            )

    async def commit_turn(
        self,
        turn: str,
        *,
        token_ids: Iterable[int],
        decode_kv_transfer_params: KvTransferParams | None,
        timings: pb.TurnTimings,
    ) -> pb.CommitTurnResponse:
        async with _failures():
            return await self.client.commit_turn(
                turn,
                token_ids=token_ids,
                decode_kv_transfer_params=decode_kv_transfer_params,
                timings=timings,
            )

    async def abort_turn(self, turn: str, *, reason: str) -> None:
        async with _failures():
            await self.client.abort_turn(turn, reason=reason)
