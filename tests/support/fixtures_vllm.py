"""The KV-event frames captured from real vLLM (tests/fixtures/), decoded by the production
decoder, kvshuttle.vllm.kv_events."""

from __future__ import annotations

import json
from pathlib import Path

from kvshuttle.core.kv_events import EventBatch
from kvshuttle.vllm.kv_events import KvEventDecoder, ReplayEnd

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_0_32_KV_EVENTS = FIXTURES / "vllm-0.32.0-cpu-kv-events.json"
FIXTURE_TOPIC = b"kv-events"


def load_frames(path: Path = VLLM_0_32_KV_EVENTS) -> dict[str, list[list[bytes]]]:
    """The fixture's frame lists ("live", "replay_from_0"), hex decoded."""
    raw: dict[str, list[list[str]]] = json.loads(path.read_text())
    return {key: [[bytes.fromhex(part) for part in frame] for frame in frames] for key, frames in raw.items()}


def live_batches(path: Path = VLLM_0_32_KV_EVENTS) -> list[EventBatch]:
    """The SUB socket's messages: frames `[topic, seq, payload]`."""
    decoder = KvEventDecoder()
    out: list[EventBatch] = []
    for frames in load_frames(path)["live"]:
        batch = decoder.decode_message(frames)
        assert batch is not None
        out.append(batch)
    return out


def replay_batches(path: Path = VLLM_0_32_KV_EVENTS) -> list[EventBatch]:
    """The replay ROUTER's answer to a request from seq 0: frames `[b"", topic, seq,
    payload]`, up to (not including) the end marker with seq -1."""
    decoder = KvEventDecoder()
    out: list[EventBatch] = []
    for frames in load_frames(path)["replay_from_0"]:
        item = decoder.decode_replay_message(frames)
        if isinstance(item, ReplayEnd):
            break
        assert item is not None
        out.append(item)
    return out
