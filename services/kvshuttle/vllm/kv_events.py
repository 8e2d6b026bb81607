"""vLLM's KV-cache event wire format (`--kv-events-config`, ZMQ publisher), decoded tolerantly.

Live stream (the engine's PUB socket, one message per engine step that changed the cache):

    [topic, seq (8 bytes, big-endian), payload]

`seq` counts from 0 per engine start. `payload` is msgpack of vLLM's `KVEventBatch`, an
array-like struct: `[ts, [event, ...], data_parallel_rank]` (`ts` is the engine's wall clock).
Events are msgpack maps tagged by `"type"`:

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": int | None,
     "token_ids": [...], "block_size": int, "lora_id": int | None, "medium": "GPU", ...}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", ...}
    {"type": "AllBlocksCleared"}

Cache salts: a request's `cache_salt` is part of vLLM's hash of its first block, and 0.32 reports
it in `extra_keys` (one entry per block, untagged: the LoRA name when `lora_name` is set, then
`(mm_identifier, offset)` pairs, the salt string, prompt-embeds digests as bytes). The decoder
keeps only the salt's SHA-256 (`BlockStored.cache_salt_sha256`), for a sequence's first block
(no parent, where vLLM puts it): the salt itself never leaves the agent. An entry with more than
one candidate string is malformed.

vLLM adds fields over versions (`lora_name`, `extra_keys`, `group_idx`,
`kv_cache_spec_kind`, `session_id`, ...) and omits fields left at their defaults, so the
decoder reads the fields it needs, ignores every other key (and counts the ones it has never
heard of), and skips, without raising, what it cannot use:

* an event of an unknown type: skipped, counted per type (`unknown_event_types`);
* a malformed event (a required field missing or of the wrong type, a token id outside
  uint32, a hash that is neither an int nor bytes): skipped, counted (`malformed_events`);
* an event of another KV-cache group than `group` (hybrid models publish one stream of events
  per group; the block index models one block pool): skipped, counted (`other_group_events`);
* a payload that is not a batch: the message still yields an EventBatch with its seq and no
  events, so the sequence stays continuous for the consumer (`malformed_payloads`);
* a message whose frames or seq cannot be read: None (`malformed_messages`).

Block hashes are 64-bit ints (vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, the default); a
hash sent as bytes is read as the low 64 bits of its big-endian value, which is what vLLM's
int form is.

Replay (the engine's optional ROUTER `replay_endpoint`): a DEALER sends
`[b"", start_seq (8 bytes)]` and receives one message `[b"", topic, seq, payload]` per buffered
batch with seq >= start_seq, then the end marker `[b"", b"", seq -1 (0xff * 8), b""]`.
`replay_request` and `decode_replay_message` speak it; the socket is the caller's.

The encoders (`encode_payload`, `encode_message`, `encode_replay_message`, `END_OF_REPLAY`)
write what vLLM writes, for publishers that stand in for an engine (tests, an emulator).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from kvshuttle.core.hashing import cache_salt_digest
from kvshuttle.core.kv_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, EventBatch

__all__ = [
    "END_OF_REPLAY",
    "END_SEQ",
    "DecodeStats",
    "KvEventDecoder",
    "ReplayEnd",
    "decode_seq",
    "encode_message",
    "encode_payload",
    "encode_replay_message",
    "encode_seq",
    "replay_request",
]

_U32: Final = 0xFFFFFFFF
_U64: Final = 0xFFFFFFFFFFFFFFFF
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1

END_SEQ: Final = _U64
"""The replay end marker's seq: -1 as 8 signed big-endian bytes, read unsigned."""

# Fields vLLM has sent per event type (0.21 .. 0.33). Keys outside these are counted as unknown
# (and ignored): a new vLLM field to look at, not an error.
_KNOWN_KEYS: Final[Mapping[str, frozenset[str]]] = {
    "BlockStored": frozenset(
        {
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
            "locality",
            "ownership",
            "session_id",
        }
    ),
    "BlockRemoved": frozenset({"type", "block_hashes", "medium", "group_idx", "locality", "ownership"}),
    "AllBlocksCleared": frozenset({"type"}),
}
# Distinct unknown event types remembered by name; more are counted under "<other>".
_MAX_UNKNOWN_TYPES: Final = 32


