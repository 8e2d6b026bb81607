"""vLLM's NIXL side channel, byte for byte as vLLM 0.32.0 (NIXL connector version 14) speaks it.

The handshake (`VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`, a ZMQ ROUTER in the engine-core process):

    request (REQ):  msgpack([b"get_meta_msg", pp_rank, tp_rank])            one frame
    reply:          [msgpack(NixlHandshakePayload), msgpack(perf_counter())]  two frames

`NixlHandshakePayload` is a map `{compatibility_hash: str, agent_metadata_bytes: bin}`, and
`agent_metadata_bytes` is msgpack of `NixlAgentMetadata`: a map of its 21 fields in declaration
order (msgspec encodes dataclasses as maps and writes every field, defaults too). The encoders
here write exactly those bytes, so an agent can stand in for an engine's side channel.

After a READ the reader notifies the holder with `b"{remote_request_id}:{consumers}"` (the id
exactly as kv_transfer_params carried it; the holder frees the blocks once `consumers`
notifications arrived); `b"HB:id1,id2"` extends a prefill-side lease.

The side channel is unauthenticated, so every decoder here is strict and bounded: frame sizes,
string, bin and list lengths are capped, every field's type and range is checked, and anything
else is an InvalidArgument naming the field, never another exception. A field outside connector
version 14's schema is a NixlIncompatible (a newer vLLM, whose layout this module cannot vouch
for). Consistency across fields (lengths, strides) is kvshuttle.vllm.nixl_layout's check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Final

import msgpack

from kvshuttle.core.errors import FailedPrecondition, InvalidArgument

__all__ = [
    "GET_META_MSG",
    "HEARTBEAT_PREFIX",
    "MAX_HANDSHAKE_BYTES",
    "MAX_NIXL_AGENT_METADATA_BYTES",
    "MAX_REGIONS",
    "ClockOffset",
    "HandshakeReply",
    "Heartbeat",
    "NixlAgentMetadata",
    "NixlHandshakePayload",
    "NixlIncompatible",
    "ReadDone",
    "clock_offset",
    "decode_agent_metadata",
    "decode_get_meta_request",
    "decode_handshake_payload",
    "decode_handshake_reply",
    "decode_notification",
    "encode_agent_metadata",
    "encode_get_meta_request",
    "encode_handshake_payload",
    "encode_handshake_reply",
    "heartbeat_message",
    "read_done_message",
]

GET_META_MSG: Final = b"get_meta_msg"
HEARTBEAT_PREFIX: Final = "HB:"

# Bounds on what a peer may send. A 128-layer model advertises 128 regions and NIXL's agent
# blob is some KiB per registered region; these leave room for that and stop a hostile peer.
MAX_HANDSHAKE_BYTES: Final = 16 << 20  # the payload frame
MAX_NIXL_AGENT_METADATA_BYTES: Final = 8 << 20
MAX_REGIONS: Final = 8192
MAX_STR: Final = 1024
MAX_RANK: Final = 1023
MAX_NOTIFICATION_BYTES: Final = 64 << 10
_MAX_REQUEST_BYTES: Final = 64
_MAX_CLOCK_BYTES: Final = 16
_U64: Final = (1 << 64) - 1


class NixlIncompatible(FailedPrecondition):
    """A NIXL peer this module cannot safely read from or serve; `differences` maps each
    differing property to (expected, found)."""

    def __init__(self, differences: Mapping[str, tuple[str, str]]) -> None:
        detail = "; ".join(f"{k}: expected {want}, got {got}" for k, (want, got) in differences.items())
        super().__init__(f"incompatible NIXL peer: {detail}", metadata={"differs": ",".join(differences)})
        self.differences = dict(differences)


@dataclass(frozen=True, slots=True)
class NixlAgentMetadata:
    """vLLM's NixlAgentMetadata (connector version 14), field for field and in its order."""

    engine_id: str
    agent_metadata: bytes  # NIXL's own agent blob (nixl_agent.get_agent_metadata())
    kv_caches_base_addr: tuple[int, ...]  # one per region
    device_id: int
    num_blocks: int
    block_lens: tuple[int, ...]
    block_strides: tuple[int, ...]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: tuple[int, ...] | None = None
    region_group_ids: tuple[int, ...] | None = None
    region_names: tuple[str, ...] | None = None
    region_mem_types: tuple[str, ...] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: tuple[tuple[str, ...], ...] = ()
    packed_member_layouts: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NixlHandshakePayload:
    compatibility_hash: str
    agent_metadata_bytes: bytes  # encode_agent_metadata's bytes; decode after the hash check


