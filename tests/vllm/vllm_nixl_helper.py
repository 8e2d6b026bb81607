"""Run with the vLLM venv's python: vLLM's own NIXL structs against kvshuttle's bytes.

    vllm_nixl_helper.py IN.json OUT.json

IN: {"metadata": [{"fields": {...}, "ours": hex}], "payloads": [{"fields": {...}, "ours": hex}],
"requests": [[pp, tp]], "factors": [{...}]}; bytes fields are hex strings. OUT: vLLM's
encoding of each case, whether vLLM's decoder read ours back equal, vLLM's compatibility hash
of each factor set, and the versions installed. Imports nothing of kvshuttle (the vLLM venv has
no msgpack), and writes a file, not stdout (vLLM logs there).
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

_BYTES = ("agent_metadata", "agent_metadata_bytes")
_TUPLES = ("ssm_sizes",)


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    for name in _BYTES:
        if name in out:
            out[name] = bytes.fromhex(out[name])
    for name in _TUPLES:
        if name in out:
            out[name] = tuple(out[name])
    if "packed_member_layouts" in out:
        out["packed_member_layouts"] = {k: tuple(v) for k, v in out["packed_member_layouts"].items()}
    return out


def _vllm_config(f: dict[str, Any]) -> Any:
    """The attributes compute_nixl_compatibility_hash reads, and nothing else."""
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=f["model"],
            dtype=f["dtype"],
            get_total_num_kv_heads=lambda: f["num_kv_heads"],
            get_head_size=lambda: f["head_size"],
            get_total_num_hidden_layers=lambda: f["num_hidden_layers"],
        ),
        cache_config=SimpleNamespace(cache_dtype=f["cache_dtype"]),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=not f["is_hma_enabled"]),
        speculative_config=None,
    )


def main(src: str, dst: str) -> None:
    import msgspec  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415
        metadata as nixl_metadata,
    )

    from vllm import __version__ as vllm_version  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415

    cases = json.loads(Path(src).read_text())
    agent_decoder = msgspec.msgpack.Decoder(nixl_metadata.NixlAgentMetadata)
    payload_decoder = msgspec.msgpack.Decoder(nixl_metadata.NixlHandshakePayload)

    def run(cls: Any, decoder: Any, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        results = []
        for case in items:
            theirs = cls(**_fields(case["fields"]))
            try:
                ok = decoder.decode(bytes.fromhex(case["ours"])) == theirs
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                ok = f"{type(exc).__name__}: {exc}"
            results.append({"vllm": msgspec.msgpack.encode(theirs).hex(), "decoded_equal": ok})
        return results

    out = {
        "vllm_version": vllm_version,
        "nixl_version": metadata.version("nixl"),
        "connector_version": nixl_metadata.NIXL_CONNECTOR_VERSION,
        "get_meta_msg": nixl_metadata.GET_META_MSG.hex(),
        "metadata": run(nixl_metadata.NixlAgentMetadata, agent_decoder, cases["metadata"]),
        "payloads": run(nixl_metadata.NixlHandshakePayload, payload_decoder, cases["payloads"]),
        # The request as vLLM's handshake client encodes it, and the listener's decode of ours.
        "requests": [
            {
                "vllm": msgspec.msgpack.encode((nixl_metadata.GET_META_MSG, pp, tp)).hex(),
                "listener_reads_ours": list(msgspec.msgpack.decode(bytes.fromhex(ours)))
                == [nixl_metadata.GET_META_MSG, pp, tp],
            }
            for pp, tp, ours in cases["requests"]
        ],
        # The listener's clock frame, decoded back as vLLM's client does.
        "clock": [
            {
                "vllm": msgspec.msgpack.encode(t).hex(),
                "client_reads_ours": msgspec.msgpack.decode(bytes.fromhex(ours)) == t,
            }
            for t, ours in cases["clock"]
        ],
        "hashes": [
            nixl_metadata.compute_nixl_compatibility_hash(
                _vllm_config(f), f["attn_backend_name"], transfer_mode=f["transfer_mode"]
            )
            for f in cases["factors"]
        ],
    }
    Path(dst).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
