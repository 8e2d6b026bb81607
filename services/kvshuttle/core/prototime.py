"""Seconds <-> protobuf's well-known Timestamp and Duration: the one set of conversions every
service, the client library and the CLI use. Seconds are floats since the Unix epoch."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import TypeAlias

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from kvshuttle.core.errors import InvalidArgument

__all__ = [
    "DurationLike",
    "check_duration",
    "duration_seconds",
    "from_timestamp",
    "seconds_until",
    "timestamp_seconds",
    "to_duration",
    "to_timestamp",
]

# The ranges protobuf defines for the well-known types: Timestamps from 0001-01-01T00:00:00Z to
# 9999-12-31T23:59:59.999999999Z, Durations of at most about ±10,000 years, nanos of one sign.
MIN_TIMESTAMP_SECONDS = -62_135_596_800
MAX_TIMESTAMP_SECONDS = 253_402_300_799
MAX_DURATION_SECONDS = 315_576_000_000
_NANOS = 999_999_999

DurationLike: TypeAlias = timedelta | float | int
"""A duration: a timedelta, or seconds."""


def to_duration(value: DurationLike) -> Duration:
    """A Duration from a timedelta or seconds (ValueError when negative or not finite)."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be finite and non-negative, got {value!r}")
    whole = int(seconds)
    nanos = round((seconds - whole) * 1e9)
    if nanos >= 1_000_000_000:  # rounding carried into the next second
        whole, nanos = whole + 1, nanos - 1_000_000_000
    return Duration(seconds=whole, nanos=nanos)


def check_duration(d: Duration, field: str) -> None:
    """InvalidArgument naming `field` unless `d` is within protobuf's Duration range (checked
    before any arithmetic on it)."""
    seconds, nanos = d.seconds, d.nanos
    if (
        abs(seconds) > MAX_DURATION_SECONDS
        or abs(nanos) > _NANOS
        or (seconds > 0 and nanos < 0)
        or (seconds < 0 and nanos > 0)
    ):
        raise InvalidArgument(field, "not a valid Duration (at most 315576000000 s, nanos of one sign)")


def duration_seconds(d: Duration, field: str) -> float | None:
    """A request's duration field in seconds; None when unset (the domain picks its default).
    A negative duration, or one outside protobuf's range, is InvalidArgument naming `field`."""
    if d.seconds == 0 and d.nanos == 0:
        return None
    check_duration(d, field)
    value = d.ToNanoseconds() / 10**9
    if value < 0:
        raise InvalidArgument(field, "must not be negative")
    return value


def to_timestamp(value: datetime | float) -> Timestamp:
    """A Timestamp from an aware datetime or seconds since the epoch."""
    ts = Timestamp()
    if isinstance(value, datetime):
        ts.FromDatetime(value.astimezone(UTC))
    else:
        whole = math.floor(value)
        ts.seconds, ts.nanos = whole, round((value - whole) * 1e9)
        if ts.nanos >= 1_000_000_000:  # rounding carried into the next second
            ts.seconds, ts.nanos = whole + 1, ts.nanos - 1_000_000_000
    return ts


def timestamp_seconds(ts: Timestamp, field: str) -> float:
    """A request's timestamp field in seconds since the epoch; InvalidArgument naming `field`
    when it is outside protobuf's Timestamp range (0001-01-01 .. 9999-12-31), checked before
    any arithmetic on it."""
    if not MIN_TIMESTAMP_SECONDS <= ts.seconds <= MAX_TIMESTAMP_SECONDS or not 0 <= ts.nanos <= _NANOS:
        raise InvalidArgument(field, "not a valid Timestamp (0001-01-01T00:00:00Z .. 9999-12-31T23:59:59Z)")
    return from_timestamp(ts)


def from_timestamp(ts: Timestamp) -> float:
    """Seconds since the epoch, correctly rounded from the exact nanosecond count."""
    return ts.ToNanoseconds() / 10**9


def seconds_until(ts: Timestamp, now: float) -> float | None:
    """Seconds from `now` until `ts`; None when `ts` is unset (all zero)."""
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    return from_timestamp(ts) - now
