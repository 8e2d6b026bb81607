"""kvshuttle.vllm.kv_events: vLLM's KV-event wire format, decoded from frames a real vLLM sent,
and tolerant of what a newer (or broken) one might send."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from tests.support.fixtures_vllm import FIXTURE_TOPIC, load_frames, replay_batches

from kvshuttle.core.hashing import cache_salt_digest
from kvshuttle.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvshuttle.vllm.kv_events import (
    END_OF_REPLAY,
    END_SEQ,
    KvEventDecoder,
    ReplayEnd,
    decode_seq,
    encode_message,
    encode_replay_message,
    encode_seq,
    replay_request,
)


def payload(*events: Any, ts: Any = 1.7e9) -> bytes:
    return bytes(msgpack.packb([ts, list(events), 0]))


STORED: dict[str, Any] = {
    "type": "BlockStored",
    "block_hashes": [11, 12],
    "parent_block_hash": None,
    "token_ids": list(range(8)),
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}


def test_real_vllm_frames_decode_without_skipping_anything() -> None:
    decoder = KvEventDecoder()
    live = [decoder.decode_message(frames) for frames in load_frames()["live"]]
    assert all(b is not None for b in live)
    batches = [b for b in live if b is not None]
    assert [b.seq for b in batches] == list(range(15))
    events = [e for b in batches for e in b.events]
    assert sum(isinstance(e, BlockStored) for e in events) == 15
    assert sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved)) == 19
    assert sum(isinstance(e, AllBlocksCleared) for e in events) == 1
    assert all(b.engine_time > 1.7e9 for b in batches)  # wall clock
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {e.block_size for e in stored} == {32}
    assert {e.medium for e in stored} == {"GPU"}  # even on the CPU build
    assert all(len(e.token_ids) == 32 * len(e.block_hashes) for e in stored)
    # vLLM 0.32 sends extra_keys, group_idx, kv_cache_spec_kind: known, so nothing is counted.
    stats = decoder.stats
    assert (stats.unknown_keys, stats.malformed_events, stats.malformed_payloads) == (0, 0, 0)
    assert (stats.other_group_events, stats.unknown_events, stats.messages) == (0, 0, 15)
    assert replay_batches() == batches


def test_replay_frames_end_with_the_marker() -> None:
    decoder = KvEventDecoder()
    frames = load_frames()["replay_from_0"]
    assert isinstance(decoder.decode_replay_message(frames[-1]), ReplayEnd)
    assert tuple(frames[-1]) == END_OF_REPLAY
    first = decoder.decode_replay_message(frames[0])
    assert isinstance(first, EventBatch)
    assert first.seq == 0
    assert replay_request(7) == [b"", (7).to_bytes(8, "big")]
    assert decode_seq(encode_seq(-1)) == END_SEQ
    with pytest.raises(ValueError):
        replay_request(-1)


def test_encoding_round_trips_through_the_decoder() -> None:
    decoder = KvEventDecoder()
    batches = replay_batches()
    for batch in batches:
        assert decoder.decode_message(encode_message(FIXTURE_TOPIC, batch)) == batch
        assert decoder.decode_replay_message(encode_replay_message(FIXTURE_TOPIC, batch)) == batch
    assert decoder.stats.unknown_keys == 0


def test_unknown_keys_and_event_types_are_ignored_and_counted() -> None:
    decoder = KvEventDecoder()
    batch = decoder.decode_payload(
        3,
        payload(
            {**STORED, "shiny_new_field": [1, 2], "another": None},
            {"type": "BlockMoved", "block_hashes": [1]},
            {"type": "BlockMoved"},
            {"type": "AllBlocksCleared", "reason": "reset"},
        ),
    )
    assert batch.seq == 3
    assert [type(e) for e in batch.events] == [BlockStored, AllBlocksCleared]
    assert decoder.stats.unknown_keys == 3
    assert decoder.stats.unknown_event_types == {"BlockMoved": 2}
    assert decoder.stats.unknown_events == 2


@pytest.mark.parametrize(
    "event",
    [
        "not a map",
        {"no": "type"},
        {**STORED, "block_hashes": "abc"},
        {**STORED, "token_ids": [1, 2, -3, 4, 5, 6, 7, 8]},
        {**STORED, "token_ids": [2**32] * 8},
        {**STORED, "token_ids": [True] * 8},
        {**STORED, "block_size": 0},
        {**STORED, "lora_id": "x"},
        {k: v for k, v in STORED.items() if k != "block_size"},
        {"type": "BlockRemoved", "block_hashes": [1.5]},
        {"type": "BlockRemoved"},
    ],
)
def test_malformed_events_are_skipped_never_raised(event: Any) -> None:
    decoder = KvEventDecoder()
    batch = decoder.decode_payload(0, payload(event, STORED))
    assert [type(e) for e in batch.events] == [BlockStored]  # the good event still comes through
    stats = decoder.stats
    assert stats.malformed_events + stats.unknown_events == 1


def test_a_broken_payload_keeps_its_seq_and_a_broken_message_is_none() -> None:
    decoder = KvEventDecoder()
    for junk in (b"", b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([1.0]), msgpack.packb([1.0, 5, 0])):
        batch = decoder.decode_payload(9, bytes(junk))
        assert batch == EventBatch(seq=9, engine_time=0.0, events=())
    assert decoder.stats.malformed_payloads == 5
    assert decoder.decode_message([b"t", b"\x00" * 7, payload()]) is None  # seq not 8 bytes
    assert decoder.decode_message([b"t", payload()]) is None
    assert decoder.decode_message([b"t", encode_seq(-1), payload()]) is None  # not a live seq
    assert decoder.decode_replay_message([b"", b"t"]) is None
    assert decoder.stats.malformed_messages == 4
    # A non-numeric ts still gives the events.
    assert len(decoder.decode_payload(1, payload(STORED, ts="later")).events) == 1


def test_hashes_as_bytes_and_other_groups() -> None:
    decoder = KvEventDecoder()
    digest = bytes(range(32))  # vLLM without VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    batch = decoder.decode_payload(
        0,
        payload(
            {**STORED, "block_hashes": [digest, 2**64 - 1], "parent_block_hash": -1, "group_idx": 0},
            {**STORED, "group_idx": 1},  # a second KV-cache group (hybrid models)
            {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU", "group_idx": 1},
        ),
    )
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (int.from_bytes(digest[-8:], "big"), 2**64 - 1)
    assert event.parent_block_hash == 2**64 - 1  # int64 -1 read as uint64
    assert decoder.stats.other_group_events == 2
    every_group = KvEventDecoder(group=None).decode_payload(0, payload({**STORED, "group_idx": 1}))
    assert len(every_group.events) == 1


# ---- cache salts (vLLM 0.32 reports a request's cache_salt in its first block's extra_keys) ----


def _decoded(event: dict[str, Any]) -> tuple[BlockStored | None, KvEventDecoder]:
    decoder = KvEventDecoder()
    events = decoder.decode_payload(0, payload(event)).events
    stored = events[0] if events else None
    assert stored is None or isinstance(stored, BlockStored)
    return stored, decoder


@pytest.mark.parametrize(
    ("extra", "lora_name"),
    [
        ([["tenant-salt"], None], None),  # what vLLM sends for a salted prompt's first blocks
        ([["adapter-a", "tenant-salt"], None], "adapter-a"),  # the LoRA name comes first
        ([[["mm-hash", 0], "tenant-salt", b"\x01" * 32], None], None),  # mm pairs, embeds digests
    ],
)
def test_a_first_blocks_salt_is_kept_only_as_its_digest(extra: list[Any], lora_name: str | None) -> None:
    stored, decoder = _decoded({**STORED, "extra_keys": extra, "lora_name": lora_name})
    assert stored is not None
    assert stored.cache_salt_sha256 == cache_salt_digest("tenant-salt")
    assert "tenant-salt" not in repr(stored)  # the salt itself never leaves the agent
    assert decoder.stats.malformed_events == 0


@pytest.mark.parametrize(
    "event",
    [
        STORED,  # no extra_keys at all (older vLLM)
        {**STORED, "extra_keys": None},
        {**STORED, "extra_keys": [None, None]},  # unsalted (the real capture)
        {**STORED, "extra_keys": [["adapter-a"], None], "lora_name": "adapter-a"},
        # A block that is not a sequence's first: its parent carries the salt down the chain.
        {**STORED, "parent_block_hash": 9, "extra_keys": [["tenant-salt"], None]},
    ],
)
def test_events_without_a_first_block_salt_carry_none(event: dict[str, Any]) -> None:
    stored, _ = _decoded(event)
    assert stored is not None and stored.cache_salt_sha256 == b""


@pytest.mark.parametrize("extra", ["salt", [["salt-a", "salt-b"], None], ["salt"]])
def test_unreadable_extra_keys_are_malformed(extra: Any) -> None:
    stored, decoder = _decoded({**STORED, "extra_keys": extra})
    assert stored is None and decoder.stats.malformed_events == 1
