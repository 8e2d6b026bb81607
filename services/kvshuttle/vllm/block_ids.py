"""The block ids in vLLM's `kv_transfer_params` dict, as the router reads them: no protobuf, so
domain code can read a dict it already trusts (one kvshuttle.vllm.kv_transfer_params produced
or validated)."""

from __future__ import annotations

from typing import Any

__all__ = ["block_groups"]


def block_groups(params: dict[str, Any]) -> list[list[int]]:
    """Block ids per KV-cache group of a dict vLLM returned (older vLLM sent one flat list).
    The groups are the dict's own lists, not copies: read only."""
    groups = params.get("remote_block_ids") or []
    return list(groups) if groups and isinstance(groups[0], list) else [groups]
