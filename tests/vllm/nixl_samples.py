"""A NixlAgentMetadata like the CPU build's (two layers, LBHNC, DRAM), with unequal strides and
block counts per region so that the descriptor math cannot pass by accident."""

from __future__ import annotations

from kvshuttle.vllm.nixl_wire import NixlAgentMetadata

META = NixlAgentMetadata(
    engine_id="decode-1",
    agent_metadata=b"\x00nixl-blob",
    kv_caches_base_addr=(0x1000_0000, 0x2000_0000),
    device_id=0,
    num_blocks=8,
    block_lens=(4096, 4096),
    block_strides=(8192, 4096),
    kv_cache_layout="LBHNC",
    block_size=32,
    ssm_sizes=(0, 0),
    attn_backend_name="CPU_ATTN",
    physical_blocks_per_logical_kv_block=1,
    region_num_blocks=(8, 6),
    region_group_ids=(0, 0),
    region_names=("l0", "l1"),
    region_mem_types=("DRAM", "DRAM"),
)
HASH = "ab" * 32
