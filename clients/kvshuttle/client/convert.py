"""Conversions between Python values and the API's well-known types. vLLM's
`kv_transfer_params` dict converts with kvshuttle.vllm.kv_transfer_params."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import TypeAlias

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

__all__ = [
    "DurationLike",
    "from_timestamp",
    "seconds_until",
    "to_duration",
    "to_timestamp",
]

DurationLike: TypeAlias = timedelta | float | int
"""A duration: a timedelta, or seconds."""


def to_duration(value: DurationLike) -> Duration:
    """A google.protobuf.Duration from a timedelta or seconds (ValueError when negative or not finite)."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be finite and non-negative, got {value!r}")
    whole = int(seconds)
    return Duration(seconds=whole, nanos=round((seconds - whole) * 1e9))


def to_timestamp(value: datetime | float) -> Timestamp:
    """A google.protobuf.Timestamp from an aware datetime or seconds since the epoch."""
    ts = Timestamp()
    if isinstance(value, datetime):
        ts.FromDatetime(value.astimezone(UTC))
    else:
        whole = math.floor(value)
        ts.seconds, ts.nanos = whole, round((value - whole) * 1e9)
    return ts


def from_timestamp(ts: Timestamp) -> float:
    """Seconds since the epoch."""
    return ts.seconds + ts.nanos / 1e9


def seconds_until(ts: Timestamp, now: float) -> float | None:
    """Seconds from `now` (epoch seconds) until `ts`; None when `ts` is unset (all zero)."""
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    return from_timestamp(ts) - now
