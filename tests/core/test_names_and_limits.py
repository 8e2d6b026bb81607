"""Resource names take canonical ASCII generations only; the shared bounds agree with each other."""

from __future__ import annotations

import pytest

from kvshuttle.core import limits
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.names import parse_retention

CONV = "tenants/t/conversations/c"


@pytest.mark.parametrize(
    "generation",
    ["\u00b2", "\u0661", "\uff11", "1\u0661", "0", "01", "-1", "+1", "1_0", str(2**63), "9" * 40],
)
def test_a_retention_generation_is_ascii_digits_in_range(generation: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_retention(f"{CONV}/retentions/{generation}", "name")
    assert err.value.field == "name"


def test_the_largest_generation_parses() -> None:
    assert parse_retention(f"{CONV}/retentions/{2**63 - 1}").generation == limits.MAX_GENERATION


def test_what_plan_turn_accepts_commit_turn_and_the_registry_accept() -> None:
    assert limits.MAX_PROMPT_TOKENS + limits.MAX_OUTPUT_TOKENS == limits.MAX_SEQUENCE_TOKENS
    assert limits.MAX_SEQUENCE_TOKENS <= limits.MAX_NUM_TOKENS
    # Incremented or summed values keep room in their uint64 fields.
    assert limits.MAX_GENERATION + 1 < 2**64 and limits.MAX_EVENT_SEQ + 1 < 2**64
    assert limits.MAX_KV_BYTES == limits.MAX_NUM_TOKENS * limits.MAX_KV_BYTES_PER_TOKEN < 2**63
