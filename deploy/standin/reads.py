"""The reading side of the stand-in's NIXL (deploy/standin/engine.py): a READ of a remote
engine's held blocks over its side channel (HTTP standing in for NIXL), which also notifies the
holder (it frees them), timed as the engine is: over its `Link` when profile-timed, else flat
per block. And what the side channel's handshake answers (`side_channel_handshake`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

import aiohttp

from deploy.standin.config import StandinConfig
from deploy.standin.link import Link

__all__ = ["STANDIN_COMPATIBILITY", "RemoteReader", "side_channel_handshake"]

# The stand-ins' "compatibility hash": any two stand-ins read each other's blocks.
STANDIN_COMPATIBILITY: Final = "standin-v1"


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
    """`counters`: the engine's, where reads are counted (kv_reads, kv_blocks_read)."""

    def __init__(self, config: StandinConfig, link: Link | None, counters: dict[str, int]) -> None:
        self.config = config
        self.link = link
        self.counters = counters
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def read(self, params: dict[str, Any], skip_blocks: int, upto: int) -> list[int] | None:
        """Tokens [skip_blocks * bs, upto) of the remote holding `params` name, read and freed
        there; None when the read failed."""
        ids = (params.get("remote_block_ids") or [[]])[0]
        bs = self.config.block_size
        wanted = ids[skip_blocks : -(-upto // bs)]
        url = f"http://{params.get('remote_host')}:{params.get('remote_port')}/kv/read"
        assert self._session is not None, "open() first"
        try:
            async with self._session.post(
                url, json={"holding": params.get("remote_request_id"), "block_ids": wanted}
            ) as response:
                if response.status != 200:
                    return None
                blocks = (await response.json())["blocks"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return None
        if wanted:
            await self._transfer(len(wanted))
            self.counters["kv_reads"] += 1
            self.counters["kv_blocks_read"] += len(wanted)
        tokens = [t for block in blocks for t in block]
        return tokens[: upto - skip_blocks * bs]

    async def notify(self, params: dict[str, Any]) -> None:
        """Tell the holder its blocks are no longer wanted (vLLM notifies on every outcome)."""
        await self.read(params, 0, 0)

    async def _transfer(self, blocks: int) -> None:
        """A READ's time: the link's for the blocks' bytes (profile-timed), else flat per block."""
        cfg = self.config
        if self.link is None or cfg.profile is None:
            await asyncio.sleep(blocks * cfg.read_us_per_block / 1e6 * cfg.time_scale)
        else:
            await self.link.transfer(blocks * cfg.block_size * cfg.profile.kv_bytes_per_token)
