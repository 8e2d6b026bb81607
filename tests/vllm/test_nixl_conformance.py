"""kvshuttle.vllm.nixl_wire against vLLM's own NIXL structs (the vLLM venv's msgspec).

One run of vllm_nixl_helper.py (importing vLLM takes ~30 s) encodes every case with vLLM's
NixlAgentMetadata / NixlHandshakePayload and decodes ours with vLLM's decoders; the test checks
that the bytes are equal both ways, that our decoder reads vLLM's bytes back to the same
values, that vLLM's compatibility hash equals ours, and that the installed versions are the
pinned ones. Skipped, saying how to install it, without the vLLM venv.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from deploy.local.vllm_venv import VllmNotInstalled, vllm_python

from kvshuttle.vllm.nixl_compat import (
    NIXL_CONNECTOR_VERSION,
    NIXL_VERSION,
    VLLM_VERSION,
    CompatibilityFactors,
    compatibility_hash,
)
from kvshuttle.vllm.nixl_wire import (
    GET_META_MSG,
    NixlAgentMetadata,
    NixlHandshakePayload,
    decode_agent_metadata,
    decode_handshake_payload,
    encode_agent_metadata,
    encode_get_meta_request,
    encode_handshake_payload,
    encode_handshake_reply,
)

pytestmark = pytest.mark.vllm

HELPER = Path(__file__).with_name("vllm_nixl_helper.py")
U64 = (1 << 64) - 1


def _metadata_cases() -> list[NixlAgentMetadata]:
    rnd = random.Random(11)
    cases = [
        NixlAgentMetadata(  # what the CPU build advertises for the tiny model (2 layers)
            engine_id="decode-0a1b2c3d",
            agent_metadata=bytes(range(256)) * 3,
            kv_caches_base_addr=(0x7F00_0000_0000, 0x7F00_1000_0000),
            device_id=0,
            num_blocks=1024,
            block_lens=(16384, 16384),
            block_strides=(16384, 16384),
            kv_cache_layout="LBHNC",
            block_size=32,
            ssm_sizes=(0, 0),
            attn_backend_name="CPU_ATTN",
            physical_blocks_per_logical_kv_block=1,
            region_num_blocks=(1024, 1024),
            region_group_ids=(0, 0),
            region_names=("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"),
            region_mem_types=("DRAM", "DRAM"),
        ),
        NixlAgentMetadata(  # every optional unset, extremes of every integer
            engine_id="",
            agent_metadata=b"",
            kv_caches_base_addr=(U64, 0),
            device_id=U64,
            num_blocks=0,
            block_lens=(),
            block_strides=(1 << 32,),
            kv_cache_layout="é" * 40,
            block_size=(1 << 16) + 1,
            ssm_sizes=(U64, 255),
            attn_backend_name="x" * 300,
            physical_blocks_per_logical_kv_block=127,
            dcp_size=128,
            pcp_size=65536,
            ple_block_len=1 << 31,
            region_members=(("a", "b"), ()),
            packed_member_layouts={"k": (0, 4096), "v": (4096, U64)},
        ),
    ]
    for n in (1, 15, 16, 17, 70):  # fixarray / array16 boundaries
        cases.append(
            NixlAgentMetadata(
                engine_id=f"e{n}",
                agent_metadata=rnd.randbytes(rnd.choice((31, 32, 255, 256, 70000))),
                kv_caches_base_addr=tuple(rnd.randrange(1 << 48) for _ in range(n)),
                device_id=rnd.randrange(8),
                num_blocks=rnd.randrange(1, 1 << 20),
                block_lens=tuple(rnd.choice((127, 128, 65535, 65536, 1 << 32)) for _ in range(n)),
                block_strides=tuple(rnd.randrange(1 << 40) for _ in range(n)),
                kv_cache_layout="LBNHC",
                block_size=16,
                ssm_sizes=(0, 0),
                attn_backend_name="FLASH_ATTN",
                physical_blocks_per_logical_kv_block=1,
                region_num_blocks=tuple(rnd.randrange(1 << 33) for _ in range(n)),
                region_group_ids=None if n % 2 else tuple(rnd.randrange(3) for _ in range(n)),
                region_names=tuple(f"layers.{i}" for i in range(n)),
                region_mem_types=("VRAM",) * n,
                region_members=tuple((f"layers.{i}",) for i in range(n)),
            )
        )
    return cases


def _json_fields(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, bytes):
            value = value.hex()
        elif isinstance(value, tuple):
            value = [list(v) if isinstance(v, tuple) else v for v in value]
        elif f.name == "packed_member_layouts":
            value = {k: list(v) for k, v in value.items()}
        out[f.name] = value
    return out


FACTORS = [
    CompatibilityFactors(
        model="/work/main/.run/models/tiny",
        dtype="torch.float32",
        num_kv_heads=2,
        head_size=32,
        num_hidden_layers=2,
        attn_backend_name="CPU_ATTN",
    ),
    CompatibilityFactors(
        model="Qwen/Qwen3-32B",
        dtype="torch.bfloat16",
        num_kv_heads=8,
        head_size=128,
        num_hidden_layers=64,
        attn_backend_name="FLASH_ATTN",
        cache_dtype="fp8",
        is_hma_enabled=False,
        transfer_mode="push",
    ),
]
CLOCKS = [0.0, 1.5, 12345.678901234, 1e-9, 3.0e7]


@pytest.fixture(scope="module")
def vllm_side(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    try:
        python = vllm_python()
    except VllmNotInstalled as exc:
        if os.environ.get("KVSHUTTLE_REQUIRE_VLLM"):
            pytest.fail(f"KVSHUTTLE_REQUIRE_VLLM is set: {exc}")
        pytest.skip(str(exc))
    metas = _metadata_cases()
    payloads = [
        NixlHandshakePayload("0" * 64, encode_agent_metadata(metas[0])),
        NixlHandshakePayload("", b""),
        NixlHandshakePayload("h" * 300, bytes(70000)),
    ]
    cases = {
        "metadata": [{"fields": _json_fields(m), "ours": encode_agent_metadata(m).hex()} for m in metas],
        "payloads": [
            {"fields": _json_fields(p), "ours": encode_handshake_payload(p).hex()} for p in payloads
        ],
        "requests": [
            [pp, tp, encode_get_meta_request(pp, tp).hex()] for pp, tp in ((0, 0), (1, 7), (3, 200))
        ],
        "clock": [[t, encode_handshake_reply(b"", t)[1].hex()] for t in CLOCKS],
        "factors": [dataclasses.asdict(f) for f in FACTORS],
    }
    tmp = tmp_path_factory.mktemp("nixl-conformance")
    (tmp / "in.json").write_text(json.dumps(cases))
    subprocess.run(
        [str(python), str(HELPER), str(tmp / "in.json"), str(tmp / "out.json")],
        check=True,
        timeout=300,
        capture_output=True,
    )
    out: dict[str, Any] = json.loads((tmp / "out.json").read_text())
    out["cases"] = {"metadata": metas, "payloads": payloads}
    return out


def test_the_installed_vllm_is_the_pinned_one(vllm_side: dict[str, Any]) -> None:
    assert vllm_side["vllm_version"] == VLLM_VERSION
    assert vllm_side["nixl_version"] == NIXL_VERSION
    assert vllm_side["connector_version"] == NIXL_CONNECTOR_VERSION
    assert bytes.fromhex(vllm_side["get_meta_msg"]) == GET_META_MSG


def test_agent_metadata_bytes_equal_vllms_both_ways(vllm_side: dict[str, Any]) -> None:
    for meta, result in zip(vllm_side["cases"]["metadata"], vllm_side["metadata"], strict=True):
        assert result["decoded_equal"] is True, (meta.engine_id, result["decoded_equal"])
        assert bytes.fromhex(result["vllm"]) == encode_agent_metadata(meta), meta.engine_id
        assert decode_agent_metadata(bytes.fromhex(result["vllm"])) == meta


def test_handshake_payload_bytes_equal_vllms_both_ways(vllm_side: dict[str, Any]) -> None:
    for payload, result in zip(vllm_side["cases"]["payloads"], vllm_side["payloads"], strict=True):
        assert result["decoded_equal"] is True, result["decoded_equal"]
        assert bytes.fromhex(result["vllm"]) == encode_handshake_payload(payload)
        assert decode_handshake_payload(bytes.fromhex(result["vllm"])) == payload


def test_request_and_clock_frames_equal_vllms(vllm_side: dict[str, Any]) -> None:
    for (pp, tp), result in zip(((0, 0), (1, 7), (3, 200)), vllm_side["requests"], strict=True):
        assert result["listener_reads_ours"] is True
        assert bytes.fromhex(result["vllm"]) == encode_get_meta_request(pp, tp)
    for t, result in zip(CLOCKS, vllm_side["clock"], strict=True):
        assert result["client_reads_ours"] is True
        assert bytes.fromhex(result["vllm"]) == encode_handshake_reply(b"", t)[1]


def test_compatibility_hash_equals_vllms(vllm_side: dict[str, Any]) -> None:
    assert vllm_side["hashes"] == [compatibility_hash(f) for f in FACTORS]
    assert len(set(vllm_side["hashes"])) == len(FACTORS)
