"""The comparison's PNGs (issue 20 §4), from the result rows (run.py): one panel per workload
and rate, one line per policy.

- `ttft_cdf`: each policy's TTFT CDF (report.py's percentiles), log time axis
- `decode_kv_blocks`: the decode engines' KV blocks over the step (run.py's KvSampler), in use
  (wide) and held for a next turn's reader (dashed)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

Row = dict[str, Any]


def panels(rows: Sequence[Row]) -> list[tuple[str, float, list[Row]]]:
    """(workload, rate, its rows in policy order), workloads in order of appearance, rates increasing."""
    keys: list[tuple[str, float]] = []
    for row in rows:
        key = (row.get("workload", "-"), row["rate"])
        if key not in keys:
            keys.append(key)
    workloads = list(dict.fromkeys(w for w, _ in keys))
    keys.sort(key=lambda k: (workloads.index(k[0]), k[1]))
    return [
        (w, r, [row for row in rows if (row.get("workload", "-"), row["rate"]) == (w, r)]) for w, r in keys
    ]


def _figure(count: int) -> tuple[Any, list[Axes]]:
    cols = min(count, 2)
    nrows = (count + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4.2 * nrows), squeeze=False)
    flat = [ax for line in axes for ax in line]
    for ax in flat[count:]:
        ax.set_visible(False)
    return fig, flat[:count]


def _save(fig: Any, title: str, path: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_cdf(rows: Sequence[Row], path: Path, title: str) -> Path:
    groups = panels(rows)
    fig, axes = _figure(len(groups))
    for ax, (workload, rate, members) in zip(axes, groups, strict=True):
        for row in members:
            cdf = row["summary"]["ttft_cdf_ms"]
            points = [(v / 1e3, int(k[1:]) / 100) for k, v in cdf.items() if v is not None]
            if points:
                ax.plot([x for x, _ in points], [y for _, y in points], label=row["policy"])
        ax.set_xscale("log")
        ax.axvline(2.0, color="grey", linestyle=":", linewidth=1)  # the TTFT SLO
        ax.set(
            title=f"{workload}, {rate:g} sessions/s", xlabel="TTFT (s, profile time)", ylabel="share of turns"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, title, path)


def decode_kv_blocks(rows: Sequence[Row], path: Path, title: str) -> Path:
    groups = panels(rows)
    fig, axes = _figure(len(groups))
    for ax, (workload, rate, members) in zip(axes, groups, strict=True):
        for row in members:
            series = row.get("decode_kv_blocks") or []
            t = [p[0] for p in series]
            # In use wide and pale, held thin and dashed on it: they coincide where only retained
            # blocks are left.
            (line,) = ax.plot(t, [p[1] for p in series], label=row["policy"], linewidth=3, alpha=0.4)
            ax.plot(t, [p[2] for p in series], color=line.get_color(), linestyle="--", linewidth=1.2)
        ax.set(title=f"{workload}, {rate:g} sessions/s (dashed: held for a next turn)",
               xlabel="s into the step (profile time)", ylabel="decode KV blocks, all D")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, title, path)


def write(rows: Sequence[Row], json_path: Path, title: str) -> list[Path]:
    """Both PNGs beside the result JSON (its name, suffixed)."""
    stem = json_path.with_suffix("")
    return [
        ttft_cdf(rows, stem.with_name(stem.name + "-ttft-cdf.png"), title),
        decode_kv_blocks(rows, stem.with_name(stem.name + "-decode-kv.png"), title),
    ]


__all__ = ["decode_kv_blocks", "panels", "ttft_cdf", "write"]
