"""Write deploy/profiles/cpu-small.toml: the `small` test model (deploy/vllm/README.md) on one
core of this machine, vLLM's CPU build, fitted to the real-vLLM TTFTs of bench/e2e_vllm.py:

    python -m deploy.profiles.cpu_small [--results bench/results/e2e_vllm-....json] [--out F]

Prefill: the recompute TTFTs, with prefix caching off on P (every context token computed) and on
(the previous turn's tokens hit P's cache, the rest computed), fitted by deploy.profiles.fit. A
TTFT is more than prefill (P -> D transfer, D's first step, two HTTP hops): fixed_ms holds that.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deploy.profiles.fit import Fit, fit_nonnegative, prefill_model, prefill_row
from deploy.profiles.schema import DecodeModel, EngineLimits, EngineProfile, Hardware, profile_toml
from kvshuttle.router.cost import LinkModel, PrefillModel

REPO = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "cpu-small.toml"
RESULTS = REPO / "bench" / "results"

# The small model: 8 layers x 4 KV heads x 64 head dim x (K, V) x 4 bytes (fp32).
KV_BYTES_PER_TOKEN = 8 * 4 * 64 * 2 * 4
# deploy/local/launch.py: VLLM_CPU_KVCACHE_SPACE 1 GiB, --block-size 32.
KV_CACHE_BYTES = 1 << 30
BLOCK_SIZE = 32
# vLLM's CPU defaults for the OpenAI server (engine/arg_utils.py): chunked prefill of 2048
# tokens, 128 sequences.
MAX_NUM_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 128
# bench/results/nixl_read and deploy/vllm/README.md: a D -> P read of 122.5 MB took 33 ms.
LINK = LinkModel(bandwidth_gb_s=3.7, fixed_ms=5.0)
# bench/e2e_vllm.py's turn 2: a 256-token answer and a 256-token new message after turn 1's prompt.
E2E_ANSWER = E2E_NEW = 256
# Per-step overhead of a decode step, from the first direct-prefill fit (20 ms).
DECODE_FIXED_MS = 20.0


def latest_results() -> Path:
    found = sorted(RESULTS.glob("e2e_vllm-*.json"))
    if not found:
        raise FileNotFoundError(f"no e2e_vllm-*.json under {RESULTS}")
    return found[-1]


def ttft_points(results: dict[str, Any]) -> list[tuple[int, int, float]]:
    """(computed, cached, ms) of every turn 2 on P. Recompute: with prefix caching off P computes
    the whole context; with it on, P's cache holds turn 1's prompt only (context - the answer -
    the new message: D generated the answer), and P computes the rest. Reuse with caching off:
    P computes what it did not read from D, the TTFT less the link's time for the read."""
    points = []
    for run in results["results"]:
        for turn in run["ttft"]:
            context, reused = int(turn["context_tokens"]), int(turn["reused_tokens"])
            cached = context - E2E_ANSWER - E2E_NEW if run["prefill_prefix_caching"] else 0
            points.append((context - cached, cached, float(turn["ttft_recompute_ms"])))
            if not run["prefill_prefix_caching"]:
                read_ms = LINK.ms(reused * KV_BYTES_PER_TOKEN)
                points.append((context - reused, reused, float(turn["ttft_reuse_ms"]) - read_ms))
    return points


def build_profile(points: Sequence[tuple[int, int, float]]) -> tuple[EngineProfile, Fit]:
    fit = fit_nonnegative([prefill_row(c, k) for c, k, _ in points], [ms for *_, ms in points])
    prefill = prefill_model(fit)
    profile = EngineProfile(
        model="m",
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        min_reuse_tokens=64,
        prefill=prefill,
        link=LINK,
        decode=_decode_from_prefill(prefill),
        engine=EngineLimits(
            kv_capacity_tokens=KV_CACHE_BYTES // KV_BYTES_PER_TOKEN,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            # The CPU build sizes its KV cache by VLLM_CPU_KVCACHE_SPACE, not by a fraction.
            gpu_memory_utilization=1.0,
        ),
        hardware=Hardware(gpu="cpu", tp=1, gpus_per_engine=1, gpu_memory_gib=KV_CACHE_BYTES / (1 << 30)),
    )
    return profile, fit


def _decode_from_prefill(prefill: PrefillModel) -> DecodeModel:
    """On one CPU core both phases are compute-bound: a step of b sequences costs what a b-token
    prefill chunk does, one token's MLP each and one attention pair per context token."""
    return DecodeModel(
        fixed_ms=DECODE_FIXED_MS,
        per_seq_ms=prefill.per_token_ms,
        per_ctx_token_ns=prefill.per_pair_ns,
        max_batch=MAX_NUM_SEQS,
    )


def header(source: Path, points: Sequence[tuple[int, int, float]], fit: Fit) -> str:
    cold = [p for p in points if p[1] == 0]
    warm = [p for p in points if p[0] == E2E_ANSWER + E2E_NEW and p[1] > 0]
    read = [p for p in points if p[1] > 0 and p not in warm]
    where = source.relative_to(REPO) if source.is_relative_to(REPO) else source

    def span(group: Sequence[tuple[int, int, float]], at: int) -> str:
        low, high = group[0][at], group[-1][at]
        return f"{low:.0f}" if low == high else f"{low:.0f}-{high:.0f}"

    return f"""\
Generated: python -m deploy.profiles.cpu_small (do not edit). The `small` test model (56.6M
parameters, fp32, deploy/vllm/README.md) on one core of this 2-core machine, vLLM CPU build with
kvshuttle's NIXL fixes.
prefill: fitted to the TTFTs of {where}:
  {len(cold)} recomputes, prefix caching off on P ({span(cold, 0)} computed, {span(cold, 2)} ms);
  {len(warm)} with it on ({span(warm, 0)} computed on {span(warm, 1)} cached: turn 1's prompt;
  {span(warm, 2)} ms); {len(read)} reuses, caching off ({span(read, 0)} computed on {span(read, 1)}
  read from D; {span(read, 2)} ms less the read's link time): {fit.describe()}.
  A TTFT's non-prefill part (P -> D transfer, D's first step, HTTP) is in the terms as fitted.
link: a D -> P read of 122.5 MB took 33 ms (3.7 GB/s), 5 ms fixed.
decode: NOT measured. Assumed compute-bound like prefill on this core: per_seq_ms = prefill's
  per_token_ms, per_ctx_token_ns = its per_pair_ns, fixed_ms 20 (the first direct-prefill fit's).
engine: 1 GiB of KV (VLLM_CPU_KVCACHE_SPACE) / 16 KiB per token (8 layers x 4 KV heads x 64 x
  (K, V) x 4 bytes); block 32 (deploy/local/launch.py); 2048 batched tokens and 128 sequences
  are vLLM's CPU defaults. CommitTurn timings recalibrate prefill and link on the running system.
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.profiles.cpu_small")
    parser.add_argument("--results", type=Path, help="default: the newest bench/results/e2e_vllm-*.json")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    source = (args.results or latest_results()).resolve()
    points = ttft_points(json.loads(source.read_text()))
    profile, fit = build_profile(points)
    args.out.write_text(profile_toml(profile, header(source, points, fit)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
