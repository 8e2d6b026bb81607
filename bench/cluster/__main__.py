"""The cluster-scale comparison (issue 20): every policy on the same emulated engines
(deploy/standin: profile-timed vLLM + NixlConnector stand-ins in this process), the same trace
and the same session rates, one run; a table per policy and rate, and the JSON.

    python -m bench.cluster --quick            # 2P+2D, 20 agent sessions, one rate: a few minutes
    python -m bench.cluster                    # the full comparison (make bench-cluster)
    python -m bench.cluster --trace T.jsonl --rates 0.2,0.5 --prefill 4 --decode 4 --policies proxy,kvshuttle

Policies (bench/cluster/policies.py, kvshuttle_policy.py): recompute, proxy, prefix-aware,
affinity-local, kvshuttle. Workload: a session trace (bench/cluster/workload; `--trace`), or the
synthetic agent loop (workload/agent.py) generated with `--seed`; each rate replays
`--sessions` sessions of its own, the same ones for every policy. Turns past `--max-turns` per
session are dropped and answers capped at `--max-output` tokens (bounds on the run's length
on this machine). Figures: bench/cluster/report.py. Writes bench/results/cluster-<utc>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from deploy.standin.config import engine_profile
from deploy.standin.tokenizer import make_tokenizer

from bench.cluster.report import table
from bench.cluster.run import POLICIES, ClusterRun, run_policy
from bench.cluster.workload.agent import AgentLoop, generate
from bench.cluster.workload.jsonl import read_sessions
from bench.cluster.workload.model import Session
from bench.report import ROOT, save

PROFILES = ROOT / "deploy" / "profiles"
QUICK = {
    "prefill": 2,
    "decode": 2,
    "sessions": 20,
    "rates": "1",
    "max_turns": 6,
    "max_output": 128,
    "time_scale": 0.5,
}
FULL = {
    "prefill": 4,
    "decode": 4,
    "sessions": 40,
    "rates": "0.5,1",
    "max_turns": 16,
    "max_output": 256,
    "time_scale": 0.5,
}


def workload(args: argparse.Namespace, rates: list[float]) -> list[tuple[float, list[Session]]]:
    """Each rate's sessions: consecutive slices of the trace, or of one generated pool."""
    need = args.sessions * len(rates)
    if args.trace is not None:
        pool = list(read_sessions(args.trace))
        if len(pool) < need:
            raise SystemExit(f"{args.trace}: {len(pool)} sessions; {need} needed")
    else:
        pool = generate(AgentLoop(), sessions=need, seed=args.seed)
    return [(rate, pool[i * args.sessions : (i + 1) * args.sessions]) for i, rate in enumerate(rates)]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small comparison: " + str(QUICK))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--profile", type=Path, default=PROFILES / "qwen3-32b-h200-tp2.toml")
    ap.add_argument("--prefill", type=int)
    ap.add_argument("--decode", type=int)
    ap.add_argument("--trace", type=Path, help="a session-trace JSONL (default: the synthetic agent loop)")
    ap.add_argument("--sessions", type=int, help="sessions per rate")
    ap.add_argument("--rates", help="session starts per second (profile time), one step each")
    ap.add_argument("--max-turns", type=int)
    ap.add_argument("--max-output", type=int)
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--edit-fraction", type=float, default=0.1,
                    help="share of later turns whose history is resent edited")  # fmt: skip
    ap.add_argument("--time-scale", type=float, help="real seconds per profile second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model-dir", type=Path, default=ROOT / ".run" / "models" / "standin")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",")
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    if not (args.model_dir / "tokenizer.json").exists():
        make_tokenizer(args.model_dir)
    run = ClusterRun(
        model_dir=args.model_dir,
        profile=engine_profile(args.profile),
        prefill=args.prefill,
        decode=args.decode,
        time_scale=args.time_scale,
        max_model_len=args.max_model_len,
        max_output=args.max_output,
        max_turns=args.max_turns,
        edit_fraction=args.edit_fraction,
        seed=args.seed,
    )
    steps = workload(args, rates)
    began, started = time.monotonic(), datetime.now(UTC)

    def log(line: str) -> None:
        print(f"[{time.monotonic() - began:5.0f} s] {line}", flush=True)

    rows: list[dict[str, Any]] = []
    for name in policies:
        got, _ = asyncio.run(run_policy(name, run, steps, log))
        rows += got
        out: dict[str, Any] = {"total_wall_s": round(time.monotonic() - began, 1), "rows": rows,
                               "profile": run.profile.model, "gpus": (run.prefill + run.decode)
                               * run.profile.hardware.gpus_per_engine}  # fmt: skip
        path = save("cluster", out, args=args, utc=started)  # after every policy: a stopped run keeps it
    print(table(rows))
    print(f"total {time.monotonic() - began:.0f} s; wrote {path}")


if __name__ == "__main__":
    main()
