"""Protobuf <-> router domain. Pure translation, plus the checks only the wire format needs
(a negative Duration, presence, the size of decode's params); every other bound is the
domain's.

Presence: Durations are messages, so an unset one is "not measured" (None) and a zero one is
zero. TurnTimings.transfer_bytes and remote_cached_tokens are proto3 `optional` for the same
reason: zero remote_cached_tokens on a reuse turn says prefill read nothing (the router then
learns from the turn as a recompute), which an implicit-presence zero could not tell apart
from "not reported".
"""

from __future__ import annotations

from typing import Any

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.router.model import Decision, Estimate, NodeInfo, Plan, Reason, TurnTimings
from kvshuttle.router.router import CommitRequest, PlanRequest
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.kv_transfer_params import from_vllm, to_vllm
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

__all__ = [
    "DECISION_TO_PB",
    "MAX_DECODE_PARAMS_BYTES",
    "REASON_TO_PB",
    "commit_request_from_pb",
    "plan_request_from_pb",
    "plan_to_pb",
]

# Decode's params become the retention's params; the registry refuses more than this
# (RegistryLimits.max_kv_transfer_params_bytes, 64 KiB by default: ~16k block ids), so the
# router refuses it first, naming the field, instead of failing the registry call.
MAX_DECODE_PARAMS_BYTES = 64 * 1024

DECISION_TO_PB: dict[Decision, pb.Decision.ValueType] = {
    Decision.REUSE: pb.DECISION_REUSE,
    Decision.RECOMPUTE: pb.DECISION_RECOMPUTE,
}
# One to one by name: Reason.CLAIM_LOST <-> DECISION_REASON_CLAIM_LOST (a test checks both ways).
REASON_TO_PB: dict[Reason, pb.DecisionReason.ValueType] = {
    reason: pb.DecisionReason.Value(f"DECISION_REASON_{reason.name}") for reason in Reason
}


def duration_seconds(d: Duration) -> float:
    return float(d.ToNanoseconds()) / 1e9


def _optional_duration_s(parent: Any, name: str, field: str) -> float | None:
    """Seconds of a Duration field of `parent`; None when unset; negative is INVALID_ARGUMENT."""
    if not parent.HasField(name):
        return None
    seconds = duration_seconds(getattr(parent, name))
    if seconds < 0:
        raise InvalidArgument(field, "must not be negative")
    return seconds


def to_pb_duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def to_pb_timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(round(seconds * 1e9))
    return ts


# ---- PlanTurn -----------------------------------------------------------------------------


def plan_request_from_pb(request: pb.PlanTurnRequest) -> PlanRequest:
    hints = request.hints
    return PlanRequest(
        model=request.model,
        # The repeated field itself: numpy reads it as a buffer, no per-token Python loop.
        prompt_token_ids=request.prompt_token_ids,
        conversation=request.conversation,
        request_id=request.request_id,
        parent_conversation=hints.parent_conversation,
        expected_think_time_s=_optional_duration_s(hints, "expected_think_time", "hints.expected_think_time"),
        disable_reuse=hints.disable_reuse,
    )


def _placement(node: NodeInfo) -> pb.Placement:
    return pb.Placement(node=node.name, http_endpoint=node.http_endpoint, engine_id=node.engine_id)


def _estimate(estimate: Estimate) -> pb.CostEstimate:
    return pb.CostEstimate(
        transfer=to_pb_duration(estimate.transfer_ms / 1e3),
        prefill=to_pb_duration(estimate.prefill_ms / 1e3),
        total=to_pb_duration(estimate.total_ms / 1e3),
    )


def _params_to_pb(params: dict[str, Any]) -> KvTransferParams:
    try:
        return from_vllm(params, "prefill_kv_transfer_params")
    except InvalidArgument as exc:
        # The router built these (from the registry's own copy): not the caller's mistake.
        raise RuntimeError(f"planned params do not convert: {exc.message}") from exc


def plan_to_pb(plan: Plan) -> pb.PlanTurnResponse:
    response = pb.PlanTurnResponse(
        turn=plan.turn,
        generation=plan.generation,
        prefill=_placement(plan.prefill),
        decode=_placement(plan.decode),
        prefill_kv_transfer_params=_params_to_pb(plan.prefill_kv_transfer_params),
        decision=DECISION_TO_PB[plan.decision],
        reason=REASON_TO_PB[plan.reason],
        reusable_tokens=plan.reusable_tokens,
        tokens_to_compute=plan.tokens_to_compute,
        recompute_cost=_estimate(plan.recompute_cost),
        expire_time=to_pb_timestamp(plan.expire_at),
    )
    if plan.reuse_cost is not None:
        response.reuse_cost.CopyFrom(_estimate(plan.reuse_cost))
    return response


# ---- CommitTurn ---------------------------------------------------------------------------


def _timings(request: pb.CommitTurnRequest) -> TurnTimings:
    if not request.HasField("timings"):
        return TurnTimings()
    t = request.timings

    def ms(name: str) -> float | None:
        seconds = _optional_duration_s(t, name, f"timings.{name}")
        return None if seconds is None else seconds * 1e3

    return TurnTimings(
        ttft_ms=ms("ttft"),
        prefill_ms=ms("prefill"),
        transfer_ms=ms("transfer"),
        transfer_bytes=t.transfer_bytes if t.HasField("transfer_bytes") else None,
        decode_ms=ms("decode"),
        remote_cached_tokens=t.remote_cached_tokens if t.HasField("remote_cached_tokens") else None,
    )


def _decode_params(request: pb.CommitTurnRequest) -> dict[str, Any] | None:
    if not request.HasField("decode_kv_transfer_params"):
        return None
    params = request.decode_kv_transfer_params
    if params.ByteSize() > MAX_DECODE_PARAMS_BYTES:
        raise InvalidArgument("decode_kv_transfer_params", f"larger than {MAX_DECODE_PARAMS_BYTES} bytes")
    return to_vllm(params)


def commit_request_from_pb(request: pb.CommitTurnRequest) -> CommitRequest:
    return CommitRequest(
        turn=request.turn,
        token_ids=request.token_ids,
        decode_kv_transfer_params=_decode_params(request),
        timings=_timings(request),
        request_id=request.request_id,
    )
