"""Test-only decoder of the KV-event frames captured from real vLLM (tests/fixtures/).

A frame's payload is msgpack `[ts, [events...], dp_rank]`; events are maps tagged
`type`. Unknown keys and unknown event types are ignored, as vLLM adds fields over
versions. This is test scaffolding, not the agent's decoder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack

from kvshuttle.registry.block_index import (
    AllBlocksCleared,
    BlockEvent,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
VLLM_0_32_KV_EVENTS = FIXTURES / "vllm-0.32.0-cpu-kv-events.json"

_END_SEQ = b"\xff" * 8  # the replay endpoint's end marker, seq -1


def load_frames(path: Path = VLLM_0_32_KV_EVENTS) -> dict[str, list[list[bytes]]]:
    """The fixture's frame lists ("live", "replay_from_0"), hex decoded."""
    raw: dict[str, list[list[str]]] = json.loads(path.read_text())
    return {key: [[bytes.fromhex(part) for part in frame] for frame in frames] for key, frames in raw.items()}


def decode_event(raw: Mapping[str, Any]) -> BlockEvent | None:
    """One event map -> domain event; None for an event type this decoder doesn't know."""
    kind = raw.get("type")
    if kind == "BlockStored":
        parent = raw.get("parent_block_hash")
        lora_id = raw.get("lora_id")
        return BlockStored(
            block_hashes=tuple(int(h) for h in raw["block_hashes"]),
            parent_block_hash=None if parent is None else int(parent),
            token_ids=tuple(int(t) for t in raw["token_ids"]),
            block_size=int(raw["block_size"]),
            lora_id=None if lora_id is None else int(lora_id),
            medium=str(raw.get("medium") or ""),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=tuple(int(h) for h in raw["block_hashes"]),
            medium=str(raw.get("medium") or ""),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(seq: bytes, payload: bytes) -> EventBatch:
    """One publisher message (seq frame, msgpack payload) -> EventBatch."""
    ts, raw_events, *_rest = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    events = tuple(e for e in (decode_event(raw) for raw in raw_events) if e is not None)
    return EventBatch(seq=int.from_bytes(seq, "big"), engine_time=float(ts), events=events)


def live_batches(path: Path = VLLM_0_32_KV_EVENTS) -> list[EventBatch]:
    """The SUB socket's messages: frames `[topic, seq, payload]`."""
    return [decode_batch(seq, payload) for _topic, seq, payload in load_frames(path)["live"]]


def replay_batches(path: Path = VLLM_0_32_KV_EVENTS) -> list[EventBatch]:
    """The replay ROUTER's answer to a request from seq 0: frames `[b"", topic, seq,
    payload]`, up to (not including) the end marker with seq -1."""
    out: list[EventBatch] = []
    for _empty, _topic, seq, payload in load_frames(path)["replay_from_0"]:
        if seq == _END_SEQ:
            break
        out.append(decode_batch(seq, payload))
    return out
