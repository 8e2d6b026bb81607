"""The policies compared, on the same emulated engines (issue 20 §3). A policy serves one turn:
it chooses prefill (P) and decode (D), builds their `kv_transfer_params`, and learns from the
answer. These four run in the benchmark's own process, as a client-side router would; kvshuttle
itself is bench/cluster/kvshuttle_policy.py (its real services in front of the same engines).

    recompute       plain P->D: P and D round robin, every turn's prompt computed on P (its
                    prefix cache aside), decode's KV never read back
    proxy           the seed's example proxy: P and D round robin, decode's answered params kept
                    per conversation_id (one single-use entry, 450 s TTL) and handed to the next
                    turn's prefill, which reads decode's KV without any check that the new prompt
                    extends it: an edited history is answered from the wrong KV
    prefix-aware    llm-d's precise prefix-cache scorer: each P's cached blocks from its KV events;
                    P scored by the prompt's leading blocks it holds (share of the prompt) plus
                    its queue (min-max normalised in-flight requests), 2:1; D by load; no D->P
    affinity-local  a conversation sticks to the decode node of its first turn, which from then
                    on prefills the new tokens itself (the whole prompt sent to it: its prefix
                    cache serves the history); the first turn is P->D

`Served.reason` is the turn's decision: recompute, read (D->P), local, or p2d (a first turn);
kvshuttle's is the router's decision and its reason (X-Kvshuttle-Decision:X-Kvshuttle-Reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import zmq
import zmq.asyncio

from bench.cluster.client import Streamed, decode, prefill
from bench.cluster.engines import EmulatedCluster, Node, RoundRobin, least_loaded
from bench.emulator.http.kv import int64_of, vllm_block_hashes
from kvshuttle.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvshuttle.vllm.kv_events import KvEventDecoder

START = {"do_remote_decode": True}  # a first prefill: keep the prompt's blocks for decode
PROXY_TTL_S = 450.0


@dataclass
class Turn:
    conversation: str
    prompt: list[int]
    max_tokens: int
    think_s: float | None = None  # the trace's think time before the next turn (profile seconds)


@dataclass
class Served:
    answer: Streamed
    reason: str
    reused_tokens: int  # prompt tokens the computing engine did not compute (found or read)


class Policy(Protocol):
    name: str

    async def serve(self, http: aiohttp.ClientSession, turn: Turn) -> Served: ...

    def cpu_s(self) -> float:
        """CPU seconds its routing took (this process's thread time spent deciding)."""

    async def close(self) -> None: ...


class CpuMeter:
    """Thread CPU time spent inside `with meter:` (the policies' decisions run in the event
    loop's thread, between awaits)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0

    def __enter__(self) -> None:
        self._began = time.thread_time()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.thread_time() - self._began


async def p_to_d(
    http: aiohttp.ClientSession,
    cluster: EmulatedCluster,
    p: Node,
    d: Node,
    turn: Turn,
    params: dict[str, Any],
) -> tuple[Streamed, int]:
    """Prefill on `p` with `params`, then decode on `d` reading p's KV; the answer and the
    tokens prefill did not compute."""
    p_params, found = await prefill(http, p, cluster.model, turn.prompt, params)
    answer = await decode(http, d, cluster.model, turn.prompt, turn.max_tokens, p_params)
    return answer, found


class Recompute:
    name = "recompute"

    def __init__(self, cluster: EmulatedCluster) -> None:
        self.cluster = cluster
        self._p, self._d = RoundRobin(cluster.of_role("prefill")), RoundRobin(cluster.of_role("decode"))
        self.meter = CpuMeter()

    async def serve(self, http: aiohttp.ClientSession, turn: Turn) -> Served:
        with self.meter:
            p, d = self._p(), self._d()
        answer, found = await p_to_d(http, self.cluster, p, d, turn, START)
        return Served(answer, "recompute", found)

    def cpu_s(self) -> float:
        return self.meter.seconds

    async def close(self) -> None:
        pass


class Proxy:
    name = "proxy"

    def __init__(self, cluster: EmulatedCluster) -> None:
        self.cluster = cluster
        self._p, self._d = RoundRobin(cluster.of_role("prefill")), RoundRobin(cluster.of_role("decode"))
        self._kept: dict[str, tuple[dict[str, Any], float]] = {}
        self.ttl_s = PROXY_TTL_S * cluster.time_scale
        self.meter = CpuMeter()

    async def serve(self, http: aiohttp.ClientSession, turn: Turn) -> Served:
        with self.meter:
            p, d = self._p(), self._d()
            kept = self._kept.pop(turn.conversation, None)  # single use
            params = kept[0] if kept is not None and kept[1] > time.monotonic() else None
        answer, found = await p_to_d(http, self.cluster, p, d, turn, params or START)
        with self.meter:
            if answer.params is not None:
                self._kept[turn.conversation] = (answer.params, time.monotonic() + self.ttl_s)
        return Served(answer, "read" if params else "recompute", found)

    def cpu_s(self) -> float:
        return self.meter.seconds

    async def close(self) -> None:
        pass


class PrefixAware:
    name = "prefix-aware"
    PREFIX_WEIGHT, LOAD_WEIGHT = 2.0, 1.0

    def __init__(self, cluster: EmulatedCluster) -> None:
        self.cluster = cluster
        self.prefills = cluster.of_role("prefill")
        self.decodes = cluster.of_role("decode")
        self.block_size = cluster.profile.engine.block_size
        self.cached: dict[str, set[int]] = {p.name: set() for p in self.prefills}
        self.meter = CpuMeter()
        self._zmq = zmq.asyncio.Context()
        self._watchers = [asyncio.create_task(self._watch(p)) for p in self.prefills]

    async def _watch(self, node: Node) -> None:
        """Keep `cached[node]` what node's KV events say it holds."""
        sub = self._zmq.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(node.events_endpoint)
        decoder, held = KvEventDecoder(), self.cached[node.name]
        try:
            while True:
                frames = await sub.recv_multipart()
                with self.meter:
                    batch = decoder.decode_message(frames)
                    for event in batch.events if batch is not None else ():
                        if isinstance(event, BlockStored):
                            held.update(event.block_hashes)
                        elif isinstance(event, BlockRemoved):
                            held.difference_update(event.block_hashes)
                        elif isinstance(event, AllBlocksCleared):
                            held.clear()
        finally:
            sub.close(0)

    async def ready(self) -> None:
        """The subscriptions reach the publishers (a ZMQ SUB misses what was sent before)."""
        await asyncio.sleep(0.3)

    def _choose(self, prompt: list[int]) -> Node:
        hashes = [int64_of(h) for h in vllm_block_hashes(prompt, self.block_size)]
        loads = [p.in_flight for p in self.prefills]
        low, high = min(loads), max(loads)

        def score(p: Node) -> float:
            held, hits = self.cached[p.name], 0
            for h in hashes:
                if h not in held:
                    break
                hits += 1
            prefix = hits / len(hashes) if hashes else 0.0
            load = 1.0 if high == low else (high - p.in_flight) / (high - low)
            return self.PREFIX_WEIGHT * prefix + self.LOAD_WEIGHT * load

        return max(self.prefills, key=score)

    async def serve(self, http: aiohttp.ClientSession, turn: Turn) -> Served:
        with self.meter:
            p, d = self._choose(turn.prompt), least_loaded(self.decodes)
        answer, found = await p_to_d(http, self.cluster, p, d, turn, START)
        return Served(answer, "recompute", found)

    def cpu_s(self) -> float:
        return self.meter.seconds

    async def close(self) -> None:
        for task in self._watchers:
            task.cancel()
        for task in self._watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._zmq.term()


class AffinityLocal:
    name = "affinity-local"

    def __init__(self, cluster: EmulatedCluster) -> None:
        self.cluster = cluster
        self._p = RoundRobin(cluster.of_role("prefill"))
        self.decodes = cluster.of_role("decode")
        self._home: dict[str, Node] = {}
        self.meter = CpuMeter()

    async def serve(self, http: aiohttp.ClientSession, turn: Turn) -> Served:
        with self.meter:
            home = self._home.get(turn.conversation)
        if home is not None:
            answer = await decode(http, home, self.cluster.model, turn.prompt, turn.max_tokens, None)
            return Served(answer, "local", answer.cached_tokens)
        with self.meter:
            p, d = self._p(), least_loaded(self.decodes)
            self._home[turn.conversation] = d
        answer, found = await p_to_d(http, self.cluster, p, d, turn, START)
        return Served(answer, "p2d", found)

    def cpu_s(self) -> float:
        return self.meter.seconds

    async def close(self) -> None:
        pass


CLIENT_SIDE: dict[str, Callable[[EmulatedCluster], Policy]] = {
    "recompute": Recompute,
    "proxy": Proxy,
    "prefix-aware": PrefixAware,
    "affinity-local": AffinityLocal,
}

__all__ = [
    "CLIENT_SIDE",
    "AffinityLocal",
    "CpuMeter",
    "Policy",
    "PrefixAware",
    "Proxy",
    "Recompute",
    "Served",
    "Turn",
    "p_to_d",
]
