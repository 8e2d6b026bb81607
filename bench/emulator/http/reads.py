"""The reading side of the stand-in's NIXL (bench/emulator/http/engine.py): a READ of a remote
engine's held blocks over its side channel (HTTP standing in for NIXL), which also notifies the
holder (it frees them), and a read of a peer's host tier (llm-d's P2P KV sharing). Their time on
the link is the engine core's (bench/emulator/core/engine.py). And what the side channel's
handshake answers (`side_channel_handshake`)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import aiohttp

from bench.emulator.core.link import Link
from bench.emulator.http.config import StandinConfig

__all__ = ["STANDIN_COMPATIBILITY", "Block", "RemoteReader", "side_channel_handshake"]

# The stand-ins' "compatibility hash": any two stand-ins read each other's blocks.
STANDIN_COMPATIBILITY: Final = "standin-v1"

Block = tuple[int, ...]  # a block's KV content: the tokens it was computed from


def side_channel_handshake(config: StandinConfig, port: int, link: Link | None) -> dict[str, Any]:
    """GET /kv/handshake: what NIXL's handshake tells a reader (the engine's id, block size and
    blocks, where to read them, its clock) and the engine's link, whose model an agent beside it
    times its own reads with (None: not profile-timed)."""
    return {
        "engine_id": config.engine_id,
        "block_size": config.block_size,
        "num_blocks": config.num_blocks,
        "compatibility_hash": STANDIN_COMPATIBILITY,
        "url": f"http://{config.host}:{port}",
        "clock": time.perf_counter(),
        "link": None
        if link is None
        else {
            "fixed_ms": link.model.fixed_ms,
            "bandwidth_gb_s": link.model.bandwidth_gb_s,
            "time_scale": link.time_scale,
        },
    }


class RemoteReader:
    """The core's KvReader over HTTP."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def read(self, params: Mapping[str, Any], skip_blocks: int, upto_blocks: int) -> list[Block] | None:
        ids = (params.get("remote_block_ids") or [[]])[0]
        url = f"http://{params.get('remote_host')}:{params.get('remote_port')}/kv/read"
        body = {"holding": params.get("remote_request_id"), "block_ids": ids[skip_blocks:upto_blocks]}
        return await self._post(url, body)

    async def read_host(self, params: Mapping[str, Any], keys: Sequence[bytes]) -> list[Block]:
        """`p2p_source_url`: the source's side channel."""
        url = params.get("p2p_source_url")
        if not url:
            return []
        return await self._post(f"{url}/kv/host", {"keys": [k.hex() for k in keys]}) or []

    async def _post(self, url: str, body: dict[str, Any]) -> list[Block] | None:
        assert self._session is not None, "open() first"
        try:
            async with self._session.post(url, json=body) as response:
                if response.status != 200:
                    return None
                return [tuple(block) for block in (await response.json())["blocks"]]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return None
