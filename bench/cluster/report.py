"""Per policy and rate, the figures of issue 20 §4 from the turn records and the cluster's
counters, and the table `python -m bench.cluster` prints. Times in the profile's (emulated)
seconds.

- TTFT p50/p90/p99 and its CDF (the TTFT at every percentile, 1-99), inter-token latency p50/p99
  (every gap between two streamed tokens of every turn)
- goodput: turns served within the SLO (TTFT <= 2 s and the turn's mean ITL <= 100 ms) per
  second of the run, per GPU
- prefill GPU-seconds per turn: the engines' modelled prefill time (every GPU of an engine), decode
  nodes' local prefills included; bytes moved per turn: KV read between engines
- the prefill nodes' busy share (how near saturation P is), parked bytes (KV kvshuttle's agents
  parked in their host pools over the step; 0 for the other policies)
- reuse ratio: prompt tokens not computed (found in a prefix cache or read) / prompt tokens
- decisions by reason, wrong answers, errors, and the control plane's CPU per turn (kvshuttle:
  its services' processes; the client-side policies: this process's thread time deciding)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.cluster.replay import CUT, TurnRecord

TTFT_SLO_S = 2.0
ITL_SLO_S = 0.1


def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def good(record: TurnRecord) -> bool:
    if record.error is not None or record.wrong or record.ttft_s is None:
        return False
    mean_itl = sum(record.itl_s) / len(record.itl_s) if record.itl_s else 0.0
    return record.ttft_s <= TTFT_SLO_S and mean_itl <= ITL_SLO_S


def summarize(
    records: Sequence[TurnRecord],
    counters: dict[str, float],
    *,
    gpus: int,
    wall_s: float,
    cpu_s: float,
    prefill_gpus: int | None = None,
) -> dict[str, Any]:
    """`prefill_gpus`: the prefill nodes' GPUs, for their busy share (None: not reported)."""
    served = [r for r in records if r.error is None and r.ttft_s is not None]
    ttft = [r.ttft_s for r in served if r.ttft_s is not None]
    itl = [gap for r in served for gap in r.itl_s]
    turns = len(served) or 1
    prompt = sum(r.prompt_tokens for r in served)
    return {
        "turns": len(records),
        "served": len(served),
        "errors": sum(r.error is not None for r in records),
        "cut": sum(r.error == CUT for r in records),  # of the errors: in flight at the step's end
        "wrong": sum(r.wrong for r in served),
        "edited_turns": sum(r.edited for r in records),
        "wrong_on_edited": sum(r.wrong and r.edited for r in served),
        "ttft_ms": {q: _ms(quantile(ttft, v)) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "ttft_cdf_ms": {f"p{p}": _ms(quantile(ttft, p / 100)) for p in range(1, 100)},
        "itl_ms": {q: _ms(quantile(itl, v)) for q, v in (("p50", 0.5), ("p99", 0.99))},
        "goodput_turns_per_s_per_gpu": round(sum(good(r) for r in records) / wall_s / gpus, 4)
        if wall_s
        else 0.0,
        "slo_attainment": round(sum(good(r) for r in records) / len(records), 3) if records else 0.0,
        "prefill_gpu_s_per_turn": round(counters["prefill_gpu_s"] / turns, 4),
        "gpu_busy_s_per_turn": round(counters["gpu_busy_s"] / turns, 4),
        "bytes_moved_per_turn": round(counters["bytes_moved"] / turns),
        "prefill_nodes_busy": round(counters["prefill_nodes_busy_gpu_s"] / wall_s / prefill_gpus, 3)
        if prefill_gpus and wall_s
        else None,
        # Moved into the agents' host pools: kvshuttle's run sets it from the agents' metrics.
        "parked_bytes": 0,
        "reuse_ratio": round(sum(r.reused_tokens for r in served) / prompt, 3) if prompt else 0.0,
        "mean_prompt_tokens": round(prompt / turns),
        "decisions": dict(Counter(r.reason for r in served)),
        "control_plane_cpu_ms_per_turn": round(cpu_s / turns * 1e3, 2),
        "wall_s": round(wall_s, 1),
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (workload, policy, rate)."""
    head = (f"{'workload':8} {'policy':16} {'rate':>5} {'P busy':>6} {'turns':>5} {'wrong':>5} {'err':>3} "
            f"{'cut':>3} {'TTFT p50':>8} {'p90':>7} {'p99':>7} {'ITL p50':>7} {'p99':>6} {'goodput':>8} "
            f"{'SLO':>5} {'pf GPU-s':>8} {'MB/turn':>8} {'park MB':>7} {'reuse':>5} {'cpu ms':>6}  "
            "decisions")  # fmt: skip
    lines = [head]

    def f(value: float | None, width: int, digits: int = 0) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"

    for row in rows:
        s = row["summary"]
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(s["decisions"].items()))
        lines.append(
            f"{row.get('workload', '-'):8} {row['policy']:16} {row['rate']:5.2f} "
            f"{f(s.get('prefill_nodes_busy'), 6, 2)} {s['turns']:5d} {s['wrong']:5d} {s['errors']:3d} "
            f"{s.get('cut', 0):3d} "
            f"{f(s['ttft_ms']['p50'], 8)} {f(s['ttft_ms']['p90'], 7)} {f(s['ttft_ms']['p99'], 7)} "
            f"{f(s['itl_ms']['p50'], 7, 1)} {f(s['itl_ms']['p99'], 6, 1)} "
            f"{s['goodput_turns_per_s_per_gpu']:8.4f} {s['slo_attainment']:5.2f} "
            f"{s['prefill_gpu_s_per_turn']:8.3f} {s['bytes_moved_per_turn'] / 1e6:8.1f} "
            f"{s.get('parked_bytes', 0) / 1e6:7.1f} "
            f"{s['reuse_ratio']:5.2f} {s['control_plane_cpu_ms_per_turn']:6.2f}  {decisions}"
        )
    return "\n".join(lines)


__all__ = ["ITL_SLO_S", "TTFT_SLO_S", "good", "quantile", "summarize", "table"]
