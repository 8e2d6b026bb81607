"""Protobuf <-> router domain. Pure translation, plus the checks only the wire format needs
(a negative Duration or one outside protobuf's range, presence, the size of decode's params and
of their pass-through `extra`); every other bound is the domain's.

Presence: Durations are messages, so an unset one is "not measured" (None) and a zero one is
zero. TurnTimings.transfer_bytes and remote_cached_tokens are proto3 `optional` for the same
reason: zero remote_cached_tokens on a reuse turn says prefill read nothing (the router then
learns from the turn as a recompute), which an implicit-presence zero could not tell apart
from "not reported".
"""

from __future__ import annotations

from typing import Any

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.limits import MAX_KV_TRANSFER_PARAMS_BYTES
from kvshuttle.core.prototime import duration_seconds, to_duration, to_timestamp
from kvshuttle.router.model import (
    CommitRequest,
    Decision,
    Estimate,
    FoundTranscript,
    NodeInfo,
    Plan,
    PlanRequest,
    Reason,
    TranscriptSpec,
    TurnEnd,
    TurnTimings,
)
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.kv_transfer_params import check_extra, from_vllm, to_vllm
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

__all__ = [
    "DECISION_TO_PB",
    "REASON_TO_PB",
    "commit_request_from_pb",
    "placement_to_pb",
    "plan_request_from_pb",
    "plan_to_pb",
    "transcript_to_pb",
]

DECISION_TO_PB: dict[Decision, pb.Decision.ValueType] = {
    Decision.REUSE: pb.DECISION_REUSE,
    Decision.RECOMPUTE: pb.DECISION_RECOMPUTE,
    Decision.EXTEND: pb.DECISION_EXTEND,
}
# One to one by name: Reason.CLAIM_LOST <-> DECISION_REASON_CLAIM_LOST (a test checks both ways).
REASON_TO_PB: dict[Reason, pb.DecisionReason.ValueType] = {
    reason: pb.DecisionReason.Value(f"DECISION_REASON_{reason.name}") for reason in Reason
}


def _optional_duration_s(parent: Any, name: str, field: str) -> float | None:
    """Seconds of a Duration field of `parent`; None when unset, 0.0 when set to zero (the
    presence rule above); negative is INVALID_ARGUMENT."""
    if not parent.HasField(name):
        return None
    return duration_seconds(getattr(parent, name), field) or 0.0


# ---- PlanTurn -----------------------------------------------------------------------------


def plan_request_from_pb(request: pb.PlanTurnRequest, *, deadline_s: float | None = None) -> PlanRequest:
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
        cache_salt_sha256=request.cache_salt_sha256,
        deadline_s=deadline_s,
        decode_endpoints=tuple(hints.decode_endpoints),
        tenant=request.tenant,
    )


def placement_to_pb(node: NodeInfo) -> pb.Placement:
    return pb.Placement(node=node.name, http_endpoint=node.http_endpoint, engine_id=node.engine_id)


def _estimate(estimate: Estimate) -> pb.CostEstimate:
    return pb.CostEstimate(
        transfer=to_duration(estimate.transfer_ms / 1e3),
        prefill=to_duration(estimate.prefill_ms / 1e3),
        total=to_duration(estimate.total_ms / 1e3),
        interference=to_duration(estimate.interference_ms / 1e3),
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
        prefill=placement_to_pb(plan.prefill),
        decode=placement_to_pb(plan.decode),
        prefill_kv_transfer_params=_params_to_pb(plan.prefill_kv_transfer_params),
        decision=DECISION_TO_PB[plan.decision],
        reason=REASON_TO_PB[plan.reason],
        reusable_tokens=plan.reusable_tokens,
        tokens_to_compute=plan.tokens_to_compute,
        recompute_cost=_estimate(plan.recompute_cost),
        expire_time=to_timestamp(plan.expire_at),
        conversation=plan.conversation,
    )
    if plan.reuse_cost is not None:
        response.reuse_cost.CopyFrom(_estimate(plan.reuse_cost))
    if plan.extend_cost is not None:
        response.extend_cost.CopyFrom(_estimate(plan.extend_cost))
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
    # They become the retention's params: refused here, naming the field, rather than by the
    # registry's call (which holds them to the same bound).
    if params.ByteSize() > MAX_KV_TRANSFER_PARAMS_BYTES:
        raise InvalidArgument(
            "decode_kv_transfer_params", f"larger than {MAX_KV_TRANSFER_PARAMS_BYTES} bytes"
        )
    # vLLM's fields kvshuttle does not know pass through from decode's own answer, bounded.
    check_extra(params, "decode_kv_transfer_params")
    return to_vllm(params)


def commit_request_from_pb(request: pb.CommitTurnRequest) -> CommitRequest:
    return CommitRequest(
        turn=request.turn,
        token_ids=request.token_ids,
        decode_kv_transfer_params=_decode_params(request),
        timings=_timings(request),
        request_id=request.request_id,
        output_token_ids=request.output_token_ids.token_ids if request.HasField("output_token_ids") else None,
        turn_end=_turn_end(request.turn_end),
        transcript=_transcript(request),
    )


def _transcript(request: pb.CommitTurnRequest) -> TranscriptSpec | None:
    if not request.HasField("transcript"):
        return None
    t = request.transcript
    return TranscriptSpec(t.lookup_key, t.num_tokens, t.answer_sha256, t.answer_chars)


def transcript_to_pb(found: FoundTranscript) -> pb.FindTranscriptResponse:
    t = found.transcript
    return pb.FindTranscriptResponse(
        conversation=found.conversation,
        # A uint32 array's buffer: protobuf reads it without a per-token Python loop.
        token_ids=t.token_ids,
        answer_sha256=t.answer_sha256,
        answer_chars=t.answer_chars,
    )


TURN_END_FROM_PB: dict[int, TurnEnd] = {
    pb.TURN_END_UNSPECIFIED: TurnEnd.UNSPECIFIED,
    pb.TURN_END_TOOL_CALL: TurnEnd.TOOL_CALL,
    pb.TURN_END_STOP: TurnEnd.STOP,
    pb.TURN_END_LENGTH: TurnEnd.LENGTH,
}


def _turn_end(value: int) -> TurnEnd:
    """A value this router does not know is refused, not read as unspecified: a caller that
    sends it expects it to mean something."""
    end = TURN_END_FROM_PB.get(value)
    if end is None:
        raise InvalidArgument("turn_end", f"unknown value {value}")
    return end
