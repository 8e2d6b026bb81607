"""The session-trace model: a session is one conversation, its requests (turns) in order; each
request says when it is sent, how many tokens go in and come out, and which blocks its prompt is
made of. One session per JSON line (workload/jsonl.py reads and writes them).

Prompt blocks: `hash_ids` holds one id per `block_size` tokens of the prompt, the last block
possibly partial (len(hash_ids) == ceil(input_tokens / block_size)). Ids are prefix-chained: two
prompts share their first k ids exactly when they share their first k blocks of tokens, so an id
names its whole prefix. Within a trace the same id always means the same block.

Timing: a request carries exactly one of
  arrival_offset_ms  ms after its session's start (a recorded trace: Mooncake), or
  think_time_ms      ms after the previous turn's answer completed (a generator: the agent loop).
The first request is sent at the session's start: its offset, or think time, is 0.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class InputKind(enum.StrEnum):
    """What the request appends to the conversation: a user's text or a tool's result."""

    TEXT = "text"
    TOOL_RESULT = "tool_result"


class StopReason(enum.StrEnum):
    """Why the recorded answer ended; the replay asks for exactly `output_tokens` either way."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"


class TraceError(ValueError):
    """A session that breaks the format: `field` names the offending field (dotted, with the
    request's index), `line` the JSONL line (1-based) when read from a file."""

    def __init__(self, field: str, message: str, *, line: int | None = None) -> None:
        self.field, self.message, self.line = field, message, line
        where = f"line {line}: " if line is not None else ""
        super().__init__(f"{where}{field}: {message}")


@dataclass(frozen=True, slots=True)
class Request:
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    input_kind: InputKind = InputKind.TEXT
    stop_reason: StopReason = StopReason.STOP
    arrival_offset_ms: float | None = None
    think_time_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    block_size: int
    requests: tuple[Request, ...]
    # When the session started in the recorded trace (ms from the trace's start), if recorded:
    # the stats replay a trace in its own order; an open-loop replay draws its own starts.
    start_ms: float | None = None

    def __post_init__(self) -> None:
        validate(self)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise TraceError(field, message)


def validate(session: Session) -> None:
    """Raises TraceError naming the first field that breaks the format."""
    _check(bool(session.session_id), "session_id", "empty")
    _check(session.block_size > 0, "block_size", f"{session.block_size} is not positive")
    _check(len(session.requests) > 0, "requests", "a session has at least one request")
    _check(session.start_ms is None or session.start_ms >= 0, "start_ms", "negative")
    for i, request in enumerate(session.requests):
        at = f"requests[{i}]"
        _check(request.input_tokens > 0, f"{at}.input_tokens", f"{request.input_tokens} is not positive")
        _check(request.output_tokens > 0, f"{at}.output_tokens", f"{request.output_tokens} is not positive")
        blocks = math.ceil(request.input_tokens / session.block_size)
        _check(
            len(request.hash_ids) == blocks,
            f"{at}.hash_ids",
            f"{len(request.hash_ids)} ids for {request.input_tokens} tokens "
            f"({blocks} blocks of {session.block_size})",
        )
        _check(all(h >= 0 for h in request.hash_ids), f"{at}.hash_ids", "ids are non-negative")
        offset, think = request.arrival_offset_ms, request.think_time_ms
        _check(
            (offset is None) != (think is None),
            f"{at}.arrival_offset_ms",
            "exactly one of arrival_offset_ms and think_time_ms",
        )
        timing = "arrival_offset_ms" if offset is not None else "think_time_ms"
        value = offset if offset is not None else think
        assert value is not None
        _check(value >= 0, f"{at}.{timing}", f"{value} is negative")
        _check(i > 0 or value == 0, f"{at}.{timing}", "the first request is sent at the session's start: 0")
        if i > 0 and offset is not None:
            previous = session.requests[i - 1].arrival_offset_ms
            _check(
                previous is None or offset >= previous,
                f"{at}.arrival_offset_ms",
                f"{offset} before the previous turn's {previous}",
            )


__all__ = ["InputKind", "Request", "Session", "StopReason", "TraceError", "validate"]
