"""RouterPort over the router's gRPC client: the calls pass through as they are, and a failed
call (KvshuttleRpcError) becomes a RouterFailure with the status's code name, the server's
reason, message and field, which is all the turn and the client's error response use.

Over several router replicas with conversation affinity (RouterConnection.replicas), there is
one client per replica, and each call of a conversation goes to its replica by rendezvous
(kvshuttle.gateway.affinity): plan, commit and abort alike, so the replica that planned a turn
commits it and holds the next turn's hint. A replica that does not answer (UNAVAILABLE or
DEADLINE_EXCEEDED from the transport, with no ErrorInfo: a status the router itself sends, such
as NO_LIVE_NODE, is its answer) is marked down and the call goes to the next-ranked one, within
the one deadline of `router.timeout`; when none answers, the failure goes to the turn, which
then runs plain P->D (the gateway's degrade path). Every call is safe to send again: PlanTurn
and CommitTurn carry one request id across the replicas tried (the claim a plan makes and the
put a commit makes are idempotent in the registry by ids derived from them), and an abort of a
settled turn is refused as such.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Protocol, TypeVar

import structlog
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import Counter

from kvshuttle.client import KvshuttleRpcError, RouterClient
from kvshuttle.client._base import new_request_id
from kvshuttle.core.prototime import to_duration
from kvshuttle.gateway.affinity import Replicas
from kvshuttle.gateway.config import RouterConnection
from kvshuttle.gateway.errors import RouterFailure
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

__all__ = ["GrpcRouterPort", "RouterMetrics"]

T = TypeVar("T")
Call = Callable[[RouterClient, float], Awaitable[T]]

log = structlog.get_logger("kvshuttle.gateway")

# What a replica that did not answer fails with; the router's own refusals carry a reason.
_NOT_ANSWERED = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})


class RouterMetrics(Protocol):
    """The counters the port keeps per replica, and of commits sent again whole
    (kvshuttle.gateway.metrics.GatewayMetrics has them, and so does the endpoint picker's
    metrics under its own names)."""

    @property
    def router_picks(self) -> Counter: ...

    @property
    def router_failovers(self) -> Counter: ...

    @property
    def commits_resent(self) -> Counter: ...


@asynccontextmanager
async def _failures() -> AsyncIterator[None]:
    try:
        yield
    except KvshuttleRpcError as err:
        raise _failure(err) from err


def _failure(err: KvshuttleRpcError) -> RouterFailure:
    return RouterFailure(err.code_name, err.message, reason=err.reason, field=err.field)


class GrpcRouterPort:
    """`connect()` opens the channels (on the serving loop), `close()` ends them."""

    def __init__(
        self,
        connection: RouterConnection,
        *,
        tracer_provider: TracerProvider,
        metrics: RouterMetrics,
        affinity_key: bytes,
    ) -> None:
        self._connection = connection
        self._provider = tracer_provider
        self._metrics = metrics
        addresses = connection.replicas()
        self.replicas = (
            None
            if addresses is None
            else Replicas(
                addresses,
                key=affinity_key,
                backoff_s=connection.failover_backoff_s,
                max_backoff_s=connection.failover_max_backoff_s,
            )
        )
        self._clients: dict[str, RouterClient] = {}

    def connect(self) -> None:
        if self.replicas is None:
            client = RouterClient.connect(self._connection.channel_options(), tracer_provider=self._provider)
            self._clients = {self._connection.address: client}
            return
        self._clients = {
            address: RouterClient.connect(
                self._connection.replica_options(address), tracer_provider=self._provider
            )
            for address in self.replicas.addresses
        }

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()

    async def _call(self, conversation: str, call: Call[T]) -> T:
        """`call` on the conversation's replica, or the next while one does not answer; each
        gets what is left of one `router.timeout`."""
        if not self._clients:
            raise RuntimeError("the gateway app has not started")
        timeout = self._connection.timeout
        if self.replicas is None:
            (client,) = self._clients.values()
            async with _failures():
                return await call(client, timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        order = self.replicas.order(conversation)
        for i, address in enumerate(order):
            try:
                result = await call(self._clients[address], max(deadline - loop.time(), 0.001))
            except KvshuttleRpcError as err:
                if err.code_name not in _NOT_ANSWERED or err.reason is not None:
                    self.replicas.succeeded(address)  # it answered: a refusal of the call
                    raise _failure(err) from err
                backoff = self.replicas.failed(address)
                self._metrics.router_failovers.labels(address).inc()
                last = i == len(order) - 1 or loop.time() >= deadline
                log.warning(
                    "router.replica_failed",
                    replica=address,
                    code=err.code_name,
                    backoff_s=backoff,
                    affinity=self.replicas.digest(conversation).hex()[:16],
                    next=None if last else order[i + 1],
                )
                if last:
                    raise RouterFailure(err.code_name, err.message) from err
                continue
            self.replicas.succeeded(address)
            self._metrics.router_picks.labels(address).inc()
            return result
        raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover

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
        hints = None
        if expected_think_time_s is not None or decode_endpoints:
            hints = pb.PlanHints(decode_endpoints=decode_endpoints)
            if expected_think_time_s is not None:
                hints.expected_think_time.CopyFrom(to_duration(expected_think_time_s))
        ids = list(prompt_token_ids)  # sent again to the next replica

        async def plan(client: RouterClient, deadline_s: float) -> pb.PlanTurnResponse:
            return await client.plan_turn(
                model,
                ids,
                conversation=conversation,
                hints=hints,
                request_id=request_id,
                cache_salt_sha256=cache_salt_sha256,
                timeout=deadline_s,
                tenant="" if conversation else tenant,
            )

        # A turn of no conversation is spread over the replicas by its request id.
        return await self._call(conversation or request_id, plan)

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
        """The output alone first (the replica that planned holds the prompt: a long prompt is
        not sent twice), the whole sequence when the replica answering does not hold it
        (PROMPT_NOT_HELD: another replica planned, or it restarted). One request id for both:
        the router fingerprints the whole sequence either way."""
        request_id = new_request_id(None)

        def commit(**tokens: Sequence[int]) -> Call[pb.CommitTurnResponse]:
            async def call(client: RouterClient, deadline_s: float) -> pb.CommitTurnResponse:
                return await client.commit_turn(
                    turn,
                    decode_kv_transfer_params=decode_kv_transfer_params,
                    timings=timings,
                    turn_end=turn_end,
                    transcript=transcript,
                    request_id=request_id,
                    timeout=deadline_s,
                    **tokens,
                )

            return call

        try:
            return await self._call(conversation or turn, commit(output_token_ids=output_token_ids))
        except RouterFailure as err:
            if err.reason != "PROMPT_NOT_HELD":
                raise
        self._metrics.commits_resent.inc()
        whole = [*prompt_token_ids, *output_token_ids]
        return await self._call(conversation or turn, commit(token_ids=whole))

    async def abort_turn(self, turn: str, *, conversation: str, reason: str) -> None:
        async def abort(client: RouterClient, deadline_s: float) -> None:
            await client.abort_turn(turn, reason=reason, timeout=deadline_s)

        await self._call(conversation or turn, abort)

    async def find_transcript(
        self, tenant: str, model: str, lookup_key: bytes, *, conversation: str = ""
    ) -> pb.FindTranscriptResponse | None:
        """FindTranscript on the conversation's replica, else the key's (any answers: the
        registry holds transcripts);
        None when there is none, or the router did not answer or refused (the request is then
        tokenized as usual: never a failed turn)."""

        async def find(client: RouterClient, deadline_s: float) -> pb.FindTranscriptResponse:
            return await client.find_transcript(tenant, model, lookup_key, timeout=deadline_s)

        try:
            return await self._call(conversation or f"transcripts/{lookup_key.hex()}", find)
        except RouterFailure as err:
            if err.code != "NOT_FOUND":
                log.warning("router.find_transcript_failed", code=err.code, reason=err.reason)
            return None

    async def list_ready_decodes(self, model: str) -> list[pb.Placement]:
        """ListReadyDecodes: the decode engines a plan of `model` could place on now, least
        loaded first. Every replica reads the same registry: the model's replica by affinity
        answers, the next one when it does not."""

        async def ready(client: RouterClient, deadline_s: float) -> list[pb.Placement]:
            return list((await client.list_ready_decodes(model, timeout=deadline_s)).decodes)

        return await self._call(f"ready-decodes/{model}", ready)
