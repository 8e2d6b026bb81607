"""kvshuttle as the policy: its real services (registry, router, one agent per engine, gateway;
each its own process, deploy/local/stack.py, as bench/load.py runs them) in front of the
emulated engines; a turn is one streamed request to the gateway with its conversation_id.

The router gets the engines' profile on the emulated clock (EmulatedCluster.router_profile) and
decode's KV TTL scaled as the engines' is, its other times at their defaults scaled alike.
Parking, prefetch and extend on the holder are on (`kvshuttle`), or one of them off
(`kvshuttle-no-park`, `kvshuttle-no-prefetch`, `kvshuttle-no-extend`): each agent
(bench.emulator.http.agent) has a host pool of POOL_BYTES whose KV moves over the stand-ins' side
channel, timed by the engine's link (bench/emulator/http/pool_plane.py). A turn whose trace gives the
next turn's think time sends it as the prefetch hint (X-Kvshuttle-Expected-Think-Time, on the
emulated clock): a perfect hint.

CPU per turn is the services' own (from /proc: registry, router, gateway, agents). The agents'
moves (`pool_counters`): bytes parked and prefetched (cumulative) and their pools' use now.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import aiohttp
from deploy.local.stack import KvshuttleStack
from prometheus_client.parser import text_string_to_metric_families

from bench.cluster.client import stream
from bench.cluster.engines import EmulatedCluster
from bench.cluster.policies import Served, Turn
from bench.load import cpu_seconds

DECODER_KV_BLOCKS_TTL_S = 480.0
# The router's times against decode's TTL and the parking schedule's, at their defaults, on the
# emulated clock as that TTL; extend on the holder's bound (ms) too.
ROUTER_TIMES_S = {
    "POLICY__RETENTION_MARGIN_S": 30.0,
    "POLICY__CLAIM_HEADROOM_S": 6.0,
    "POLICY__PARKING__PARK_AFTER_IDLE_S": 30.0,
    "POLICY__PARKING__MAX_IDLE_S": 600.0,
    "POLICY__PARKING__PARK_BEFORE_PIN_S": 20.0,
    "POLICY__PARKING__MIN_TTL_S": 15.0,
    "POLICY__EXTEND__MAX_PREFILL_MS": 250.0,
}
# Each agent's host pool: an 8-GPU H200 node's 2 TiB of DRAM shared by its engines (4 of TP2),
# half of an engine's share for parked KV.
POOL_BYTES = 256 * 2**30
# The variants: (parking, prefetch, extend on the holder). `kvshuttle` is `make demo`'s data
# plane (deploy/demo.py) with extend on (off by default: an operator's choice, as it puts
# prefill work on decode nodes).
VARIANTS = {
    "kvshuttle": (True, True, True),
    "kvshuttle-no-park": (False, True, True),
    "kvshuttle-no-prefetch": (True, False, True),
    "kvshuttle-no-extend": (True, True, False),
}
THINK_TIME_HEADER = "X-Kvshuttle-Expected-Think-Time"


class Kvshuttle:
    def __init__(
        self, cluster: EmulatedCluster, work_dir: Path | None = None, *, name: str = "kvshuttle"
    ) -> None:
        self.name = name
        park, prefetch, extend = VARIANTS[name]
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
                "router": {k: str(v * cluster.time_scale) for k, v in ROUTER_TIMES_S.items()}
                | {
                    "POLICY__PARKING__ENABLED": str(park).lower(),
                    "POLICY__PARKING__PREFETCH_ENABLED": str(prefetch).lower(),
                    "POLICY__PARKING__TICK_S": "0.2",
                    "POLICY__EXTEND__ENABLED": str(extend).lower(),
                }
            },
            pool_bytes=POOL_BYTES,
            pool_regions=1,
            agent_module="bench.emulator.http.agent",
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
        hint = {}
        if turn.think_s is not None:
            hint[THINK_TIME_HEADER] = f"{turn.think_s * self.cluster.time_scale:.3f}"
        answer = await stream(http, self.stack.gateway_url, body, headers=hint)
        headers = answer.headers
        # Prefill's own count (read plus its local prefix hits) where it ran, else the router's.
        found = headers.get("X-Kvshuttle-Prefill-Cached-Tokens") or headers.get(
            "X-Kvshuttle-Reused-Tokens", "0"
        )
        reason = f"{headers.get('X-Kvshuttle-Decision', '?')}:{headers.get('X-Kvshuttle-Reason', '?')}"
        return Served(answer, reason, int(found))

    def cpu_s(self) -> float:
        return sum(cpu_seconds(pid) - self._cpu0.get(pid, 0.0) for pid in self._pids())

    async def pool_counters(self, http: aiohttp.ClientSession) -> dict[str, float]:
        """Summed over the agents, from their metrics: bytes parked and prefetched into their
        pools since they started, and the bytes their pools hold now."""
        got = {"parked_bytes": 0.0, "prefetched_bytes": 0.0, "pool_used_bytes": 0.0}
        for port in self.stack.agent_metrics_ports:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                text = await response.text()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    kind, state = sample.labels.get("kind"), sample.labels.get("state")
                    if sample.name == "kvshuttle_agent_moved_bytes_total" and kind in ("park", "prefetch"):
                        got["parked_bytes" if kind == "park" else "prefetched_bytes"] += sample.value
                    elif sample.name == "kvshuttle_agent_pool_bytes" and state == "used":
                        got["pool_used_bytes"] += sample.value
        return got

    async def close(self) -> None:
        await asyncio.to_thread(self.stack.stop)
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


__all__ = ["POOL_BYTES", "VARIANTS", "Kvshuttle"]
