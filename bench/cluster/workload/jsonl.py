"""Session traces as JSONL, one session per line:

    {"session_id": "mc-17", "block_size": 512, "start_ms": 3000.0, "requests": [
      {"input_tokens": 6758, "output_tokens": 500, "hash_ids": [0, 1, ...],
       "input_kind": "text", "stop_reason": "stop", "arrival_offset_ms": 0.0}, ...]}

A request has `arrival_offset_ms` or `think_time_ms` (never both); `start_ms` may be absent.
Reading checks every field's type and the model's rules (model.validate); an error names the
line and the field ("line 3: requests[1].hash_ids: ...").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bench.cluster.workload.model import InputKind, Request, Session, StopReason, TraceError

_SESSION_FIELDS = {"session_id", "block_size", "start_ms", "requests"}
_REQUEST_FIELDS = {
    "input_tokens",
    "output_tokens",
    "hash_ids",
    "input_kind",
    "stop_reason",
    "arrival_offset_ms",
    "think_time_ms",
}


def session_to_dict(session: Session) -> dict[str, Any]:
    out: dict[str, Any] = {"session_id": session.session_id, "block_size": session.block_size}
    if session.start_ms is not None:
        out["start_ms"] = session.start_ms
    out["requests"] = [_request_to_dict(r) for r in session.requests]
    return out


def _request_to_dict(request: Request) -> dict[str, Any]:
    out: dict[str, Any] = {
        "input_tokens": request.input_tokens,
        "output_tokens": request.output_tokens,
        "hash_ids": list(request.hash_ids),
        "input_kind": request.input_kind.value,
        "stop_reason": request.stop_reason.value,
    }
    if request.arrival_offset_ms is not None:
        out["arrival_offset_ms"] = request.arrival_offset_ms
    if request.think_time_ms is not None:
        out["think_time_ms"] = request.think_time_ms
    return out


def _int(value: object, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceError(field, f"expected an integer, got {value!r}")
    return value


def _number(value: object, field: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TraceError(field, f"expected a number, got {value!r}")
    return float(value)


def _optional_number(raw: dict[str, Any], key: str, field: str) -> float | None:
    return None if raw.get(key) is None else _number(raw[key], field)


def _unknown(raw: dict[str, Any], allowed: set[str], prefix: str) -> None:
    extra = sorted(set(raw) - allowed)
    if extra:
        raise TraceError(f"{prefix}{extra[0]}", "unknown field")


def _required(raw: dict[str, Any], key: str, field: str) -> Any:
    if key not in raw:
        raise TraceError(field, "missing")
    return raw[key]


def _request_from_dict(raw: object, at: str) -> Request:
    if not isinstance(raw, dict):
        raise TraceError(at, "expected an object")
    _unknown(raw, _REQUEST_FIELDS, f"{at}.")
    ids = _required(raw, "hash_ids", f"{at}.hash_ids")
    if not isinstance(ids, list):
        raise TraceError(f"{at}.hash_ids", "expected a list of integers")
    kind, stop = raw.get("input_kind", "text"), raw.get("stop_reason", "stop")
    try:
        input_kind = InputKind(kind)
    except ValueError:
        raise TraceError(f"{at}.input_kind", f"{kind!r} is not one of {[*map(str, InputKind)]}") from None
    try:
        stop_reason = StopReason(stop)
    except ValueError:
        raise TraceError(f"{at}.stop_reason", f"{stop!r} is not one of {[*map(str, StopReason)]}") from None
    return Request(
        input_tokens=_int(_required(raw, "input_tokens", f"{at}.input_tokens"), f"{at}.input_tokens"),
        output_tokens=_int(_required(raw, "output_tokens", f"{at}.output_tokens"), f"{at}.output_tokens"),
        hash_ids=tuple(_int(h, f"{at}.hash_ids[{j}]") for j, h in enumerate(ids)),
        input_kind=input_kind,
        stop_reason=stop_reason,
        arrival_offset_ms=_optional_number(raw, "arrival_offset_ms", f"{at}.arrival_offset_ms"),
        think_time_ms=_optional_number(raw, "think_time_ms", f"{at}.think_time_ms"),
    )


def session_from_dict(raw: object) -> Session:
    """Raises TraceError (without a line) naming the first bad field."""
    if not isinstance(raw, dict):
        raise TraceError("session", "expected a JSON object")
    _unknown(raw, _SESSION_FIELDS, "")
    session_id = _required(raw, "session_id", "session_id")
    if not isinstance(session_id, str):
        raise TraceError("session_id", f"expected a string, got {session_id!r}")
    requests = _required(raw, "requests", "requests")
    if not isinstance(requests, list):
        raise TraceError("requests", "expected a list")
    return Session(
        session_id=session_id,
        block_size=_int(_required(raw, "block_size", "block_size"), "block_size"),
        requests=tuple(_request_from_dict(r, f"requests[{i}]") for i, r in enumerate(requests)),
        start_ms=_optional_number(raw, "start_ms", "start_ms"),
    )


def read_sessions(path: Path) -> Iterator[Session]:
    """The sessions of a JSONL file, in order; blank lines are skipped. Raises TraceError with
    the line number."""
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield session_from_dict(json.loads(line))
            except json.JSONDecodeError as e:
                raise TraceError("session", f"not JSON: {e.msg}", line=number) from None
            except TraceError as e:
                raise TraceError(e.field, e.message, line=number) from None


def write_sessions(path: Path, sessions: Iterable[Session]) -> int:
    """Writes one session per line; how many."""
    count = 0
    with path.open("w") as out:
        for session in sessions:
            out.write(json.dumps(session_to_dict(session), separators=(",", ":")) + "\n")
            count += 1
    return count


__all__ = ["read_sessions", "session_from_dict", "session_to_dict", "write_sessions"]
