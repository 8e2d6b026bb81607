"""Where an engine's KV blocks are, from its NixlAgentMetadata: NIXL descriptors and indices.

vLLM registers one region per attention layer (more on hybrid models). A reader prepares one
descriptor list for the whole advertised buffer, region after region, and reads blocks by
index into it (vLLM 0.32's `_build_fa_remote` and `_compute_desc_ids`, all-attention path):

    descriptor(region i, block b) = (base[i] + b * block_strides[i], block_lens[i], device_id)
    index(region i, block b)      = cumsum([0] + region_num_blocks)[i] + b

`region_num_blocks` absent means `num_blocks` in every region. The blocks of one read are
listed region-major: every block of region 0, then every block of region 1, ... (the order of
vLLM's descriptor ids). Only the layout vLLM's all-attention path describes is modelled; check
the engine with kvshuttle.vllm.nixl_compat.check_compatible first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Final

import numpy as np
import numpy.typing as npt

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.vllm.nixl_wire import MAX_REGIONS, NixlAgentMetadata

__all__ = ["Region", "RemoteLayout"]

_U64: Final = (1 << 64) - 1
# Descriptors a reader prepares for one engine (vLLM prepares them all): bounds the memory a
# hostile advertisement can make us spend.
MAX_DESCRIPTORS: Final = 1 << 24


@dataclass(frozen=True, slots=True)
class Region:
    base: int
    block_len: int  # bytes read per block
    stride: int  # bytes from one block to the next (>= block_len)
    num_blocks: int
    first_index: int  # the descriptor index of its block 0


class RemoteLayout:
    """The descriptor math of one engine rank's advertised KV buffer."""

    __slots__ = ("device_id", "mem_type", "regions")

    def __init__(self, regions: Sequence[Region], device_id: int, mem_type: str) -> None:
        self.regions = tuple(regions)
        self.device_id = device_id
        self.mem_type = mem_type  # NIXL's memory type: "DRAM" on the CPU build, "VRAM" on GPUs

    @classmethod
    def of(cls, meta: NixlAgentMetadata) -> RemoteLayout:
        """Raises InvalidArgument (field "agent_metadata.<name>") for an inconsistent layout."""
        n = len(meta.kv_caches_base_addr)
        if not 0 < n <= MAX_REGIONS:
            raise InvalidArgument("agent_metadata.kv_caches_base_addr", f"must list 1..{MAX_REGIONS} regions")
        counts = meta.region_num_blocks if meta.region_num_blocks is not None else (meta.num_blocks,) * n
        per_region = {
            "block_lens": meta.block_lens,
            "block_strides": meta.block_strides,
            "region_num_blocks": counts,
            "region_names": meta.region_names,
            "region_group_ids": meta.region_group_ids,
            "region_mem_types": meta.region_mem_types,
        }
        for name, values in per_region.items():
            if values is not None and len(values) != n:
                raise InvalidArgument(f"agent_metadata.{name}", f"{len(values)} entries for {n} regions")
        if sum(counts) > MAX_DESCRIPTORS:
            raise InvalidArgument("agent_metadata.region_num_blocks", f"more than {MAX_DESCRIPTORS} blocks")
        mem_types = set(meta.region_mem_types or ("DRAM",))
        if len(mem_types) != 1:
            raise InvalidArgument("agent_metadata.region_mem_types", "regions of mixed memory types")
        regions = []
        for i, (base, length, stride, count, first) in enumerate(
            zip(
                meta.kv_caches_base_addr,
                meta.block_lens,
                meta.block_strides,
                counts,
                accumulate(counts, initial=0),
                strict=False,  # accumulate yields one more: the total
            )
        ):
            if length == 0 or count == 0:
                raise InvalidArgument(f"agent_metadata.block_lens[{i}]", "regions must hold non-empty blocks")
            if stride < length:
                raise InvalidArgument(
                    f"agent_metadata.block_strides[{i}]", "must be at least the block length"
                )
            if base + (count - 1) * stride + length > _U64 + 1:
                raise InvalidArgument(f"agent_metadata.kv_caches_base_addr[{i}]", "region ends past 2**64")
            regions.append(
                Region(base=base, block_len=length, stride=stride, num_blocks=count, first_index=first)
            )
        return cls(regions, device_id=meta.device_id, mem_type=mem_types.pop())

    @property
    def num_descriptors(self) -> int:
        last = self.regions[-1]
        return last.first_index + last.num_blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id stands for, summed over the regions."""
        return sum(r.block_len for r in self.regions)

    def _check(self, region: int, block: int) -> Region:
        if not 0 <= region < len(self.regions):
            raise InvalidArgument("region", f"must be in [0, {len(self.regions)})")
        r = self.regions[region]
        if isinstance(block, bool) or not 0 <= block < r.num_blocks:
            raise InvalidArgument("block_id", f"{block} is outside region {region}'s {r.num_blocks} blocks")
        return r

    def index(self, region: int, block: int) -> int:
        """The descriptor index of (region, block) in `all_descriptors()`."""
        return self._check(region, block).first_index + block

    def byte_range(self, region: int, block: int) -> tuple[int, int]:
        """[start, end) of (region, block) in the engine's address space."""
        r = self._check(region, block)
        start = r.base + block * r.stride
        return start, start + r.block_len

    def descriptor(self, region: int, block: int) -> tuple[int, int, int]:
        """(address, length, device id): one row of NIXL's descriptor list."""
        start, end = self.byte_range(region, block)
        return start, end - start, self.device_id

    def indices(self, block_ids: Sequence[int]) -> list[int]:
        """Descriptor indices of a read of `block_ids`, region-major as vLLM lists them."""
        return [self.index(i, b) for i in range(len(self.regions)) for b in block_ids]

    def descriptors(self, block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """The rows of `indices(block_ids)`, in the same order."""
        return [self.descriptor(i, b) for i in range(len(self.regions)) for b in block_ids]

    def all_descriptors(self) -> npt.NDArray[np.uint64]:
        """Every block of every region as an (N, 3) array of (address, length, device id), in
        index order: what NIXL's get_xfer_descs / prep_xfer_dlist take."""
        out = np.empty((self.num_descriptors, 3), dtype=np.uint64)
        for r in self.regions:
            rows = out[r.first_index : r.first_index + r.num_blocks]
            rows[:, 0] = np.uint64(r.base) + np.arange(r.num_blocks, dtype=np.uint64) * np.uint64(r.stride)
            rows[:, 1] = r.block_len
            rows[:, 2] = self.device_id
        return out
