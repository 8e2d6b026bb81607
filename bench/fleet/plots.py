"""The fleet benchmark's PNGs, beside its result file:

- `-ttft-cdf.png`: later turns' TTFT CDF per policy, one panel per workload at the best peer's
  capacity (seed 1 where there; misses at the right edge), log time axis
- `-occupancy.png`: decode HBM and host-tier occupancy over the run, same runs
- `-capacity.png`: capacity per GPU per policy and workload, median with the seeds' range
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

Row = Mapping[str, Any]


def _panels(count: int) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(1, count, figsize=(6.0 * count, 4.2), squeeze=False)
    return fig, list(axes[0])


def _pick(rows: Sequence[Row], workload: str, rate: float) -> list[Row]:
    """One run per policy at `rate` (the lowest seed's)."""
    out: dict[str, Row] = {}
    for r in sorted(rows, key=lambda r: r["seed"]):
        if r["workload"] == workload and r["rate"] == rate:
            out.setdefault(r["policy"], r)
    return list(out.values())


def plots(
    rows: Sequence[Row],
    turns: Sequence[Mapping[str, Any]],
    at: Mapping[str, float],
    summary: Mapping[str, Any],
    stem: Path,
) -> list[Path]:
    paths = []
    workloads = [w for w in summary["workloads"] if w in at]
    if workloads:
        fig, axes = _panels(len(workloads))
        for ax, workload in zip(axes, workloads, strict=True):
            rate = at[workload]
            for row in _pick(rows, workload, rate):
                ttfts = sorted(
                    math.inf if (t["error"] or t["ttft_s"] is None) else t["ttft_s"]
                    for t in turns
                    if t["policy"] == row["policy"]
                    and t["workload"] == workload
                    and t["rate"] == rate
                    and t["seed"] == row["seed"]
                    and t["turn"] > 0
                )
                if not ttfts:
                    continue
                finite = [min(t, 1e4) for t in ttfts]
                ax.plot(finite, np.arange(1, len(finite) + 1) / len(finite), label=row["policy"])
            ax.set_xscale("log")
            ax.set_xlabel("TTFT of later turns (s)")
            ax.set_ylabel("CDF")
            ax.axvline(2.0, color="grey", linestyle=":")
            ax.set_title(f"{workload} at {rate:g} sessions/s")
            ax.legend(fontsize=7)
        paths.append(_save(fig, stem.with_name(stem.name + "-ttft-cdf.png")))
        fig, axes = _panels(len(workloads))
        for ax, workload in zip(axes, workloads, strict=True):
            for row in _pick(rows, workload, at[workload]):
                occ = row["occupancy"]
                if not occ:
                    continue
                t = [o["t"] for o in occ]
                line = ax.plot(t, [o["decode_hbm"] for o in occ], label=f"{row['policy']} D HBM")[0]
                if any(o["decode_host"] or o["prefill_host"] for o in occ):
                    ax.plot(
                        t,
                        [max(o["decode_host"], o["prefill_host"]) for o in occ],
                        linestyle="--",
                        color=line.get_color(),
                    )
            ax.set_xlabel("s")
            ax.set_ylabel("share in use (dashed: host tier)")
            ax.set_title(f"{workload} at {at[workload]:g} sessions/s")
            ax.legend(fontsize=6)
        paths.append(_save(fig, stem.with_name(stem.name + "-occupancy.png")))
    caps = summary["capacity_per_gpu"]
    if caps:
        fig, axes = _panels(len(caps))
        for ax, (workload, policies) in zip(axes, sorted(caps.items()), strict=True):
            names = sorted(policies)
            med = [policies[p]["median"] for p in names]
            lo = [m - min(policies[p]["seeds"]) for p, m in zip(names, med, strict=True)]
            hi = [max(policies[p]["seeds"]) - m for p, m in zip(names, med, strict=True)]
            ax.bar(names, med, yerr=[lo, hi], capsize=3)
            ax.set_title(f"{workload}: sessions/s per GPU at the SLO")
            ax.tick_params(axis="x", rotation=60, labelsize=7)
        paths.append(_save(fig, stem.with_name(stem.name + "-capacity.png")))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
