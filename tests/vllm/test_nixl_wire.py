"""kvshuttle.vllm.nixl_wire, nixl_layout and nixl_compat without vLLM: round trips, hostile
bytes, descriptor math, the compatibility check. Conformance with vLLM's own structs is
test_nixl_conformance.py."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.vllm.nixl_samples import HASH, META

from kvshuttle.core.errors import FailedPrecondition, InvalidArgument
from kvshuttle.vllm.nixl_compat import CompatibilityFactors, Expected, check_compatible, compatibility_hash
from kvshuttle.vllm.nixl_layout import RemoteLayout
from kvshuttle.vllm.nixl_wire import (
    MAX_HANDSHAKE_BYTES,
    ClockOffset,
    Heartbeat,
    NixlAgentMetadata,
    NixlHandshakePayload,
    NixlIncompatible,
    ReadDone,
    clock_offset,
    decode_agent_metadata,
    decode_get_meta_request,
    decode_handshake_payload,
    decode_handshake_reply,
    decode_notification,
    encode_agent_metadata,
    encode_get_meta_request,
    encode_handshake_payload,
    encode_handshake_reply,
    heartbeat_message,
    read_done_message,
)


def _raw(meta: NixlAgentMetadata = META) -> dict[str, Any]:
    raw: dict[str, Any] = msgpack.unpackb(encode_agent_metadata(meta), raw=False)
    return raw


def _pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


# -- codec -------------------------------------------------------------------------------------


def test_agent_metadata_is_a_map_of_every_field_in_vllms_order() -> None:
    raw = _raw()
    assert list(raw) == [f.name for f in dataclasses.fields(NixlAgentMetadata)]
    assert raw["ssm_sizes"] == [0, 0] and raw["dcp_size"] == 1 and raw["packed_member_layouts"] == {}
    assert decode_agent_metadata(encode_agent_metadata(META)) == META


def test_defaulted_fields_may_be_absent_as_msgspec_allows() -> None:
    raw = _raw()
    for name in ("region_num_blocks", "dcp_size", "ple_block_len", "region_members", "packed_member_layouts"):
        del raw[name]
    meta = decode_agent_metadata(_pack(raw))
    assert meta.region_num_blocks is None and meta.dcp_size == 1 and meta.packed_member_layouts == {}


def test_handshake_reply_round_trip_and_clock_offset() -> None:
    payload = NixlHandshakePayload(HASH, encode_agent_metadata(META))
    frames = encode_handshake_reply(encode_handshake_payload(payload), 1000.25)
    reply = decode_handshake_reply(frames)
    assert reply.payload == payload and reply.engine_clock == 1000.25
    offset = clock_offset(sent_at=10.0, received_at=10.5, engine_clock=reply.engine_clock)
    assert offset == ClockOffset(offset=1000.25 - 10.25, rtt=0.5)
    assert offset.to_local(1480.25) == 490.25  # an engine expiry time on our clock
    assert offset.to_engine(offset.to_local(5.0)) == 5.0


def test_get_meta_request_frame() -> None:
    assert encode_get_meta_request() == b"\x93\xc4\x0cget_meta_msg\x00\x00"
    assert decode_get_meta_request(encode_get_meta_request(2, 5)) == (2, 5)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (_pack(["get_meta_msg", 0, 0]), "get_meta"),  # str, not bin
        (_pack([b"get_meta_msg", 0]), "get_meta"),
        (_pack([b"get_meta_msg", -1, 0]), "get_meta.pp_rank"),
        (_pack([b"get_meta_msg", 0, 5000]), "get_meta.tp_rank"),
        (_pack([b"get_meta_msg", 0, True]), "get_meta.tp_rank"),
        (_pack({"a": 1}), "get_meta"),
        (b"\x93\xc4", "get_meta"),
        (bytes(100), "get_meta"),
    ],
)
def test_bad_get_meta_requests(data: bytes, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        decode_get_meta_request(data)
    assert e.value.field == field


def _with(**changes: Any) -> bytes:
    raw = _raw()
    raw.update(changes)
    return _pack(raw)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"", "agent_metadata"),
        (b"\xc1", "agent_metadata"),  # never-used msgpack byte
        (_pack([1, 2]), "agent_metadata"),
        (_pack({1: 2}), "agent_metadata"),
        (_with(engine_id=5), "agent_metadata.engine_id"),
        (_with(agent_metadata="text"), "agent_metadata.agent_metadata"),
        (_with(num_blocks=-1), "agent_metadata.num_blocks"),
        (_with(num_blocks=1.0), "agent_metadata.num_blocks"),
        (_with(block_size=True), "agent_metadata.block_size"),
        (_with(block_lens=[1, "2"]), "agent_metadata.block_lens[1]"),
        (_with(block_lens=7), "agent_metadata.block_lens"),
        (_with(ssm_sizes=[0, 0, 0]), "agent_metadata.ssm_sizes"),
        (_with(region_names=[None]), "agent_metadata.region_names[0]"),
        (_with(region_members=[["a", 1]]), "agent_metadata.region_members[0][1]"),
        (_with(packed_member_layouts={"k": [1]}), "agent_metadata.packed_member_layouts.k"),
        (_with(packed_member_layouts=[]), "agent_metadata.packed_member_layouts"),
        (_with(engine_id="x" * 5000), "agent_metadata"),  # over the string cap
        (_with(block_lens=list(range(9000))), "agent_metadata"),  # over the list cap
        (_with(agent_metadata=msgpack.ExtType(5, b"x")), "agent_metadata"),
        (b"\x91" * 5000 + b"\x00", "agent_metadata"),  # nested past msgpack's stack
        (
            _with(engine_id=b"\xff".decode("latin-1")).replace(b"\xc3\xbf", b"\xff\xfe"),
            "agent_metadata",
        ),  # bad UTF-8
    ],
)
def test_bad_agent_metadata(data: bytes, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        decode_agent_metadata(data)
    assert e.value.field == field


def test_missing_required_field() -> None:
    raw = _raw()
    del raw["block_strides"]
    with pytest.raises(InvalidArgument) as e:
        decode_agent_metadata(_pack(raw))
    assert e.value.field == "agent_metadata.block_strides"


def test_a_field_connector_version_14_lacks_is_incompatible() -> None:
    with pytest.raises(NixlIncompatible) as e:
        decode_agent_metadata(_with(kv_layout_v15="x"))
    assert "kv_layout_v15" in e.value.message
    assert isinstance(e.value, FailedPrecondition)


def test_bad_handshake_frames() -> None:
    good = encode_handshake_payload(NixlHandshakePayload(HASH, b"m"))
    for frames, field in [
        ([good], "handshake_reply"),
        ([good, _pack(1.0), b""], "handshake_reply"),
        ([good, _pack("1.0")], "handshake_reply.clock"),
        ([good, _pack(float("nan"))], "handshake_reply.clock"),
        ([good, bytes(20)], "handshake_reply.clock"),
        ([_pack({"compatibility_hash": HASH}), _pack(1.0)], "handshake.agent_metadata_bytes"),
        (
            [_pack({"compatibility_hash": b"h", "agent_metadata_bytes": b""}), _pack(1.0)],
            "handshake.compatibility_hash",
        ),
        ([bytes(MAX_HANDSHAKE_BYTES + 1), _pack(1.0)], "handshake"),
    ]:
        with pytest.raises(InvalidArgument) as e:
            decode_handshake_reply(frames)
        assert e.value.field == field


def test_clock_offset_needs_ordered_times() -> None:
    with pytest.raises(InvalidArgument):
        clock_offset(2.0, 1.0, 5.0)
    with pytest.raises(InvalidArgument):
        clock_offset(float("nan"), 1.0, 5.0)


# -- notifications -----------------------------------------------------------------------------


def test_notifications_as_vllm_writes_and_reads_them() -> None:
    assert read_done_message("cmpl-9:x-0", 2) == b"cmpl-9:x-0:2"
    assert decode_notification(b"cmpl-9:x-0:2") == ReadDone("cmpl-9:x-0", 2)
    assert heartbeat_message(["a", "b:c"]) == b"HB:a,b:c"
    assert decode_notification(b"HB:a,b:c") == Heartbeat(("a", "b:c"))
    for bad in (
        b"no-colon",
        b"id:0",
        b"id:-1",
        b"id:",
        b":1",
        b"HB:",
        b"HB:a,,b",
        b"\xff:1",
        b"id:" + b"9" * 20,
    ):
        with pytest.raises(InvalidArgument):
            decode_notification(bad)
    with pytest.raises(InvalidArgument):
        read_done_message("", 1)
    with pytest.raises(InvalidArgument):
        read_done_message("a", 0)
    with pytest.raises(InvalidArgument):
        read_done_message("HB:parked-1", 1)
    with pytest.raises(InvalidArgument):
        heartbeat_message([])
    with pytest.raises(InvalidArgument) as e:
        heartbeat_message(["a,b"])
    assert e.value.field == "request_ids[0]"


# -- descriptor math ---------------------------------------------------------------------------


def test_descriptors_and_indices_follow_vllm() -> None:
    layout = RemoteLayout.of(META)
    assert layout.num_descriptors == 14 and layout.bytes_per_block == 8192 and layout.mem_type == "DRAM"
    assert layout.index(0, 3) == 3 and layout.index(1, 0) == 8 and layout.index(1, 5) == 13
    assert layout.descriptor(0, 3) == (0x1000_0000 + 3 * 8192, 4096, 0)
    assert layout.byte_range(1, 2) == (0x2000_0000 + 2 * 4096, 0x2000_0000 + 3 * 4096)
    assert layout.indices([2, 5]) == [2, 5, 10, 13]  # region-major
    table = layout.all_descriptors()
    assert table.dtype == np.uint64 and table.shape == (14, 3)
    for i, b in [(0, 0), (0, 7), (1, 0), (1, 5)]:
        assert tuple(int(x) for x in table[layout.index(i, b)]) == layout.descriptor(i, b)
    assert layout.descriptors([2, 5]) == [tuple(int(x) for x in table[j]) for j in layout.indices([2, 5])]


def test_num_blocks_stands_in_for_absent_region_counts() -> None:
    layout = RemoteLayout.of(dataclasses.replace(META, region_num_blocks=None))
    assert [r.num_blocks for r in layout.regions] == [8, 8] and layout.index(1, 0) == 8


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kv_caches_base_addr": ()}, "agent_metadata.kv_caches_base_addr"),
        ({"block_lens": (4096,)}, "agent_metadata.block_lens"),
        ({"region_names": ("a",)}, "agent_metadata.region_names"),
        ({"block_strides": (8192, 1024)}, "agent_metadata.block_strides[1]"),
        ({"block_lens": (0, 4096)}, "agent_metadata.block_lens[0]"),
        ({"region_num_blocks": (8, 0)}, "agent_metadata.block_lens[1]"),
        ({"kv_caches_base_addr": (0, (1 << 64) - 4096)}, "agent_metadata.kv_caches_base_addr[1]"),
        ({"region_mem_types": ("DRAM", "VRAM")}, "agent_metadata.region_mem_types"),
        ({"region_num_blocks": (1 << 40, 1)}, "agent_metadata.region_num_blocks"),
    ],
)
def test_inconsistent_layouts(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        RemoteLayout.of(dataclasses.replace(META, **changes))
    assert e.value.field == field


def test_block_ids_outside_a_region() -> None:
    layout = RemoteLayout.of(META)
    for region, block in [(1, 6), (0, -1), (2, 0)]:
        with pytest.raises(InvalidArgument):
            layout.descriptor(region, block)
    with pytest.raises(InvalidArgument):
        layout.indices([7])  # in region 0, past region 1's 6 blocks


# -- compatibility -----------------------------------------------------------------------------


def _payload(h: str = HASH) -> NixlHandshakePayload:
    return NixlHandshakePayload(h, encode_agent_metadata(META))


def test_a_matching_engine_passes() -> None:
    expected = Expected(
        block_size=32,
        vllm_version="0.32.0",
        nixl_version="1.5.1",
        compatibility_hash=HASH,
        engine_id="decode-1",
    )
    check_compatible(_payload(), META, expected)
    check_compatible(_payload(), META, Expected(block_size=32))


def test_every_difference_is_named() -> None:
    meta = dataclasses.replace(
        META, block_size=16, kv_cache_layout="BLNHC", dcp_size=2, region_group_ids=(0, 1), ssm_sizes=(4, 4)
    )
    expected = Expected(
        block_size=32, vllm_version="0.33.0", nixl_version="1.4.0", compatibility_hash="cd" * 32
    )
    with pytest.raises(NixlIncompatible) as e:
        check_compatible(_payload(), meta, expected)
    assert set(e.value.differences) == {
        "vllm_version",
        "nixl_version",
        "compatibility_hash",
        "block_size",
        "kv_cache_layout",
        "dcp_size",
        "region_group_ids",
        "ssm_sizes",
    }
    assert e.value.differences["block_size"] == ("32", "16")
    assert "vllm_version: expected 0.32.0, got 0.33.0" in e.value.message
    assert e.value.metadata["differs"].startswith("vllm_version,nixl_version")


def test_an_expected_layout_is_compared_exactly() -> None:
    with pytest.raises(NixlIncompatible) as e:
        check_compatible(
            _payload(), META, Expected(block_size=32, kv_cache_layout="LBNHC", engine_id="other")
        )
    assert set(e.value.differences) == {"kv_cache_layout", "engine_id"}


def test_compatibility_hash_changes_with_each_factor() -> None:
    base = CompatibilityFactors(
        model="m",
        dtype="torch.float32",
        num_kv_heads=2,
        head_size=32,
        num_hidden_layers=2,
        attn_backend_name="A",
    )
    variants = [
        base,
        dataclasses.replace(base, vllm_version="0.33.0"),
        dataclasses.replace(base, nixl_connector_version=15),
        dataclasses.replace(base, transfer_mode="push"),
        dataclasses.replace(base, cache_dtype="fp8"),
    ]
    hashes = {compatibility_hash(f) for f in variants}
    assert len(hashes) == len(variants) and all(len(h) == 64 for h in hashes)


# -- fuzz --------------------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_field_names = st.sampled_from([f.name for f in dataclasses.fields(NixlAgentMetadata)])


@st.composite
def _near_valid(draw: st.DrawFn) -> bytes:
    raw = _raw()
    for _ in range(draw(st.integers(1, 3))):
        name = draw(_field_names)
        if draw(st.booleans()):
            raw[name] = draw(_values)
        else:
            raw.pop(name, None)
    return _pack(raw)


@given(data=st.one_of(st.binary(max_size=256), _near_valid(), _values.map(_pack)))
@settings(max_examples=400, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
def test_decoders_raise_only_domain_errors(data: bytes) -> None:
    for decode in (
        decode_agent_metadata,
        decode_handshake_payload,
        decode_get_meta_request,
        decode_notification,
    ):
        with contextlib.suppress(InvalidArgument, NixlIncompatible):
            decode(data)
    try:
        meta = decode_agent_metadata(data)
    except (InvalidArgument, NixlIncompatible):
        return
    assert decode_agent_metadata(encode_agent_metadata(meta)) == meta
    try:
        layout = RemoteLayout.of(meta)
    except InvalidArgument:
        return
    if layout.num_descriptors <= 4096:  # a valid advertisement may be large: only small ones here
        assert layout.all_descriptors().shape == (layout.num_descriptors, 3)


@given(frames=st.lists(st.one_of(st.binary(max_size=64), _values.map(_pack)), max_size=3))
@settings(max_examples=200, derandomize=True)
def test_reply_decoder_raises_only_domain_errors(frames: list[bytes]) -> None:
    with contextlib.suppress(InvalidArgument, NixlIncompatible):
        decode_handshake_reply(frames)