@dataclass(frozen=True, slots=True)
class ClockOffset:
    """The engine's perf_counter minus ours, from one handshake; good to +/- rtt / 2."""

    offset: float
    rtt: float

    def to_local(self, engine_time: float) -> float:
        """An engine perf_counter time (e.g. remote_blocks_expiry_time) on our clock."""
        return engine_time - self.offset

    def to_engine(self, local_time: float) -> float:
        return local_time + self.offset


@dataclass(frozen=True, slots=True)
class HandshakeReply:
    payload: NixlHandshakePayload
    engine_clock: float  # the engine's perf_counter() as it answered


@dataclass(frozen=True, slots=True)
class ReadDone:
    """A reader finished reading `request_id`'s blocks; free them after `consumers` of these."""

    request_id: str
    consumers: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    request_ids: tuple[str, ...]


# -- checked readers of decoded msgpack values -------------------------------------------------


def _unpack(data: object, what: str, limit: int) -> Any:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgument(what, "must be bytes")
    if len(data) > limit:
        raise InvalidArgument(what, f"{len(data)} bytes, more than {limit}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR,
            max_bin_len=limit,
            max_array_len=MAX_REGIONS,
            max_map_len=MAX_REGIONS,
            max_ext_len=0,
        )
    except (ValueError, TypeError) as exc:  # msgpack's errors (and bad UTF-8) are ValueErrors
        raise InvalidArgument(what, f"not msgpack: {type(exc).__name__}") from None


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(where, "must be a string")
    return value


def _bin(value: object, where: str, limit: int) -> bytes:
    if not isinstance(value, bytes) or len(value) > limit:
        raise InvalidArgument(where, f"must be bytes of at most {limit}")
    return value


