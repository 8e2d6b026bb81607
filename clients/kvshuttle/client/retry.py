"""Which calls may be sent twice, and the loop that does it.

A call is retried only when it failed with UNAVAILABLE (the server did not take it, or went
away) and only when sending it again cannot act twice. That is decided per RPC in
`RETRY_POLICY`, by reading each RPC's contract in the protos, never guessed from its name:

* `Retry.ALWAYS`: reads, and writes that set state absolutely (a heartbeat or a renewal sets
  the lease to now + ttl; a block-event report is deduplicated by engine sequence number; an
  eviction's resend answers NOT_FOUND, which its contract says means "gone").
* `Retry.WITH_REQUEST_ID`: the RPC is deduplicated by the server on `request_id`; retried only
  when the request carries a non-empty one (the typed clients fill in a uuid4 by default).
* `Retry.NEVER`: everything else. A lost response is indistinguishable from a lost request, and
  a second send would act again (a new incarnation, a release that then reports NOT_FOUND).

Every other status fails at once. Backoff is exponential with full jitter; the call's deadline
covers all attempts, so a retry never outlives the caller's budget.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from enum import Enum
from typing import Any, Protocol, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message
from opentelemetry import trace

from kvshuttle.client.channel import ChannelOptions
from kvshuttle.client.errors import KvshuttleRpcError
from kvshuttle.client.tracing import Metadata, record_status, traced_attempt

__all__ = ["RETRY_POLICY", "Retry", "backoff_delay", "call_unary", "retry_policy", "should_retry"]

RespT = TypeVar("RespT", bound=Message)
RespT_co = TypeVar("RespT_co", bound=Message, covariant=True)


class Retry(Enum):
    """Whether an RPC may be sent again after UNAVAILABLE."""

    NEVER = "never"
    ALWAYS = "always"
    WITH_REQUEST_ID = "with_request_id"


REGISTRY_SERVICE = "kvshuttle.registry.v1.RegistryService"
ROUTER_SERVICE = "kvshuttle.router.v1.RouterService"
AGENT_SERVICE = "kvshuttle.agent.v1.AgentService"

# Service full name -> RPC name -> Retry. A test checks that every RPC of every service has an
# entry, so an RPC added to a proto must be classified here before its client method can exist.
RETRY_POLICY: Mapping[str, Mapping[str, Retry]] = {
    REGISTRY_SERVICE: {
        # Each call starts a new incarnation: a blind resend would bump it again, and a
        # heartbeat carrying the first answer's incarnation would then be rejected.
        "RegisterNode": Retry.NEVER,
        # Sets the lease to now + ttl: repeating it changes nothing more.
        "HeartbeatNode": Retry.ALWAYS,
        # A resend after a lost success answers NOT_FOUND for a node that was removed.
        "DeregisterNode": Retry.NEVER,
        "GetNode": Retry.ALWAYS,
        "ListNodes": Retry.ALWAYS,
        # Deduplicated by request_id (a repeated request returns the first response).
        "PutRetention": Retry.WITH_REQUEST_ID,
        "GetRetention": Retry.ALWAYS,
        "GetConversation": Retry.ALWAYS,
        # The retention's heartbeat: sets its lease to now + ttl (capped by the pin).
        "RenewRetention": Retry.ALWAYS,
        # Deduplicated by request_id; without one a resend could see its own claim as
        # RETENTION_ALREADY_CLAIMED.
        "ClaimRetention": Retry.WITH_REQUEST_ID,
        # Consumes the retention: a resend after a lost success answers NOT_FOUND.
        "ReleaseRetention": Retry.NEVER,
        # Deduplicated by request_id (a repeated request returns the first response while the
        # retention lives); without one a resend would see the claim it ended: CLAIM_MISMATCH.
        "MoveRetention": Retry.WITH_REQUEST_ID,
        # Idempotent in effect: a resend after a lost success answers NOT_FOUND, which callers
        # read as "gone" (EvictRetention's contract), the outcome they asked for.
        "EvictRetention": Retry.ALWAYS,
        "ListRetentions": Retry.ALWAYS,
        "FindRetention": Retry.ALWAYS,
        # Server streaming: never resent; a broken watch ends with the error (events between
        # two watches would be lost silently otherwise).
        "WatchRetentions": Retry.NEVER,
        # Deduplicated by engine sequence number (already-seen batches are skipped).
        "ReportBlockEvents": Retry.ALWAYS,
        "LookupBlocks": Retry.ALWAYS,
    },
    ROUTER_SERVICE: {
        "PlanTurn": Retry.WITH_REQUEST_ID,
        "CommitTurn": Retry.WITH_REQUEST_ID,
        # No request_id; a resend after a lost success answers FAILED_PRECONDITION.
        "AbortTurn": Retry.NEVER,
        "ListReadyDecodes": Retry.ALWAYS,
        "FindTranscript": Retry.ALWAYS,
    },
    AGENT_SERVICE: {
        "GetStatus": Retry.ALWAYS,
        "PullBlocks": Retry.WITH_REQUEST_ID,
        "ParkRetention": Retry.WITH_REQUEST_ID,
        "Prefetch": Retry.WITH_REQUEST_ID,
    },
}


def retry_policy(service: str, method: str) -> Retry:
    """The table's entry; KeyError for an RPC nobody classified (a programming error)."""
    return RETRY_POLICY[service][method]


def should_retry(policy: Retry, request: Message, code: grpc.StatusCode) -> bool:
    """Whether a call that failed with `code` may be sent again under `policy`."""
    if code != grpc.StatusCode.UNAVAILABLE:
        return False
    if policy is Retry.ALWAYS:
        return True
    if policy is Retry.WITH_REQUEST_ID:
        return bool(getattr(request, "request_id", ""))
    return False


def backoff_delay(retry: int, options: ChannelOptions, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number `retry` (1 for the first): full jitter under a cap."""
    cap = min(options.max_backoff, options.initial_backoff * options.backoff_multiplier ** (retry - 1))
    return (rng or random).uniform(0.0, cap)


class UnaryCallable(Protocol[RespT_co]):
    """What a grpc.aio UnaryUnaryMultiCallable looks like to `call_unary`."""

    def __call__(
        self, request: Any, *, timeout: float | None = None, metadata: Metadata = ()
    ) -> Awaitable[RespT_co]: ...


async def call_unary(
    multicallable: UnaryCallable[RespT],
    request: Message,
    *,
    method: str,
    policy: Retry,
    options: ChannelOptions,
    timeout: float | None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    tracer: trace.Tracer | None = None,
) -> RespT:
    """Send `request`, retrying per `policy`, within one deadline of `timeout` seconds.

    Returns the response; raises KvshuttleRpcError for any failure (after the last attempt for
    a retried UNAVAILABLE). `method` is the full RPC path, for the error and the spans (one
    per attempt, when `tracer` is given).
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    attempt = 1
    while True:
        remaining = None if deadline is None else max(deadline - loop.time(), 0.0)
        with traced_attempt(tracer, method) as (span, metadata):
            try:
                response = await multicallable(
                    request, timeout=remaining, metadata=(*options.call_metadata, *metadata)
                )
            except grpc.aio.AioRpcError as exc:
                error = exc
                record_status(span, exc.code(), exc.details())
            else:
                record_status(span, grpc.StatusCode.OK)
                return response
        code = error.code()
        if attempt < options.max_attempts and should_retry(policy, request, code):
            delay = backoff_delay(attempt, options)
            if deadline is None or loop.time() + delay < deadline:
                await sleep(delay)
                attempt += 1
                continue
        raise KvshuttleRpcError.from_rpc_error(error, method=method, attempts=attempt) from error