def encode_seq(seq: int) -> bytes:
    """A seq frame: 8 bytes big-endian (-1, the replay end marker, as 0xff * 8)."""
    return (seq & _U64).to_bytes(8, "big")


def decode_seq(frame: bytes) -> int | None:
    """A seq frame's value (END_SEQ for the replay end marker); None unless it is 8 bytes."""
    if len(frame) != 8:
        return None
    return int.from_bytes(frame, "big")


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to the replay endpoint for every buffered batch from `start_seq` on."""
    if start_seq < 0:
        raise ValueError("start_seq must not be negative")
    return [b"", encode_seq(start_seq)]


class ReplayEnd:
    """The replay endpoint's end marker: no more batches follow."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ReplayEnd"


_REPLAY_END: Final = ReplayEnd()


@dataclass(slots=True)
class DecodeStats:
    """What a decoder skipped or ignored, since it was made. Monotonic counters."""

    messages: int = 0  # messages decoded into a batch (live and replayed)
    events: int = 0  # events decoded
    malformed_messages: int = 0  # wrong frame count or unreadable seq: no batch
    malformed_payloads: int = 0  # payload not a batch: a batch without events
    malformed_events: int = 0
    other_group_events: int = 0
    unknown_keys: int = 0  # keys outside what vLLM is known to send (ignored)
    unknown_event_types: Counter[str] = field(default_factory=Counter)

    @property
    def unknown_events(self) -> int:
        return sum(self.unknown_event_types.values())


class _Malformed(Exception):
    """An event field that cannot be used; the event is skipped."""


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Malformed
    return value


def _hash(value: object) -> int:
    if isinstance(value, bytes | bytearray):
        if not value:
            raise _Malformed
        return int.from_bytes(value, "big") & _U64
    return _int(value) & _U64


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise _Malformed
    return tuple(_hash(h) for h in value)


def _token_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise _Malformed
    tokens = tuple(_int(t) for t in value)
    if any(t < 0 or t > _U32 for t in tokens):
        raise _Malformed
    return tokens


def _first_block_salt(raw: Mapping[Any, Any]) -> str | None:
    """The cache salt in a sequence's first block's `extra_keys` (see the module doc), or None."""
    extra = raw.get("extra_keys")
    if extra is None:
        return None
    if not isinstance(extra, list | tuple):
        raise _Malformed
    keys = extra[0] if extra else None
    if keys is None:
        return None
    if not isinstance(keys, list | tuple):
        raise _Malformed
    items = list(keys)
    lora_name = raw.get("lora_name")
    if isinstance(lora_name, str) and items and items[0] == lora_name:
        items = items[1:]  # the adapter's name comes first
    salts = [k for k in items if isinstance(k, str)]
    if len(salts) > 1:
        raise _Malformed
    return salts[0] if salts and salts[0] else None


def _medium(value: object) -> str:
    # vLLM says "GPU" (even on the CPU build), "CPU" for offloaded blocks; None is possible.
    return value if isinstance(value, str) else ""