def _uint(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U64:
        raise InvalidArgument(where, "must be an integer in [0, 2**64)")
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidArgument(where, "must be a list")
    return value


def _uints(value: object, where: str) -> tuple[int, ...]:
    return tuple(_uint(v, f"{where}[{i}]") for i, v in enumerate(_list(value, where)))


def _strs(value: object, where: str) -> tuple[str, ...]:
    return tuple(_str(v, f"{where}[{i}]") for i, v in enumerate(_list(value, where)))


def _pair(value: object, where: str) -> tuple[int, int]:
    items = _uints(value, where)
    if len(items) != 2:
        raise InvalidArgument(where, "must be a pair of integers")
    return items[0], items[1]


def _optional(read: Callable[[object, str], Any]) -> Callable[[object, str], Any]:
    return lambda value, where: None if value is None else read(value, where)


def _members(value: object, where: str) -> tuple[tuple[str, ...], ...]:
    return tuple(_strs(v, f"{where}[{i}]") for i, v in enumerate(_list(value, where)))


def _layouts(value: object, where: str) -> dict[str, tuple[int, int]]:
    if not isinstance(value, dict):
        raise InvalidArgument(where, "must be a map")
    return {_str(k, where): _pair(v, f"{where}.{k}") for k, v in value.items()}


_READERS: Final[Mapping[str, Callable[[object, str], Any]]] = {
    "engine_id": _str,
    "agent_metadata": lambda v, w: _bin(v, w, MAX_NIXL_AGENT_METADATA_BYTES),
    "kv_caches_base_addr": _uints,
    "device_id": _uint,
    "num_blocks": _uint,
    "block_lens": _uints,
    "block_strides": _uints,
    "kv_cache_layout": _str,
    "block_size": _uint,
    "ssm_sizes": _pair,
    "attn_backend_name": _str,
    "physical_blocks_per_logical_kv_block": _uint,
    "region_num_blocks": _optional(_uints),
    "region_group_ids": _optional(_uints),
    "region_names": _optional(_strs),
    "region_mem_types": _optional(_strs),
    "dcp_size": _uint,
    "pcp_size": _uint,
    "ple_block_len": _optional(_uint),
    "region_members": _members,
    "packed_member_layouts": _layouts,
}
_FIELDS: Final = tuple(f.name for f in fields(NixlAgentMetadata))
_REQUIRED: Final = frozenset(
    f.name for f in fields(NixlAgentMetadata) if f.default is MISSING and f.default_factory is MISSING
)


def _map(value: object, where: str, known: Sequence[str], required: frozenset[str]) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InvalidArgument(where, "must be a map with string keys")
    unknown = sorted(set(value) - set(known))
    if unknown:
        # A field connector version 14 lacks: a newer vLLM whose layout may differ.
        raise NixlIncompatible({f"{where} fields": ("only connector version 14's", ", ".join(unknown[:8]))})
    missing = sorted(required - set(value))
    if missing:
        raise InvalidArgument(f"{where}.{missing[0]}", "missing")
    return value


# -- handshake payload and agent metadata ----------------------------------------------------


def _pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def encode_agent_metadata(meta: NixlAgentMetadata) -> bytes:
    """The bytes vLLM's msgspec encoder writes for the same NixlAgentMetadata."""
    value: dict[str, Any] = {}
    for name in _FIELDS:
        item = getattr(meta, name)
        if name == "packed_member_layouts":
            item = dict(item)
        value[name] = item
    return _pack(value)


def decode_agent_metadata(data: bytes) -> NixlAgentMetadata:
    """Raises InvalidArgument (field "agent_metadata.<name>") or NixlIncompatible."""
    raw = _map(_unpack(data, "agent_metadata", MAX_HANDSHAKE_BYTES), "agent_metadata", _FIELDS, _REQUIRED)
    return NixlAgentMetadata(
        **{name: _READERS[name](raw[name], f"agent_metadata.{name}") for name in _FIELDS if name in raw}
    )


_PAYLOAD_FIELDS: Final = ("compatibility_hash", "agent_metadata_bytes")


def encode_handshake_payload(payload: NixlHandshakePayload) -> bytes:
    return _pack(
        {
            "compatibility_hash": payload.compatibility_hash,
            "agent_metadata_bytes": payload.agent_metadata_bytes,
        }
    )


def decode_handshake_payload(data: bytes) -> NixlHandshakePayload:
    raw = _map(
        _unpack(data, "handshake", MAX_HANDSHAKE_BYTES),
        "handshake",
        _PAYLOAD_FIELDS,
        frozenset(_PAYLOAD_FIELDS),
    )
    return NixlHandshakePayload(
        compatibility_hash=_str(raw["compatibility_hash"], "handshake.compatibility_hash"),
        agent_metadata_bytes=_bin(
            raw["agent_metadata_bytes"], "handshake.agent_metadata_bytes", MAX_HANDSHAKE_BYTES
        ),
    )


# -- framing -----------------------------------------------------------------------------------


def _rank(value: object, where: str) -> int:
    rank = _uint(value, where)
    if rank > MAX_RANK:
        raise InvalidArgument(where, f"must be at most {MAX_RANK}")
    return rank


def encode_get_meta_request(pp_rank: int = 0, tp_rank: int = 0) -> bytes:
    """The REQ frame asking the side channel for (pp_rank, tp_rank)'s handshake payload.

    Ask only for a rank the engine has: vLLM's listener looks the pair up unguarded, and a
    missing one ends its listener thread (no more handshakes until the engine restarts)."""
    return _pack([GET_META_MSG, _rank(pp_rank, "pp_rank"), _rank(tp_rank, "tp_rank")])


def decode_get_meta_request(data: bytes) -> tuple[int, int]:
    """(pp_rank, tp_rank) of a get_meta request, for a side channel an agent serves."""
    raw = _list(_unpack(data, "get_meta", _MAX_REQUEST_BYTES), "get_meta")
    if len(raw) != 3 or raw[0] != GET_META_MSG:
        raise InvalidArgument("get_meta", "must be [b'get_meta_msg', pp_rank, tp_rank]")
    return _rank(raw[1], "get_meta.pp_rank"), _rank(raw[2], "get_meta.tp_rank")


def encode_handshake_reply(payload: bytes, engine_clock: float) -> list[bytes]:
    """The reply frames (after the ROUTER's identity and empty delimiter): the encoded payload,
    then the answering process's perf_counter() for the reader's clock offset."""
    return [payload, _pack(float(engine_clock))]


def decode_handshake_reply(frames: Sequence[bytes]) -> HandshakeReply:
    """The two reply frames a REQ socket receives. The payload's agent metadata stays encoded:
    check the compatibility hash before decoding it, as vLLM does."""
    if len(frames) != 2:
        raise InvalidArgument("handshake_reply", f"{len(frames)} frames, expected 2")
    clock = _unpack(frames[1], "handshake_reply.clock", _MAX_CLOCK_BYTES)
    if isinstance(clock, bool) or not isinstance(clock, float | int) or not math.isfinite(clock):
        raise InvalidArgument("handshake_reply.clock", "must be a finite number")
    return HandshakeReply(payload=decode_handshake_payload(frames[0]), engine_clock=float(clock))


def clock_offset(sent_at: float, received_at: float, engine_clock: float) -> ClockOffset:
    """vLLM's estimate: the engine stamped its clock midway through our round trip."""
    if not received_at >= sent_at:
        raise InvalidArgument("received_at", "must not precede sent_at")
    return ClockOffset(offset=engine_clock - (sent_at + received_at) / 2, rtt=received_at - sent_at)


# -- notifications -----------------------------------------------------------------------------


def _request_id(value: str, where: str) -> str:
    if not value or len(value) > MAX_STR:
        raise InvalidArgument(where, f"must be 1..{MAX_STR} characters")
    return value


def read_done_message(remote_request_id: str, consumers: int = 1) -> bytes:
    """The notification that frees the holder's blocks once `consumers` readers sent it."""
    if isinstance(consumers, bool) or not isinstance(consumers, int) or consumers < 1:
        raise InvalidArgument("consumers", "must be a positive integer")
    if _request_id(remote_request_id, "remote_request_id").startswith(HEARTBEAT_PREFIX):
        raise InvalidArgument(
            "remote_request_id", f"the holder would read {HEARTBEAT_PREFIX!r}... as a heartbeat"
        )
    return f"{remote_request_id}:{consumers}".encode()


def heartbeat_message(request_ids: Sequence[str]) -> bytes:
    """Extends the holder's lease on each of `request_ids` (the holder splits them on ",")."""
    if not request_ids:
        raise InvalidArgument("request_ids", "must not be empty")
    for i, rid in enumerate(request_ids):
        if "," in _request_id(rid, f"request_ids[{i}]"):
            raise InvalidArgument(f"request_ids[{i}]", "must not contain ','")
    return (HEARTBEAT_PREFIX + ",".join(request_ids)).encode()


def decode_notification(message: bytes) -> ReadDone | Heartbeat:
    """A NIXL notification as vLLM's holder reads it: a heartbeat, else `id:consumers` split at
    the last colon (ids may contain colons)."""
    if len(message) > MAX_NOTIFICATION_BYTES:
        raise InvalidArgument("notification", f"more than {MAX_NOTIFICATION_BYTES} bytes")
    try:
        text = bytes(message).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument("notification", "not UTF-8") from None
    if text.startswith(HEARTBEAT_PREFIX):
        ids = text[len(HEARTBEAT_PREFIX) :].split(",")
        return Heartbeat(tuple(_request_id(r, "notification.request_ids") for r in ids))
    rid, sep, consumers = text.rpartition(":")
    # At most 9 digits: int() of a long digit string is slow, and past 4300 digits an error.
    if (
        not sep
        or not (consumers.isascii() and consumers.isdigit() and len(consumers) <= 9)
        or int(consumers) < 1
    ):
        raise InvalidArgument("notification", "must be 'HB:ids' or 'request_id:consumers'")
    return ReadDone(request_id=_request_id(rid, "notification.request_id"), consumers=int(consumers))
