"""What a fleet run reports: each run's figures (`figures`), each policy's capacity per GPU from
the rate sweep (`capacity`), and the result file's top-level `summary`.

A turn that was cut, failed or never got its first token counts as a miss in every percentile
(an infinite TTFT), so a policy cannot look faster by dropping turns. First turns (a session's
first request, nothing to reuse) and later turns are reported apart; the SLO gates later turns
only: TTFT p90 <= `TTFT_P90_SLO_S` and ITL p99 <= `ITL_P99_SLO_S` over every token of every
later turn.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from bench.fleet.run import RunResult

__all__ = ["ITL_P99_SLO_S", "TTFT_P90_SLO_S", "best_peer_rates", "capacity", "figures", "summary", "table"]

TTFT_P90_SLO_S: Final = 2.0
ITL_P99_SLO_S: Final = 0.100
PEERS: Final = ("llm-d", "dynamo", "affinity-local", "prefix-aware", "recompute")


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    v = float(np.percentile(np.asarray(values, dtype=float), q, method="higher"))
    return v


def _ms(value: float | None) -> float | None:
    if value is None:
        return None
    return math.inf if math.isinf(value) else round(value * 1e3, 1)


def figures(run: RunResult) -> dict[str, Any]:
    """The run's figures over its measured turns (sent in [warmup_s, window_s))."""
    begin, end = run.spec.get("warmup_s", 0.0), run.spec.get("window_s", math.inf)
    records = [r for r in run.result.records if begin <= r.sent_s < end]
    first = [r for r in records if r.turn == 0]
    later = [r for r in records if r.turn > 0]

    def ttfts(rs: Sequence[Any]) -> list[float]:
        return [math.inf if (r.error or r.ttft_s is None) else r.ttft_s for r in rs]

    def quantiles(rs: Sequence[Any]) -> dict[str, float | None]:
        t = ttfts(rs)
        return {f"p{q}": _ms(_pct(t, q)) for q in (50, 90, 99)}

    later_itl = [g for r in later for g in ([r.itl_max_s] if r.itl_max_s is not None else [])]
    itl = run.result.itl_s
    answered = [r for r in records if not r.error and r.ttft_s is not None]
    prefill_s = sum(e["prefill_s"] for e in run.engines.values())
    turns = max(1, len(records))
    later_p90 = _pct(ttfts(later), 90)
    itl_p99 = _pct(itl, 99)
    collapsed = run.result.collapsed_at_s
    ok = (
        collapsed is None
        and later_p90 is not None
        and later_p90 <= TTFT_P90_SLO_S
        and (itl_p99 or 0.0) <= ITL_P99_SLO_S
    )
    return {
        **run.spec,
        "turns": len(records),
        "turns_simulated": len(run.result.records),
        "first_turns": len(first),
        "later_turns": len(later),
        "missed": len(records) - len(answered),
        "wrong": sum(r.wrong for r in records),
        "slo_ok": bool(ok) and bool(later),
        "collapsed_at_s": None if collapsed is None else round(collapsed, 1),
        "ttft_first_ms": quantiles(first),
        "ttft_later_ms": quantiles(later),
        "itl_ms": {"p50": _ms(_pct(itl, 50)), "p99": _ms(itl_p99)},
        "itl_worst_gap_later_p99_ms": _ms(_pct(later_itl, 99)),
        "prefill_gpu_s_per_turn": round(prefill_s * run.spec.get("gpus_per_engine", 1) / turns, 4),
        "bytes_per_turn": {
            "rdma_read": round(sum(r.read_bytes for r in records) / turns),
            "host_load": round(sum(r.host_bytes for r in records) / turns),
        },
        "tokens_per_turn": {
            "computed": round(sum(r.computed_tokens for r in records) / turns),
            "reused": round(sum(r.reused_tokens for r in records) / turns),
            "read": round(sum(r.read_tokens for r in records) / turns),
            "host": round(sum(r.host_tokens for r in records) / turns),
        },
        "decisions": dict(Counter(f"{r.decision}:{r.reason}" for r in records).most_common()),
        "occupancy": run.occupancy,
        "engines": _by_role(run.engines),
        "cpu_s": round(run.cpu_s, 2),
        "virtual_s": round(run.virtual_s, 1),
        "turns_per_cpu_s": round(len(run.result.records) / max(run.cpu_s, 1e-9), 1),
    }