class KvEventDecoder:
    """Decodes vLLM KV-event messages into `kvshuttle.registry.block_index` batches, never
    raising on bad input (see the module docstring). Keeps `stats` of what it skipped.

    `group`: the KV-cache group whose events are kept (events of other `group_idx` values are
    skipped); None keeps every group. Events without `group_idx` (older vLLM) are always kept.
    """

    def __init__(self, *, group: int | None = 0) -> None:
        self.group = group
        self.stats = DecodeStats()

    # -- messages ----------------------------------------------------------------------------

    def decode_message(self, frames: Sequence[bytes]) -> EventBatch | None:
        """A live message `[topic, seq, payload]`; None when its frames or seq are unreadable."""
        if len(frames) != 3:
            self.stats.malformed_messages += 1
            return None
        seq = decode_seq(frames[1])
        if seq is None or seq == END_SEQ:
            self.stats.malformed_messages += 1
            return None
        return self.decode_payload(seq, frames[2])

    def decode_replay_message(self, frames: Sequence[bytes]) -> EventBatch | ReplayEnd | None:
        """A message a DEALER received from the replay endpoint, `[b"", topic, seq, payload]`:
        the batch, ReplayEnd for the end marker, None when unreadable."""
        if len(frames) == 4 and frames[0] == b"":
            frames = frames[1:]
        elif len(frames) != 3:  # a DEALER without the empty delimiter frame gets no other shape
            self.stats.malformed_messages += 1
            return None
        seq = decode_seq(frames[1])
        if seq is None:
            self.stats.malformed_messages += 1
            return None
        if seq == END_SEQ:
            return _REPLAY_END
        return self.decode_payload(seq, frames[2])

    def decode_payload(self, seq: int, payload: bytes) -> EventBatch:
        """One batch; a payload that is not `[ts, [events], ...]` gives a batch without events."""
        self.stats.messages += 1
        try:
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
            raw = None
        if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list | tuple):
            self.stats.malformed_payloads += 1
            return EventBatch(seq=seq, engine_time=0.0, events=())
        ts = raw[0]
        engine_time = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else 0.0
        events: list[BlockEvent] = []
        for item in raw[1]:
            event = self.decode_event(item)
            if event is not None:
                events.append(event)
        return EventBatch(seq=seq, engine_time=engine_time, events=tuple(events))

    # -- events ------------------------------------------------------------------------------

    def decode_event(self, raw: object) -> BlockEvent | None:
        """One event map; None (counted) for what it skips."""
        stats = self.stats
        if not isinstance(raw, Mapping):
            stats.malformed_events += 1
            return None
        kind = raw.get("type")
        known = _KNOWN_KEYS.get(kind) if isinstance(kind, str) else None
        if known is None or not isinstance(kind, str):
            name = kind if isinstance(kind, str) else "<not a string>"
            if name not in stats.unknown_event_types and len(stats.unknown_event_types) >= _MAX_UNKNOWN_TYPES:
                name = "<other>"
            stats.unknown_event_types[name[:64]] += 1
            return None
        stats.unknown_keys += sum(1 for key in raw if key not in known)
        group = raw.get("group_idx")
        if self.group is not None and group is not None and group != self.group:
            stats.other_group_events += 1
            return None
        try:
            event = self._event(kind, raw)
        except (_Malformed, KeyError):
            stats.malformed_events += 1
            return None
        stats.events += 1
        return event

    @staticmethod
    def _event(kind: str, raw: Mapping[Any, Any]) -> BlockEvent:
        if kind == "BlockStored":
            parent = raw.get("parent_block_hash")
            lora_id = raw.get("lora_id")
            if lora_id is not None:
                lora_id = _int(lora_id)
                if not _I64_MIN <= lora_id <= _I64_MAX:
                    raise _Malformed
            block_size = _int(raw["block_size"])
            if not 0 < block_size <= _U32:
                raise _Malformed
            salt = _first_block_salt(raw) if parent is None else None
            return BlockStored(
                block_hashes=_hashes(raw["block_hashes"]),
                parent_block_hash=None if parent is None else _hash(parent),
                token_ids=_token_ids(raw["token_ids"]),
                block_size=block_size,
                lora_id=lora_id,
                medium=_medium(raw.get("medium")),
                cache_salt_sha256=b"" if salt is None else cache_salt_digest(salt),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(block_hashes=_hashes(raw["block_hashes"]), medium=_medium(raw.get("medium")))
        return AllBlocksCleared()


# -- encoding (what vLLM's publisher writes) -----------------------------------------------------


def _event_map(event: BlockEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": None,
            "group_idx": 0,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def encode_payload(batch: EventBatch, *, dp_rank: int | None = 0) -> bytes:
    """msgpack `[ts, [events], dp_rank]`, as vLLM's KVEventBatch encodes."""
    return bytes(msgpack.packb([batch.engine_time, [_event_map(e) for e in batch.events], dp_rank]))


def encode_message(topic: bytes, batch: EventBatch) -> list[bytes]:
    """A live message `[topic, seq, payload]`."""
    return [topic, encode_seq(batch.seq), encode_payload(batch)]


def encode_replay_message(topic: bytes, batch: EventBatch) -> list[bytes]:
    """One replayed batch as the ROUTER sends it after the peer's identity: `[b"", topic, seq, payload]`."""
    return [b"", *encode_message(topic, batch)]


END_OF_REPLAY: Final = (b"", b"", encode_seq(-1), b"")
"""The replay endpoint's end marker (after the peer's identity)."""
