"""kvshuttle as the policy: its real services (registry, router, one agent per engine, gateway;
each its own process, deploy/local/stack.py, as bench/load.py runs them) in front of the
emulated engines; a turn is one streamed request to the gateway with its conversation_id.

The router gets the engines' profile on the emulated clock (EmulatedCluster.router_profile) and
decode's KV TTL scaled as the engines' is. Parking and prefetch move KV into the agents' DRAM
pools over NIXL, which the stand-in engines' side channel does not speak: they stay off here
(they are off by default too), so only the shipped defaults run.

CPU per turn is the services' own (from /proc: registry, router, gateway, agents).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import aiohttp
from deploy.local.stack import KvshuttleStack

from bench.cluster.client import stream
from bench.cluster.engines import EmulatedCluster
from bench.cluster.policies import Served, Turn
from bench.load import cpu_seconds

DECODER_KV_BLOCKS_TTL_S = 480.0
# The router's times against decode's TTL, at their defaults, on the emulated clock as that TTL;
# extend on the holder's bound (ms) too.
ROUTER_TIMES_S = {"POLICY__RETENTION_MARGIN_S": 30.0, "POLICY__CLAIM_HEADROOM_S": 6.0,
                  "POLICY__EXTEND__MAX_PREFILL_MS": 250.0}  # fmt: skip
# Extend on the holder is off by default (an operator's choice: it puts prefill work on decode
# nodes); the comparison runs kvshuttle with it on.
ROUTER_SWITCHES = {"POLICY__EXTEND__ENABLED": "true"}


class Kvshuttle:
    name = "kvshuttle"

    def __init__(self, cluster: EmulatedCluster, work_dir: Path | None = None) -> None:
        self.cluster = cluster
        self._own_dir = work_dir is None
        self.work_dir = work_dir or Path(tempfile.mkdtemp(prefix="kvshuttle-cluster-"))
        self.stack = KvshuttleStack(
            cluster,
            work_dir=self.work_dir,
            profile=cluster.router_profile(),
            served_model_name=cluster.model,
            block_size=cluster.profile.engine.block_size,
            decoder_kv_blocks_ttl=DECODER_KV_BLOCKS_TTL_S * cluster.time_scale,
            kv_bytes_per_token=cluster.profile.kv_bytes_per_token,
            extra_env={
                "router": {
                    **ROUTER_SWITCHES,
                    **{k: str(v * cluster.time_scale) for k, v in ROUTER_TIMES_S.items()},
                }
            },
        )
        self._cpu0: dict[int, float] = {}

    async def start(self) -> None:
        """The services up (their start blocks: a thread, while this loop serves the engines)."""
        await asyncio.to_thread(self.stack.start)
        self._cpu0 = {pid: cpu_seconds(pid) for pid in self._pids()}

    def _pids(self) -> list[int]:
        return [s.proc.pid for s in self.stack.services if s.proc is not None]

    async def serve(self, http: aiohttp.ClientSession, turn: Turn) -> Served:
        body = {"model": self.cluster.model, "prompt": turn.prompt, "max_tokens": turn.max_tokens,
                "conversation_id": turn.conversation}  # fmt: skip
        answer = await stream(http, self.stack.gateway_url, body)
        headers = answer.headers
        # Prefill's own count (read plus its local prefix hits) where it ran, else the router's.
        found = headers.get("X-Kvshuttle-Prefill-Cached-Tokens") or headers.get(
            "X-Kvshuttle-Reused-Tokens", "0"
        )
        reason = f"{headers.get('X-Kvshuttle-Decision', '?')}:{headers.get('X-Kvshuttle-Reason', '?')}"
        return Served(answer, reason, int(found))

    def cpu_s(self) -> float:
        return sum(cpu_seconds(pid) - self._cpu0.get(pid, 0.0) for pid in self._pids())

    async def close(self) -> None:
        await asyncio.to_thread(self.stack.stop)
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


__all__ = ["Kvshuttle"]
