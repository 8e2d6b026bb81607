"""A turn as the runner records it (kvshuttle.gateway.turns.runner), decode's answer as it reads it
(DecodeOutput), and what is made from the record: the engines' request bodies and CommitTurn's
timings."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvshuttle.core.prototime import to_duration
from kvshuttle.router.v1 import router_service_pb2 as pb

__all__ = ["DecodeOutput", "Turn", "decode_body", "prompt_json", "request_body", "timings", "turn_end"]

# The chat answer's finish_reason -> how CommitTurn says the turn ended.
_TURN_ENDS: dict[str | None, pb.TurnEnd.ValueType] = {
    "tool_calls": pb.TURN_END_TOOL_CALL,
    "stop": pb.TURN_END_STOP,
    "length": pb.TURN_END_LENGTH,
}


@dataclass(slots=True)
class DecodeOutput:
    """What the gateway takes from decode's answer (one body, or the chunks of a stream)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # False when a chunk carried output without token_ids (an engine without return_token_ids).
    ids_complete: bool = True
    finish_reason: str | None = None
    stop_reason: Any = None
    usage: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    chunks: int = 0

    def take_chunk(self, chunk: Mapping[str, Any]) -> None:
        """Read one stream chunk (or the whole non-streaming answer) before it is translated for
        the client, which drops `kv_transfer_params`."""
        self.chunks += 1
        params = chunk.get("kv_transfer_params")
        if isinstance(params, dict):
            self.kv_transfer_params = params
        choices = chunk.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            self.take_choice(choices[0])
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage

    def take_choice(self, choice: Mapping[str, Any]) -> None:
        text = choice.get("text")
        if isinstance(text, str):
            self.text += text
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.token_ids.extend(ids)
        elif text:
            self.ids_complete = False
        if choice.get("finish_reason") is not None:
            self.finish_reason = str(choice["finish_reason"])
            self.stop_reason = choice.get("stop_reason")


@dataclass(slots=True)
class Turn:
    """One turn: what the runner is given, and what it planned, measured and got. Times are
    seconds of time.perf_counter(); None where the turn did not get that far."""

    request_id: str
    # The served model name: the router's profile and the engines' `model`.
    model: str
    # `tenants/{tenant}/conversations/{id}`, or "" for a turn of no conversation (the plan's,
    # once planned, when `tenant` lets the router find or start one).
    conversation: str
    prompt_ids: list[int]
    prefill_params: dict[str, Any]
    decode_params: dict[str, Any]
    # When the request arrived: TTFT counts from here.
    arrived: float
    # vLLM's `cache_salt` for both engines (the tenant's); "" for none. The router gets its SHA-256.
    cache_salt: str = ""
    # The client sent text stop strings: decode retains nothing (said in the commit's log).
    stop_strings: bool = False
    # Seconds expected before the conversation's next turn (PlanTurn's hint); None: unknown.
    expected_think_time_s: float | None = None
    # How the answer ended, as a finish_reason: "tool_calls" for an answer that parses as a tool
    # call (even one a named tool_choice reports as "stop"); None: decode's own. CommitTurn's
    # turn_end is read from it.
    finish_reason: Callable[[DecodeOutput], str | None] | None = None
    # `tenants/{tenant}` of a turn of no conversation, for the router to find the conversation
    # its prompt continues (or start one); "": plain P->D, nothing retained.
    tenant: str = ""
    # The transcript CommitTurn keeps of the finished turn (None from it: none).
    transcript: Callable[[DecodeOutput], pb.TranscriptSpec | None] | None = None
    # The plan's, once planned.
    decision: str = ""
    reason: str = ""
    generation: int = 0
    reused_tokens: int = 0
    remote_cached_tokens: int | None = None
    # A reuse turn whose prefill did not answer in time ("reuse_prefill_timeout") or failed
    # ("reuse_prefill_failed") and was run again as a plain recompute; "" otherwise. decision
    # and reason stay the router's; reused_tokens is then 0.
    fallback: str = ""
    output: DecodeOutput = field(default_factory=DecodeOutput)
    # Of a finished decode (the committed sequence's output).
    output_tokens: int = 0
    # Waiting for the conversation's previous commit (in flight when this turn arrived).
    wait_s: float | None = None
    plan_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    # Decode's time to its first chunk (streaming) or to its whole answer.
    decode_ttfb_s: float | None = None
    # To the first output written to the client (streaming) or to decode's whole answer.
    ttft_s: float | None = None
    # What failed, when a router or engine call ended the turn: "router_error",
    # "engine_error" or "error" (an engine's 429).
    outcome: str = ""
    # Committed, aborted, or handed to a commit in flight: nothing left to abort.
    settled: bool = False


def turn_end(turn: Turn) -> pb.TurnEnd.ValueType:
    """How the turn's answer ended, for CommitTurn (unspecified when it did not finish)."""
    out = turn.output
    finish = turn.finish_reason(out) if turn.finish_reason is not None else out.finish_reason
    return _TURN_ENDS.get(finish, pb.TURN_END_UNSPECIFIED)


def request_body(prompt_json: bytes, fields: Mapping[str, Any]) -> bytes:
    """`{"prompt": [...], **fields}` with the prompt's JSON made once for both engines."""
    rest = json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()
    return b'{"prompt":' + prompt_json + (b"," + rest[1:] if len(rest) > 2 else b"}")


def prompt_json(ids: list[int]) -> bytes:
    # orjson: the same bytes for a list of ints, ~20x faster than the stdlib (0.75 ms at 8k ids).
    return orjson.dumps(ids)


def decode_body(
    turn: Turn, prompt_json: bytes, prefill_params: dict[str, Any] | None, *, stream: bool
) -> bytes:
    fields: dict[str, Any] = {"model": turn.model, **turn.decode_params, "return_token_ids": True}
    if turn.cache_salt:
        fields["cache_salt"] = turn.cache_salt  # the same as prefill's: D's cache is salted alike
    if prefill_params is not None:
        fields["kv_transfer_params"] = prefill_params
    if stream:
        fields.update(stream=True, stream_options={"include_usage": True})
    else:
        fields["stream"] = False
    return request_body(prompt_json, fields)


def timings(turn: Turn) -> pb.TurnTimings:
    """What CommitTurn reports of the turn, from the runner's own measurements."""
    timings = pb.TurnTimings()
    if turn.ttft_s is not None:
        timings.ttft.CopyFrom(to_duration(turn.ttft_s))
    if turn.prefill_s is not None:
        timings.prefill.CopyFrom(to_duration(turn.prefill_s))
    if turn.decode_s is not None:
        timings.decode.CopyFrom(to_duration(turn.decode_s))
    if turn.remote_cached_tokens is not None:
        timings.remote_cached_tokens = turn.remote_cached_tokens
    return timings
