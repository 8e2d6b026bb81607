"""The cluster-scale comparison (issue 20): every policy on the same emulated engines
(bench/emulator: profile-timed vLLM + NixlConnector stand-ins in this process), the same traces
and the same session rates, one run; a table per workload, policy and rate, the JSON and PNGs.

    python -m bench.cluster --quick            # 2P+2D, 20 agent sessions, one rate: a few minutes
    python -m bench.cluster                    # the full comparison (make bench-cluster): <= 20 minutes
    python -m bench.cluster --trace T.jsonl --rates 0.2,0.5 --prefill 4 --decode 4 --policies proxy,kvshuttle

Policies (bench/cluster/policies.py, kvshuttle_policy.py): recompute, proxy, prefix-aware,
affinity-local, kvshuttle. Workloads (bench/cluster/plan.py): the Mooncake conversation trace
(sampled with `--seed`, its turn gaps divided by `--gap-divisor`), the synthetic agent loop
(generated with `--seed`), or a session trace (`--trace`); each rate replays rate x `--window`
sessions of its own, the same ones for every policy, and sends no turn past `--horizon` into the
step. Turns past `--max-turns` per session are dropped and answers capped at `--max-output`
tokens. Figures: bench/cluster/report.py, plots.py. Writes bench/results/cluster-<utc>.json and
its PNGs.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.cluster import plots
from bench.cluster.plan import Workload, sessions_per_rate
from bench.cluster.report import table
from bench.cluster.run import POLICIES, ClusterRun, run_policy
from bench.emulator.http.config import engine_profile
from bench.emulator.http.tokenizer import make_tokenizer
from bench.report import ROOT, save

PROFILES = ROOT / "deploy" / "profiles"
QUICK = {
    "policies": "recompute,proxy,prefix-aware,affinity-local,kvshuttle",
    "prefill": 2,
    "decode": 2,
    "workloads": "agent",
    "rates": "1",
    "window": 20.0,
    "horizon": None,
    "max_turns": 6,
    "max_output": 128,
    "time_scale": 0.5,
}
# The comparison, sized to <= 20 minutes here (bench/cluster/README.md): 8P+8D at time
# scale 1, each workload at a rate far from and one near recompute's saturation.
FULL = {
    # kvshuttle as shipped and with each of parking and prefetch off (kvshuttle-no-extend: ask).
    "policies": "recompute,proxy,prefix-aware,affinity-local,"
    "kvshuttle,kvshuttle-no-park,kvshuttle-no-prefetch",
    "prefill": 8,
    "decode": 8,
    "workloads": "mooncake,agent",
    "rates": None,  # each workload's own (FULL_RATES)
    "window": 21.0,
    "horizon": 28.0,
    "max_turns": 8,
    "max_output": 128,
    "time_scale": 1.0,
}
FULL_RATES = {"mooncake": (2.0, 8.0), "agent": (1.0, 2.5)}


def workloads(args: argparse.Namespace) -> list[Workload]:
    names = [str(args.trace)] if args.trace is not None else args.workloads.split(",")
    unknown = [n for n in names if n not in FULL_RATES and args.trace is None]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {sorted(FULL_RATES)} or give --trace")
    if args.rates is None and args.trace is not None:
        raise SystemExit("--trace needs --rates")
    return [
        Workload(n, tuple(float(r) for r in args.rates.split(",")) if args.rates else FULL_RATES[n])
        for n in names
    ]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small comparison: " + str(QUICK))
    ap.add_argument("--policies", help=f"of {', '.join(POLICIES)}")
    ap.add_argument("--profile", type=Path, default=PROFILES / "qwen3-32b-h200-tp2.toml")
    ap.add_argument("--prefill", type=int)
    ap.add_argument("--decode", type=int)
    ap.add_argument("--workloads", help="of mooncake (the conversation trace) and agent (the synthetic loop)")
    ap.add_argument("--trace", type=Path, help="a session-trace JSONL instead of --workloads (needs --rates)")
    ap.add_argument("--rates", help="session starts per second (profile time), one step each")
    ap.add_argument("--window", type=float, help="each rate replays rate x this many seconds of sessions")
    ap.add_argument("--horizon", type=float, help="no turn is sent later than this into a step (s)")
    ap.add_argument("--gap-divisor", type=float, default=60.0,
                    help="mooncake: the gaps between a session's turns divided by this")  # fmt: skip
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
        horizon_s=args.horizon,
    )
    plan = [
        (w.name if w.name in FULL_RATES else Path(w.name).stem,
         sessions_per_rate(w, window_s=args.window, seed=args.seed, gap_divisor=args.gap_divisor))
        for w in workloads(args)
    ]  # fmt: skip
    began, started = time.monotonic(), datetime.now(UTC)

    def log(line: str) -> None:
        print(f"[{time.monotonic() - began:5.0f} s] {line}", flush=True)

    gpus = (run.prefill + run.decode) * run.profile.hardware.gpus_per_engine
    hardware = run.profile.hardware
    title = f"{run.profile.model} {hardware.gpu} TP{hardware.tp}, {run.prefill}P+{run.decode}D"
    rows: list[dict[str, Any]] = []
    for workload, steps in plan:
        for name in policies:
            got, _ = asyncio.run(run_policy(name, run, steps, log, workload=workload))
            rows += got
            out: dict[str, Any] = {"total_wall_s": round(time.monotonic() - began, 1), "rows": rows,
                                   "profile": run.profile.model, "gpus": gpus}  # fmt: skip
            path = save("cluster", out, args=args, utc=started)  # after every policy: a stopped run keeps it
    pngs = plots.write(rows, path, title)
    print(table(rows))
    print(f"total {time.monotonic() - began:.0f} s; wrote {path}, {', '.join(p.name for p in pngs)}")


if __name__ == "__main__":
    main()