def _by_role(engines: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Engine counters summed per role (prefill-N, decode-N)."""
    out: dict[str, dict[str, float]] = {}
    for name, counters in engines.items():
        into = out.setdefault(name.rsplit("-", 1)[0], {"engines": 0})
        into["engines"] += 1
        for key, value in counters.items():
            into[key] = round(into.get(key, 0) + value, 3)
    return out


def capacity(rows: Sequence[Mapping[str, Any]], gpus: int) -> dict[str, dict[str, dict[str, Any]]]:
    """workload -> policy -> {"median", "seeds"}: per seed, the highest rate of the sweep at
    which the SLO held at it and at every lower rate, per GPU (0 when none did)."""
    by: dict[tuple[str, str, int], list[tuple[float, bool]]] = {}
    for row in rows:
        by.setdefault((row["workload"], row["policy"], row["seed"]), []).append((row["rate"], row["slo_ok"]))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    per_seed: dict[tuple[str, str], list[float]] = {}
    for (workload, policy, _seed), steps in sorted(by.items()):
        best = 0.0
        for rate, ok in sorted(steps):
            if not ok:
                break
            best = rate
        per_seed.setdefault((workload, policy), []).append(best / gpus)
    for (workload, policy), values in per_seed.items():
        out.setdefault(workload, {})[policy] = {
            "median": round(statistics.median(values), 6),
            "seeds": [round(v, 6) for v in values],
        }
    return out


def best_peer_rates(rows: Sequence[Mapping[str, Any]], gpus: int) -> dict[str, float]:
    """workload -> the sweep's rate at the best peer's median capacity (the sweep's lowest rate
    when no peer met the SLO at any)."""
    out: dict[str, float] = {}
    for workload, policies in capacity(rows, gpus).items():
        peers = {p: c["median"] for p, c in policies.items() if p in PEERS}
        if not peers:
            continue
        rate = max(peers.values()) * gpus
        rates = sorted({r["rate"] for r in rows if r["workload"] == workload})
        out[workload] = min(rates, key=lambda r: abs(r - rate)) if rate > 0 else rates[0]
    return out


def summary(rows: Sequence[Mapping[str, Any]], gpus: int) -> dict[str, Any]:
    caps = capacity(rows, gpus)
    at_best: dict[str, dict[str, float | None]] = {}
    for workload, at in best_peer_rates(rows, gpus).items():
        at_best[workload] = {}
        for policy in caps[workload]:
            p99s = [
                r["ttft_later_ms"]["p99"]
                for r in rows
                if r["workload"] == workload and r["policy"] == policy and r["rate"] == at
            ]
            values = [v for v in p99s if v is not None]
            at_best[workload][policy] = statistics.median(values) if values else None
    wrong: dict[str, dict[str, int]] = {}
    for r in rows:
        wrong.setdefault(r["workload"], {}).setdefault(r["policy"], 0)
        wrong[r["workload"]][r["policy"]] += r["wrong"]
    return {
        "policies": sorted({r["policy"] for r in rows}),
        "workloads": sorted({r["workload"] for r in rows}),
        "seeds": sorted({r["seed"] for r in rows}),
        "gpus": gpus,
        "capacity_per_gpu": caps,
        "ttft_p99_later_at_best_peer_capacity_ms": at_best,
        "wrong": wrong,
    }


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = (
        f"{'workload':12} {'policy':17} {'rate':>6} {'seed':>4} {'turns':>6} {'miss':>4} {'wrong':>5} "
        f"{'SLO':>3} {'TTFT1 p50':>9} {'later p50':>9} {'p90':>8} {'p99':>8} {'ITL p99':>7} "
        f"{'pfGPUs':>6} {'MB/turn':>7} {'t/cpu-s':>7}  decisions"
    )
    lines = [head]

    def f(v: float | None) -> str:
        return "-" if v is None else ("inf" if math.isinf(v) else f"{v:.0f}")

    for r in rows:
        mb = (r["bytes_per_turn"]["rdma_read"] + r["bytes_per_turn"]["host_load"]) / 2**20
        decisions = ", ".join(f"{k} {v}" for k, v in r["decisions"].items())[:80]
        lines.append(
            f"{r['workload']:12} {r['policy']:17} {r['rate']:6.3f} {r['seed']:4d} {r['turns']:6d} "
            f"{r['missed']:4d} {r['wrong']:5d} {'ok' if r['slo_ok'] else '--':>3} "
            f"{f(r['ttft_first_ms']['p50']):>9} {f(r['ttft_later_ms']['p50']):>9} "
            f"{f(r['ttft_later_ms']['p90']):>8} {f(r['ttft_later_ms']['p99']):>8} {f(r['itl_ms']['p99']):>7} "
            f"{r['prefill_gpu_s_per_turn']:6.2f} {mb:7.0f} {r['turns_per_cpu_s']:7.0f}  {decisions}"
        )
    return "\n".join(lines)
