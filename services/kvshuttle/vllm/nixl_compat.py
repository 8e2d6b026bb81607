"""The vLLM and NIXL versions kvshuttle's NIXL side channel speaks, and the check that refuses
any other engine, clearly, before a single byte is read.

vLLM's handshake carries no version. It carries a compatibility hash: SHA-256 of the sorted
JSON of the factors below (vLLM 0.32's `compute_nixl_compatibility_hash`), which includes the
vLLM version and the NIXL connector version. `compatibility_hash(factors)` computes it for
the pinned versions, so a peer whose hash differs runs another vLLM, connector version, model,
dtype, attention backend or transfer mode. Block size, KV cache layout and parallelism are not
in the hash (vLLM checks them at run time); `check_compatible` checks those, and refuses every
layout kvshuttle.vllm.nixl_layout does not model (hybrid, Mamba, split blocks, DCP/PCP).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from kvshuttle.vllm.nixl_wire import NixlAgentMetadata, NixlHandshakePayload, NixlIncompatible

__all__ = [
    "NIXL_CONNECTOR_VERSION",
    "NIXL_VERSION",
    "SUPPORTED_KV_CACHE_LAYOUTS",
    "VLLM_VERSION",
    "CompatibilityFactors",
    "Expected",
    "check_compatible",
    "compatibility_hash",
]

VLLM_VERSION: Final = "0.32.0"
NIXL_VERSION: Final = "1.5.1"
NIXL_CONNECTOR_VERSION: Final = 14  # vllm...nixl.metadata.NIXL_CONNECTOR_VERSION in 0.32.0
# vLLM's KVCacheLayout names with the layer outermost (one region per layer, blocks whole in
# it): the CPU build's CPU_ATTN uses LBHNC, GPU flash attention LBNHC. Block-outermost layouts
# pack layers into one region (packed_member_layouts), which nixl_layout does not model.
SUPPORTED_KV_CACHE_LAYOUTS: Final = frozenset({"LBHNC", "LBNHC"})


@dataclass(frozen=True, slots=True)
class CompatibilityFactors:
    """What vLLM hashes, as vLLM renders it: `model` is the --model argument as the engine
    resolved it, `dtype` e.g. "torch.float32", `cache_dtype` e.g. "auto"."""

    model: str
    dtype: str
    num_kv_heads: int  # total, over every TP rank
    head_size: int
    num_hidden_layers: int
    attn_backend_name: str  # also in the engine's NixlAgentMetadata
    cache_dtype: str = "auto"
    # Not --disable-hybrid-kv-cache-manager: vLLM 0.32 hashes True for a plain Llama too.
    is_hma_enabled: bool = True
    transfer_mode: str = "pull"
    vllm_version: str = VLLM_VERSION
    nixl_connector_version: int = NIXL_CONNECTOR_VERSION


def compatibility_hash(f: CompatibilityFactors) -> str:
    """vLLM's compatibility hash of an engine with these factors (no speculative decoding)."""
    factors = {
        "vllm_version": f.vllm_version,
        "nixl_connector_version": f.nixl_connector_version,
        "model": f.model,
        "dtype": f.dtype,
        "num_kv_heads": f.num_kv_heads,
        "head_size": f.head_size,
        "num_hidden_layers": f.num_hidden_layers,
        "attn_backend_name": f.attn_backend_name,
        "cache_dtype": f.cache_dtype,
        "is_hma_enabled": f.is_hma_enabled,
        "speculative_config": None,
        "transfer_mode": f.transfer_mode,
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Expected:
    """What the agent knows of its engine; None: not checked (not known)."""

    block_size: int  # the agent's configured block size (tokens)
    vllm_version: str | None = None  # the engine's, as its GET /version reports it
    nixl_version: str | None = None  # the NIXL package the agent reads with
    compatibility_hash: str | None = None  # compatibility_hash(factors), or a peer's
    engine_id: str | None = None
    kv_cache_layout: str | None = None  # None: any of SUPPORTED_KV_CACHE_LAYOUTS


def _differences(
    payload: NixlHandshakePayload, meta: NixlAgentMetadata, want: Expected
) -> dict[str, tuple[str, str]]:
    d: dict[str, tuple[str, str]] = {}

    def differ(name: str, expected: object, found: object) -> None:
        if expected != found:
            d[name] = (str(expected), str(found))

    if want.vllm_version is not None:
        differ("vllm_version", VLLM_VERSION, want.vllm_version)
    if want.nixl_version is not None:
        differ("nixl_version", NIXL_VERSION, want.nixl_version)
    if want.compatibility_hash is not None:
        # Covers the connector version: the engine's is hashed in, ours is pinned.
        differ("compatibility_hash", want.compatibility_hash, payload.compatibility_hash)
    if want.engine_id is not None:
        differ("engine_id", want.engine_id, meta.engine_id)
    differ("block_size", want.block_size, meta.block_size)
    if want.kv_cache_layout is not None:
        differ("kv_cache_layout", want.kv_cache_layout, meta.kv_cache_layout)
    elif meta.kv_cache_layout not in SUPPORTED_KV_CACHE_LAYOUTS:
        differ("kv_cache_layout", " or ".join(sorted(SUPPORTED_KV_CACHE_LAYOUTS)), meta.kv_cache_layout)
    # Layouts the descriptor math does not model.
    differ("physical_blocks_per_logical_kv_block", 1, meta.physical_blocks_per_logical_kv_block)
    differ("ssm_sizes", (0, 0), meta.ssm_sizes)
    differ("ple_block_len", None, meta.ple_block_len)
    differ("dcp_size", 1, meta.dcp_size)
    differ("pcp_size", 1, meta.pcp_size)
    differ("packed_member_layouts", {}, dict(meta.packed_member_layouts))
    if meta.region_group_ids is not None and len(set(meta.region_group_ids)) > 1:
        differ("region_group_ids", "one KV cache group", sorted(set(meta.region_group_ids)))
    return d


def check_compatible(payload: NixlHandshakePayload, meta: NixlAgentMetadata, expected: Expected) -> None:
    """Raises NixlIncompatible naming every property that differs from what is pinned or
    expected (FailedPrecondition; metadata "differs" lists them)."""
    differences: Mapping[str, tuple[str, str]] = _differences(payload, meta, expected)
    if differences:
        raise NixlIncompatible(differences)
