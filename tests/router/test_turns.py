"""Turn handles: a handle this codec issued decodes from memory to what a full check gives;
anything else is checked in full (a forged or altered handle never reads the memory)."""

from __future__ import annotations

import dataclasses

import pytest

from kvshuttle.core.errors import NotFound
from kvshuttle.router.turns import TurnCodec, TurnState

KEY = b"k" * 32


def state(turn_id: str = "t1") -> TurnState:
    return TurnState(
        turn_id=turn_id,
        conversation="tenants/acme/conversations/c1",
        generation=3,
        model="m",
        block_size=16,
        prefill_node="nodes/p0",
        decode_node="nodes/d0",
        decode_engine_id="engine-d0",
        prompt_tokens=100,
        prompt_tail_hash=2**63 + 5,
        prompt_full_blocks=6,
        reusable_tokens=64,
        local_hit_tokens=0,
        decision="reuse",
        reason="reuse_cheaper",
        claimed="tenants/acme/conversations/c1/retentions/2",
        claim_id="c",
        issued_at=1.5,
        expire_at=301.5,
        trace_id="0" * 32,
        span_id="0" * 16,
    )


def test_an_issued_handle_decodes_from_memory_as_in_full() -> None:
    codec = TurnCodec(KEY)
    handle = codec.encode(state())
    remembered = codec.decode(handle)
    # Another replica (same key, nothing remembered) checks it in full and gets the same state.
    assert TurnCodec(KEY, remembered=0).decode(handle) == remembered == state()


def test_an_altered_handle_is_checked_in_full_and_refused() -> None:
    codec = TurnCodec(KEY)
    handle = codec.encode(state())
    forged = TurnCodec(b"x" * 32).encode(dataclasses.replace(state(), generation=9))
    for bad in (handle[:-2] + ("AA" if not handle.endswith("AA") else "BB"), forged):
        with pytest.raises(NotFound):
            codec.decode(bad)


def test_memory_keeps_the_newest_handles_and_older_ones_still_decode() -> None:
    codec = TurnCodec(KEY, remembered=2)
    handles = [codec.encode(state(f"t{i}")) for i in range(3)]
    assert len(codec._issued) == 2
    assert [codec.decode(h).turn_id for h in handles] == ["t0", "t1", "t2"]
