"""One policy's run: a fresh emulated cluster (same profile, sizes and seed for every policy),
the policy in front of it, then each session rate in turn: that rate's sessions replayed open
loop (workload/arrivals.py's Poisson starts; the next rate once every session of this one ended),
summarized with the cluster's counters and the control plane's CPU over the step, and the decode
engines' KV blocks sampled through it."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from deploy.profiles.schema import EngineProfile

from bench.cluster.engines import EmulatedCluster
from bench.cluster.kvshuttle_policy import VARIANTS, Kvshuttle
from bench.cluster.policies import CLIENT_SIDE, Policy, PrefixAware
from bench.cluster.replay import Replay, ReplayConfig, TurnRecord
from bench.cluster.report import summarize
from bench.cluster.workload.arrivals import Arrival, poisson_times
from bench.cluster.workload.model import Session
from bench.cluster.workload.tokens import TokenMap
from bench.emulator.http.kv import output_tokens
from bench.emulator.http.tokenizer import SPECIAL

POLICIES = ("recompute", "proxy", "prefix-aware", "affinity-local", *VARIANTS)


@dataclass(frozen=True)
class ClusterRun:
    model_dir: Path
    profile: EngineProfile
    prefill: int
    decode: int
    time_scale: float
    max_model_len: int
    max_output: int
    max_turns: int
    edit_fraction: float
    seed: int
    horizon_s: float | None = None  # per step; see ReplayConfig
    sample_s: float = 1.0  # decode KV blocks sampled this often (profile seconds)


class KvSampler:
    """The decode engines' KV blocks every `every_s` profile seconds over one step: a series of
    [t_s, in use, held for a next turn's reader] (EmulatedCluster.decode_kv_blocks)."""

    def __init__(self, cluster: EmulatedCluster, every_s: float) -> None:
        self.cluster, self.every_s = cluster, every_s
        self.series: list[list[float]] = []

    async def sample(self) -> None:
        scale, began = self.cluster.time_scale, time.monotonic()
        while True:
            blocks = self.cluster.decode_kv_blocks()
            t_s = round((time.monotonic() - began) / scale, 2)
            self.series.append([t_s, blocks["in_use"], blocks["held"]])
            await asyncio.sleep(self.every_s * scale)


def arrivals(sessions: Sequence[Session], rate_per_s: float, seed: int) -> list[Arrival]:
    """Every session, started as a Poisson process of `rate_per_s` (profile seconds)."""
    rng = random.Random(seed)
    times: list[float] = []
    window = 2 * len(sessions) / rate_per_s
    while len(times) < len(sessions):
        times = poisson_times(rate_per_s, 0.0, window, rng)
        window *= 2
    return [Arrival(t, s) for t, s in zip(times, sessions, strict=False)]


async def open_policy(name: str, cluster: EmulatedCluster) -> Policy:
    if name in VARIANTS:
        # Started afresh once more when it does not come up: on a shared machine another
        # process may take a port between its probe and the service's bind (as bench/load.py).
        for attempt in (1, 2):
            kvshuttle = Kvshuttle(cluster, name=name)
            try:
                await kvshuttle.start()
                return kvshuttle
            except (RuntimeError, TimeoutError):
                await kvshuttle.close()
                if attempt == 2:
                    raise
            except BaseException:
                await kvshuttle.close()
                raise
    policy: Policy = CLIENT_SIDE[name](cluster)
    if isinstance(policy, PrefixAware):
        await policy.ready()
    return policy


async def run_policy(
    name: str,
    run: ClusterRun,
    steps: Sequence[tuple[float, Sequence[Session]]],
    log: Callable[[str], None],
    *,
    workload: str = "trace",
) -> tuple[list[dict[str, Any]], list[TurnRecord]]:
    """`steps`: (session rate, its sessions) of `workload`. One row per step, and every turn's
    record."""
    cluster = EmulatedCluster(
        run.model_dir, run.profile, prefill=run.prefill, decode=run.decode, time_scale=run.time_scale,
        max_model_len=run.max_model_len,
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    records: list[TurnRecord] = []
    async with cluster:
        vocabulary = cluster.vocabulary
        vocab_size = cluster.standin.engines[0].vocab_size
        config = ReplayConfig(
            token_map=TokenMap(vocab_size, seed=run.seed, reserved=len(SPECIAL)),
            vocab_size=vocab_size,
            time_scale=run.time_scale,
            max_model_len=run.max_model_len,
            max_output=run.max_output,
            max_turns=run.max_turns,
            edit_fraction=run.edit_fraction,
            seed=run.seed,
            horizon_s=run.horizon_s,
        )

        def expected(prompt: list[int], n: int) -> list[int]:
            return output_tokens(prompt, n, vocabulary)

        policy = await open_policy(name, cluster)
        try:
            connector = aiohttp.TCPConnector(limit=0)
            # A stream silent this long (real seconds) fails its turn: the run goes on.
            timeout = aiohttp.ClientTimeout(sock_read=60)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
                for i, (rate, sessions) in enumerate(steps):
                    counters0, cpu0 = cluster.counters(), policy.cpu_s()
                    pool0 = await policy.pool_counters(http) if isinstance(policy, Kvshuttle) else {}
                    began = time.monotonic()
                    sampler = KvSampler(cluster, run.sample_s)
                    sampling = asyncio.create_task(sampler.sample())
                    try:
                        got = await Replay(policy, config, expected).run(
                            http, arrivals(sessions, rate, run.seed + i)
                        )
                    finally:
                        sampling.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await sampling
                    wall_s = (time.monotonic() - began) / run.time_scale
                    counters = {k: v - counters0[k] for k, v in cluster.counters().items()}
                    summary = summarize(got, counters, gpus=cluster.gpus, wall_s=wall_s,
                                        cpu_s=policy.cpu_s() - cpu0, prefill_gpus=run.prefill
                                        * run.profile.hardware.gpus_per_engine)  # fmt: skip
                    if isinstance(policy, Kvshuttle):  # moved over the step; the pools' use at its end
                        pool = await policy.pool_counters(http)
                        moved = {k: v - pool0[k] for k, v in pool.items() if k != "pool_used_bytes"}
                        summary["pool"] = {**moved, "pool_used_bytes": pool["pool_used_bytes"]}
                        summary["parked_bytes"] = moved.get("parked_bytes", 0.0)
                    rows.append({"policy": name, "workload": workload, "profile": run.profile.model,
                                 "rate": rate, "sessions": len(sessions), "summary": summary,
                                 "decode_kv_blocks": sampler.series})  # fmt: skip
                    records += got
                    for failed in [r for r in got if r.error is not None][:3]:
                        log(f"{name}: {failed.session} turn {failed.turn}: {failed.error}")
                    log(
                        f"{name:16} {workload} {rate:g} sessions/s: "
                        f"{summary['served']}/{summary['turns']} turns, "
                        f"wrong {summary['wrong']}, errors {summary['errors']}, "
                        f"TTFT p50 {summary['ttft_ms']['p50']} ms, {time.monotonic() - began:.0f} s real"
                    )
        finally:
            await policy.close()
    return rows, records


__all__ = ["POLICIES", "ClusterRun", "KvSampler", "arrivals", "open_policy", "run_policy"]
