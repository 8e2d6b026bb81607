"""The peers as they ship, on the simulated fleet: llm-d's router and NVIDIA Dynamo's KV router,
each rule from its source (read 2026-12; paths in each class's docstring, the whole survey in
docs/benchmarks/fleet.md). Both see what they would deployed: KV events by tier with the
fleet's event lag (their indexers subscribe to the engines' ZMQ streams), the engines' gauges
as scraped, and their own in-flight requests exactly.
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final

from bench.emulator.fleet.engine import Completion, SimEngine
from bench.emulator.fleet.fleet import Fleet
from bench.fleet.baselines import START, InFlight, reused
from bench.fleet.replay import Served, SimTurn

__all__ = ["Dynamo", "LlmD"]


def _argbest(scores: Sequence[float], rng: random.Random, *, lowest: bool = False) -> int:
    """The best score's index, ties broken uniformly at random (llm-d's max-score picker
    shuffles before its stable sort; Dynamo's selector samples among equal costs)."""
    best = min(scores) if lowest else max(scores)
    ties = [i for i, s in enumerate(scores) if s == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class _Lru:
    """llm-d's approximate prefix index for one server: prompt block keys, LRU by count."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def add(self, keys: Sequence[int]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def leading(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n


class LlmD:
    """llm-d-router v0.10.0 in P/D with peer-to-peer KV sharing, as its agentic P/D run ("Pull,
    Don't Recompute", llm-d blog 2026-08-15; guides/agentic-serving and p2p-kv-cache-sharing):

    * decode first (`disagg-profile-handler`, stage order decode-first): the decode profile's
      `active-request-scorer` (in-flight requests n: 1 when n <= 0, else (max n - n) / max n),
      `max-score-picker` (ties at random);
    * `prefix-based-pd-decider` (nonCachedTokens 16, the router's sample config): prefill
      remotely iff prompt tokens - the decode pod's cached tokens (the approximate index:
      prompt blocks routed to it, 4,000,000 blocks per server as the agentic guide) >= 16, else
      the decode pod prefills locally;
    * the prefill profile: `prefix-cache-affinity-filter` (pods whose tier-weighted prefix match
      is >= 0.80 of the prompt, unless their best estimated TTFT (in-flight uncached tokens /
      peak prefill throughput) is more than 18 s worse than the others'), then
      `token-load-scorer` (1 - min(L, 4,194,304) / 4,194,304, L the pod's in-flight uncached
      tokens until their first token plus this request's), max-score;
    * the precise prefix index from KV events by tier, GPU weight 1.0 and CPU 0.8 (the library
      default, `kvCacheBackendConfigs`), and speculative entries for 2 s (`speculativeIndexing`);
    * `p2p-source-producer` (minCachedTokenDelta 1024, the Qwen3 P/D run's): the pod with the
      longest contiguous CPU-tier prefix (candidates within one block of it, drawn with weight
      1 / (1 + waiting)) is named as the prefill's source when it holds >= 1024 tokens more
      than the prefill pod has in all tiers; the prefill pulls them CPU to CPU over RDMA;
    * engines with vLLM's OffloadingConnector (`offload_prompt_only: false`: decode's blocks
      too), so a decode pod's CPU tier holds the conversation for the next turn's pull.
    """

    name = "llm-d"
    GPU_WEIGHT: Final = 1.0
    CPU_WEIGHT: Final = 0.8
    AFFINITY_THRESHOLD: Final = 0.80
    MAX_TTFT_PENALTY_S: Final = 18.0
    QUEUE_THRESHOLD_TOKENS: Final = 4_194_304
    NON_CACHED_TOKENS: Final = 16
    MIN_CACHED_TOKEN_DELTA: Final = 1024
    SPECULATIVE_TTL_S: Final = 2.0
    APPROX_LRU_BLOCKS: Final = 4_000_000

    def __init__(self, fleet: Fleet, *, seed: int = 0, p2p: bool = True) -> None:
        self.fleet = fleet
        self.p2p = p2p
        self.name = "llm-d" if p2p else "llm-d-no-p2p"
        self.rng = random.Random(f"llm-d-{seed}")
        self.cache = fleet.subscribe()
        self.load = fleet.load_view()
        self.inflight = InFlight()
        self._uncached: dict[str, int] = {}
        self._approx = {e.name: _Lru(self.APPROX_LRU_BLOCKS) for e in fleet.engines}
        self._speculative: dict[str, tuple[frozenset[int], float]] = {}
        prefill = fleet.config.profile.prefill
        # peakPrefillThroughput: the guides set the model's measured peak; here the profile's.
        self.peak_tok_s = 1e3 / prefill.per_token_ms
        self.bs = fleet.config.block_size

    def _match(self, engine: str, keys: list[int], now: float) -> tuple[float, int, int]:
        """(tier-weighted matched blocks, contiguous blocks in any tier, in CPU only)."""
        gpu = self.cache.leading(engine, keys, ("GPU",))
        spec = self._speculative.get(engine)
        if spec is not None and spec[1] > now:
            held = spec[0]
            n = 0
            for k in keys:
                if k not in held:
                    break
                n += 1
            gpu = max(gpu, n)
        both = max(gpu, self.cache.leading(engine, keys, ("GPU", "CPU")))
        cpu = self.cache.leading(engine, keys, ("CPU",))
        return gpu * self.GPU_WEIGHT + (both - gpu) * self.CPU_WEIGHT, both, cpu

    def _decode(self) -> SimEngine:
        ds = self.fleet.decodes
        counts = [self.inflight(d) for d in ds]
        top = max(counts)
        scores = [1.0 if n <= 0 else (top - n) / top for n in counts]
        return ds[_argbest(scores, self.rng)]

    def _prefill(
        self, keys: list[int], isl: int, now: float
    ) -> tuple[SimEngine, list[tuple[float, int, int]]]:
        ps = self.fleet.prefills
        total = max(1, len(keys))
        matches = [self._match(p.name, keys, now) for p in ps]
        fractions = [int(m[0]) / total for m in matches]
        ttft = [self._uncached.get(p.name, 0) / self.peak_tok_s for p in ps]
        sticky = [i for i, f in enumerate(fractions) if f >= self.AFFINITY_THRESHOLD]
        others = [i for i in range(len(ps)) if i not in sticky]
        keep = list(range(len(ps)))
        if (
            sticky
            and others
            and min(ttft[i] for i in sticky) - min(ttft[i] for i in others) <= self.MAX_TTFT_PENALTY_S
        ):
            keep = sticky
        q = self.QUEUE_THRESHOLD_TOKENS
        scores = []
        for i in keep:
            this = max(0, isl - int(matches[i][0]) * self.bs)
            load = self._uncached.get(ps[i].name, 0) + this
            scores.append(1.0 if load <= 0 else 1 - min(load, q) / q)
        chosen = keep[_argbest(scores, self.rng)]
        return ps[chosen], matches

    def _source(self, keys: list[int], computing: SimEngine, computing_cached: int) -> str:
        """p2p-source-producer: the pod to pull from, or ""."""
        bs = self.bs
        cached = [(e, self.cache.leading(e.name, keys, ("CPU",)) * bs) for e in self.fleet.engines]
        best = max(c for _, c in cached)
        if best <= 0:
            return ""
        band = [(e, c) for e, c in cached if c + bs >= best]
        weights = [1 / (1 + self.load.of(e.name).waiting) for e, _ in band]
        source, tokens = self.rng.choices(band, weights)[0]
        if source is computing or tokens - computing_cached < self.MIN_CACHED_TOKEN_DELTA:
            return ""
        return source.name

    async def serve(self, turn: SimTurn) -> Served:
        now = asyncio.get_running_loop().time()
        keys = turn.prompt.key_list
        isl = len(turn.prompt)
        d = self._decode()
        hit = self._approx[d.name].leading(keys) * self.bs
        if isl - hit < self.NON_CACHED_TOKENS:
            self._approx[d.name].add(keys)
            answer = await self.inflight.run(d, d.complete(turn.prompt, turn.output))
            return Served(answer, "", d.name, "local", "decider", answer.cached_tokens + answer.host_tokens)
        p, matches = self._prefill(keys, isl, now)
        i = self.fleet.prefills.index(p)
        params: dict[str, Any] = dict(START)
        reason = "disagg"
        if self.p2p:
            source = self._source(keys, p, matches[i][1] * self.bs)
            if source:
                params.update(p2p_source_engine=source, p2p_source_tokens=isl)
                reason = "p2p"
        self._approx[d.name].add(keys)
        self._approx[p.name].add(keys)
        self._speculative[p.name] = (frozenset(keys), now + self.SPECULATIVE_TTL_S)
        uncached = max(0, isl - int(matches[i][0]) * self.bs)
        self._uncached[p.name] = self._uncached.get(p.name, 0) + uncached
        try:
            pre = await self.inflight.run(p, p.complete(turn.prompt, 1, params))
        finally:
            self._uncached[p.name] -= uncached  # released at the first token
        answer = await self.inflight.run(d, d.complete(turn.prompt, turn.output, pre.params or {}))
        return Served(
            answer, p.name, d.name, "recompute" if not pre.read_tokens else "read", reason, reused(pre), pre
        )


class Dynamo:
    """NVIDIA Dynamo's KV router in disaggregated mode (lib/kv-router/src/scheduling/selector/
    default.rs, docs/components/router/router-disaggregated-serving.md, main 2026):

    * prefill router: cost = max((active prefill tokens + prompt tokens) / block size - credit,
      0), credit = device overlap blocks x 1.0 + host overlap x 0.75; KVBM's host tier (on the
      prefill workers in disaggregated mode, write-through) is merged into the device view, so
      its blocks earn 1.0; active prefill tokens are a worker's in-flight uncached tokens until
      their first token; lowest cost, ties at random (temperature 0);
    * decode router: load only, cost = the worker's active decode blocks plus the request's;
    * conditional disaggregation (`--router-conditional-disagg`, policy isl_bounding; off by
      default, on here as the issue names it): peek at the decode router with its overlap
      credit; the decode worker prefills locally iff its effective uncached prompt is < 2,048
      tokens and < 0.7 of the prompt.
    """

    name = "dynamo"
    HOST_WEIGHT: Final = 0.75
    EFF_ISL_THRESHOLD: Final = 2048
    EFF_ISL_RATIO: Final = 0.7

    def __init__(self, fleet: Fleet, *, seed: int = 0, conditional_disagg: bool = True) -> None:
        self.fleet = fleet
        self.rng = random.Random(f"dynamo-{seed}")
        self.cache = fleet.subscribe()
        self.inflight = InFlight()
        self.conditional_disagg = conditional_disagg
        self._prefill_tokens: dict[str, int] = {}
        self._decode_blocks: dict[str, int] = {}
        self.bs = fleet.config.block_size

    def _overlap(self, engine: str, keys: list[int], *, host_as_device: bool) -> float:
        device = self.cache.leading(engine, keys, ("GPU",))
        with_host = max(device, self.cache.leading(engine, keys, ("GPU", "CPU")))
        weight = 1.0 if host_as_device else self.HOST_WEIGHT
        return device + (with_host - device) * weight

    async def _run(self, engine: SimEngine, call: Any, table: dict[str, int], amount: int) -> Completion:
        table[engine.name] = table.get(engine.name, 0) + amount
        try:
            return await self.inflight.run(engine, call)
        finally:
            table[engine.name] -= amount

    async def serve(self, turn: SimTurn) -> Served:
        keys = turn.prompt.key_list
        isl, bs = len(turn.prompt), self.bs
        new_blocks = -(-(isl + turn.output) // bs)
        ds = self.fleet.decodes
        if self.conditional_disagg:
            credits = [self._overlap(d.name, keys, host_as_device=False) for d in ds]
            costs = [
                max(self._decode_blocks.get(d.name, 0) + new_blocks - c, 0)
                for d, c in zip(ds, credits, strict=True)
            ]
        else:
            credits = [0.0] * len(ds)
            costs = [self._decode_blocks.get(d.name, 0) + new_blocks for d in ds]
        j = _argbest(costs, self.rng, lowest=True)
        d = ds[j]
        if self.conditional_disagg:
            eff = isl - min(int(credits[j] * bs), isl)
            if eff < self.EFF_ISL_THRESHOLD and eff / isl < self.EFF_ISL_RATIO:
                answer = await self._run(
                    d, d.complete(turn.prompt, turn.output), self._decode_blocks, new_blocks
                )
                return Served(
                    answer,
                    "",
                    d.name,
                    "local",
                    "conditional_disagg",
                    answer.cached_tokens + answer.host_tokens,
                )
        ps = self.fleet.prefills
        overlaps = [self._overlap(p.name, keys, host_as_device=True) for p in ps]
        costs = [
            max((self._prefill_tokens.get(p.name, 0) + isl) / bs - o, 0.0)
            for p, o in zip(ps, overlaps, strict=True)
        ]
        i = _argbest(costs, self.rng, lowest=True)
        p = ps[i]
        uncached = max(0, isl - int(overlaps[i]) * bs)
        pre = await self._run(p, p.complete(turn.prompt, 1, START), self._prefill_tokens, uncached)
        answer = await self._run(
            d, d.complete(turn.prompt, turn.output, pre.params or {}), self._decode_blocks, new_blocks
        )
        return Served(answer, p.name, d.name, "recompute", "kv_router", reused(pre), pre)
