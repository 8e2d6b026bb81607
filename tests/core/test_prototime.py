"""Seconds <-> protobuf Timestamp and Duration: valid messages at every rounding edge, exact
round trips for what the registry stores."""

from __future__ import annotations

import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.prototime import (
    duration_seconds,
    from_timestamp,
    timestamp_seconds,
    to_duration,
    to_timestamp,
)


@pytest.mark.parametrize("seconds", [0.0, 1.5, 2.9999999997, 1_800_000_100.9999999996])
def test_rounding_carries_into_the_next_second(seconds: float) -> None:
    ts, d = to_timestamp(seconds), to_duration(seconds)
    assert 0 <= ts.nanos < 10**9 and 0 <= d.nanos < 10**9
    ts.ToJsonString()  # raises for an invalid message
    d.ToJsonString()
    assert from_timestamp(ts) == pytest.approx(seconds, abs=1e-9)


def test_from_timestamp_is_correctly_rounded() -> None:
    ts = to_timestamp(0.0)
    ts.seconds, ts.nanos = 1_800_000_100, 250_000_000
    assert from_timestamp(ts) == 1_800_000_100.25


def test_duration_seconds_unset_is_none_and_negative_names_the_field() -> None:
    assert duration_seconds(Duration(), "ttl") is None
    assert duration_seconds(Duration(seconds=2, nanos=500_000_000), "ttl") == 2.5
    with pytest.raises(InvalidArgument) as err:
        duration_seconds(Duration(seconds=-1), "claim_ttl")
    assert err.value.field == "claim_ttl"


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_to_duration_refuses_what_is_not_a_duration(bad: float) -> None:
    with pytest.raises(ValueError):
        to_duration(bad)


@pytest.mark.parametrize(
    "d",
    [
        Duration(seconds=2**62),
        Duration(seconds=-(2**62)),
        Duration(seconds=315_576_000_001),
        Duration(seconds=1, nanos=-1),
        Duration(seconds=-1, nanos=1),
        Duration(nanos=1_000_000_000),
    ],
)
def test_a_duration_outside_protobufs_range_names_the_field(d: Duration) -> None:
    with pytest.raises(InvalidArgument) as err:
        duration_seconds(d, "ttl")
    assert err.value.field == "ttl"


def test_the_longest_valid_duration_converts() -> None:
    assert duration_seconds(Duration(seconds=315_576_000_000, nanos=999_999_999), "ttl") == pytest.approx(
        315_576_000_001
    )


@pytest.mark.parametrize(
    ("seconds", "nanos"),
    [(2**62, 0), (-(2**62), 0), (253_402_300_800, 0), (-62_135_596_801, 0), (0, -1), (0, 10**9)],
)
def test_a_timestamp_outside_protobufs_range_names_the_field(seconds: int, nanos: int) -> None:
    with pytest.raises(InvalidArgument) as err:
        timestamp_seconds(Timestamp(seconds=seconds, nanos=nanos), "retention.pin_expire_time")
    assert err.value.field == "retention.pin_expire_time"


def test_the_timestamp_range_ends_convert() -> None:
    assert timestamp_seconds(Timestamp(seconds=253_402_300_799, nanos=999_999_999), "t") > 2.5e11
    assert timestamp_seconds(Timestamp(seconds=-62_135_596_800), "t") == -62_135_596_800
