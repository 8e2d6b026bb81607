"""The chaos suite's report: one row per scenario (turns, served, reused, wrong, retentions
lost), printed as a table at the end of the run and saved as JSON, `chaos-<utc>.json` under
$KVSHUTTLE_RESULTS_DIR (`make chaos`: bench/results) or .run/results, so that a test run leaves
the work tree clean.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos.workload import TurnRecord, records_json

from bench import report

ROOT = Path(__file__).resolve().parents[2]


def results_dir() -> Path:
    return Path(os.environ.get("KVSHUTTLE_RESULTS_DIR") or ROOT / ".run" / "results")


@dataclass
class ScenarioResult:
    scenario: str
    setup: str  # store and replicas
    turns: int
    served: int
    reused: int
    wrong: int
    # None where the fault drops retentions by design (a node's lease lapsed, its engine restarted).
    retentions_lost: int | None
    retentions_before: int
    # Turns that may go unserved and why ("" when every turn must be served).
    allowance: str
    seconds: float
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    turn_log: list[dict[str, Any]] = field(default_factory=list)


def phases(turns: list[TurnRecord]) -> dict[str, dict[str, Any]]:
    """Per phase, in the order first seen: turns, served, reused and the routers' reasons."""
    out: dict[str, dict[str, Any]] = {}
    for t in turns:
        row = out.setdefault(t.phase, {"turns": 0, "served": 0, "reused": 0, "reasons": Counter()})
        row["turns"] += 1
        row["served"] += t.served
        row["reused"] += t.served and t.decision == "reuse"
        row["reasons"][t.reason or f"http_{t.status}"] += 1
    for row in out.values():
        row["reasons"] = dict(row["reasons"])
    return out


def scenario_result(
    scenario: str,
    setup: str,
    turns: list[TurnRecord],
    *,
    wrong: int,
    retentions_before: int,
    retentions_lost: int | None,
    seconds: float,
    allowance: str = "",
    notes: dict[str, Any] | None = None,
) -> ScenarioResult:
    return ScenarioResult(
        scenario=scenario,
        setup=setup,
        turns=len(turns),
        served=sum(t.served for t in turns),
        reused=sum(t.served and t.decision == "reuse" for t in turns),
        wrong=wrong,
        retentions_lost=retentions_lost,
        retentions_before=retentions_before,
        allowance=allowance,
        seconds=round(seconds, 1),
        phases=phases(turns),
        notes=notes or {},
        turn_log=records_json(turns),
    )


def table(results: list[ScenarioResult]) -> str:
    columns = ("turns", "served", "reused", "wrong")
    head = (
        f"{'scenario':34s} {'setup':30s} "
        + " ".join(f"{c:>6s}" for c in columns)
        + f" {'lost':>6s} {'s':>6s}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lost = "n/a" if r.retentions_lost is None else f"{r.retentions_lost}/{r.retentions_before}"
        counts = " ".join(f"{getattr(r, c):6d}" for c in columns)
        lines.append(f"{r.scenario:34s} {r.setup:30s} {counts} {lost:>6s} {r.seconds:6.1f}")
    return "\n".join(lines)


def save(results: list[ScenarioResult], suite_seconds: float) -> Path:
    figures = {"suite_s": round(suite_seconds, 1), "scenarios": [asdict(r) for r in results]}
    return report.save("chaos", figures, args=None, directory=results_dir())
