"""The fleet simulator's own speed: simulated turns per CPU-second of single runs (one policy, one
workload, one rate and seed, 8P+8D as `python -m bench.fleet` runs them), and a digest of each
run's per-turn records and token gaps, so that a change meant only to be faster can be shown to
simulate exactly the same.

    python -m bench.fleet.speed                                  # every policy and workload
    python -m bench.fleet.speed --before 8c6bd9e --repeat 3      # and that commit's, side by side
    python -m bench.fleet.speed --cases kvshuttle:agent:2.0:1,llm-d:claude-code:0.04:3

Each run is a fresh process (`python -m bench.fleet.speed --one CASE`); with `--before`, the
commit's tree (git archive) runs each case right before this tree does, so both see the same
machine load. A case's CPU time is `run`'s own (bench/fleet/run.py), the least of `--repeat`
runs; the figures go to bench/results/fleet-speed-<UTC>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

from bench.cluster.plan import TRACES
from bench.fleet.__main__ import _args, _spec
from bench.fleet.run import POLICIES, run
from bench.report import ROOT, save

# Every policy on every workload, at a rate each sweep of the last full run reached
# (bench/results/fleet-20261206T224550Z.json); Claude Code's seed 2 has the most sessions there.
CASES: Final = tuple(
    f"{policy}:{workload}"
    for workload in ("agent:2.0:1", "mooncake:2.0:1", "claude-code:0.04:2")
    for policy in POLICIES
)


def digest(records: Sequence[Any], itl_s: Sequence[float]) -> str:
    """What a run simulated, every per-turn record and token gap, as one hash."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps(asdict(r), sort_keys=True).encode())
    h.update(json.dumps(list(itl_s)).encode())
    return h.hexdigest()[:16]


def one(case: str) -> dict[str, Any]:
    """One run of `case` (policy:workload:rate:seed) in this process, from whichever tree
    `bench` is imported."""
    policy, workload, rate, seed = case.split(":")
    spec = _spec(_args([]), workload, policy, float(rate), int(seed))
    out = run(spec)
    return {
        "turns": len(out.result.records),
        "cpu_s": out.cpu_s,
        "digest": digest(out.result.records, out.result.itl_s),
    }


def _in(tree: Path, case: str) -> dict[str, Any]:
    """`one(case)` in a fresh process whose `bench` and `kvshuttle` are `tree`'s."""
    path = os.pathsep.join(str(tree / p) for p in ("", "services", "clients"))
    env = dict(os.environ, PYTHONPATH=path, KVSHUTTLE_TRACES=str(TRACES))  # an archived tree has none
    done = subprocess.run(
        [sys.executable, __file__, "--one", case],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"{case} in {tree} failed:\n{done.stderr}")
    row: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return row


def _least(tree: Path, case: str, repeat: int) -> dict[str, Any]:
    runs = [_in(tree, case) for _ in range(repeat)]
    if len({r["digest"] for r in runs}) != 1:
        raise RuntimeError(f"{case} in {tree}: one tree, different records: not deterministic")
    return min(runs, key=lambda r: r["cpu_s"])


def _tree(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _rate(row: dict[str, Any]) -> float:
    return round(float(row["turns"]) / max(float(row["cpu_s"]), 1e-9), 1)


def main(argv: Sequence[str] | None = None) -> int:
    doc = (__doc__ or "").split("\n")[0]
    ap = argparse.ArgumentParser(prog="python -m bench.fleet.speed", description=doc)
    ap.add_argument("--cases", default=",".join(CASES), help="policy:workload:rate:seed, comma separated")
    ap.add_argument("--before", help="a git revision to run each case with too")
    ap.add_argument("--repeat", type=int, default=1, help="runs per case and tree (the least CPU counts)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one)))
        return 0
    rows, changed = [], []
    print(f"{'case':38} {'turns':>6} {'cpu_s':>7} {'t/cpu-s':>8} {'before':>8} {'x':>6}  digest", flush=True)
    with tempfile.TemporaryDirectory(prefix="fleet-speed-") as tmp:
        before_tree = _tree(args.before, Path(tmp)) if args.before else None
        for case in args.cases.split(","):
            before = _least(before_tree, case, args.repeat) if before_tree is not None else None
            after = _least(ROOT, case, args.repeat)
            row: dict[str, Any] = {"case": case, **after, "turns_per_cpu_s": _rate(after)}
            line = f"{case:38} {after['turns']:6} {after['cpu_s']:7.2f} {row['turns_per_cpu_s']:8.1f}"
            if before is not None:
                row["before"] = {**before, "turns_per_cpu_s": _rate(before)}
                row["speedup"] = round(before["cpu_s"] / max(after["cpu_s"], 1e-9), 2)
                line += f" {_rate(before):8.1f} {row['speedup']:6.2f}"
                if before["digest"] != after["digest"]:
                    changed.append(case)
            print(f"{line}  {after['digest']}{' CHANGED' if case in changed else ''}", flush=True)
            rows.append(row)
    figures = {"runs": rows, "changed": changed}
    path = save("fleet-speed", figures, args=vars(args), directory=args.out)
    print(path)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
