"""The fleet simulator's benchmark (issue 29): every policy on every workload, a rate sweep per
workload, three seeds, in virtual time; the table, bench/results/fleet-<UTC>.json (its top-level
`summary` for tools, each run's figures, per-turn records in fleet-<UTC>-turns.jsonl.gz) and PNGs.

    python -m bench.fleet --quick         # 2P+2D, the agent loop, 3 policies, 2 rates, 1 seed
    python -m bench.fleet                 # 8P+8D qwen3-32b-h200-tp2, FULL_RATES, seeds 1-3
    python -m bench.fleet --policies kvshuttle,llm-d --workloads claude-code --rates 0.02,0.04

A policy's sweep stops after `--stop-after` rates in a row missed the SLO (higher rates would
miss too: a fleet past its knee only queues longer). Runs go to `--jobs` processes; each run is
deterministic, whichever process runs it.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from deploy.profiles.schema import EngineProfile, load_engine_profiles

from bench.fleet import report
from bench.fleet.plots import plots
from bench.fleet.run import POLICIES, RunSpec, run
from bench.fleet.workloads import WORKLOADS, arrivals
from bench.report import ROOT, save

PROFILE: Final = ROOT / "deploy/profiles/qwen3-32b-h200-tp2.toml"
MAX_MODEL_LEN: Final = 131_072  # Qwen3-32B with YaRN x4, as Dynamo's and llm-d's agentic runs
# Session rates from light load through every policy's knee (the sweep stops at a policy's
# first miss): the last full run had kvshuttle missing at the lowest Mooncake rate and llm-d
# meeting the SLO at the highest agent rate, so neither end was found.
FULL_RATES: Final = {
    "mooncake": (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0),
    "claude-code": (0.01, 0.02, 0.04, 0.08, 0.16, 0.32),
    "agent": (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0),
}
# Seconds of arrivals; turns are measured after the first quarter (the fleet filling up).
# Claude Code's sessions think for minutes between turns: 10 minutes of arrivals at its low rates
# measured 9-109 turns, a p90 that one turn decided.
FULL_WINDOW_S: Final = {"mooncake": 300.0, "claude-code": 1800.0, "agent": 180.0}
Job = tuple[argparse.Namespace, str, str, float, int]  # args, workload, policy, rate, seed
QUICK: Final = {
    "prefill": 2,
    "decode": 2,
    "workloads": "agent",
    "policies": "kvshuttle,llm-d,dynamo",
    "rates": "0.25,1.0",
    "seeds": "1",
    "window": 120.0,
}


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", type=Path, default=PROFILE)
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--rates", help="session rates for every workload (default: FULL_RATES)")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--window", type=float, help="seconds of session arrivals (default: FULL_WINDOW_S)")
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    ap.add_argument("--stop-after", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    return args


@functools.cache
def _profile(path: Path) -> EngineProfile:
    """The profile, read once per process (every run of the sweep uses it)."""
    return load_engine_profiles(path)[0]


def _spec(args: argparse.Namespace, workload: str, policy: str, rate: float, seed: int) -> RunSpec:
    profile = _profile(args.profile)
    window = args.window or FULL_WINDOW_S[workload]
    return RunSpec(
        policy=policy,
        workload=workload,
        rate=rate,
        seed=seed,
        profile=profile,
        prefill=args.prefill,
        decode=args.decode,
        arrivals=arrivals(workload, rate, window, seed, args.max_model_len),
        max_model_len=args.max_model_len,
        window_s=window,
        warmup_s=window / 4,
    )


def _one(job: Job) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    args, workload, policy, rate, seed = job
    spec = _spec(args, workload, policy, rate, seed)
    result = run(spec)
    result.spec["gpus_per_engine"] = spec.profile.hardware.gpus_per_engine
    row = report.figures(result)
    turns = [
        {"policy": policy, "workload": workload, "rate": rate, "seed": seed, **asdict(r)}
        for r in result.result.records
    ]
    return row, turns


def _rates(args: argparse.Namespace, workload: str) -> list[float]:
    return [float(r) for r in args.rates.split(",")] if args.rates else list(FULL_RATES[workload])


def _sweeps(args: argparse.Namespace) -> list[list[Job]]:
    """One sweep (rates in order) per workload, policy and seed."""
    out = []
    for workload in args.workloads.split(","):
        rates = _rates(args, workload)
        for policy in args.policies.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                out.append([(args, workload, policy, rate, seed) for rate in rates])
    return out


# CPU a sweep costs, relative (the last full run's CPU-seconds per workload and policy, rounded):
# only the order sweeps are handed to workers in depends on it.
_WORKLOAD_COST: Final = {"agent": 4.0, "mooncake": 1.0, "claude-code": 0.3}
_POLICY_COST: Final = {"kvshuttle": 3.0, "llm-d": 3.0, "prefix-aware": 2.0, "dynamo": 1.5, "proxy": 1.0}


def _cost(jobs: list[Job]) -> float:
    _, workload, policy, _, _ = jobs[0]
    family = "kvshuttle" if policy.startswith("kvshuttle") else policy
    return _WORKLOAD_COST.get(workload, 1.0) * _POLICY_COST.get(family, 0.5)


def _sweep(jobs: list[Job]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    stop_after = jobs[0][0].stop_after
    done, missed = [], 0
    for job in jobs:
        row, turns = _one(job)
        done.append((row, turns))
        print(report.table([row]).splitlines()[1], flush=True)
        missed = 0 if row["slo_ok"] else missed + 1
        if missed >= stop_after:
            break
    return done


def finite(value: Any) -> Any:
    """The figures as strict JSON: an infinite percentile (misses beyond it) becomes null."""
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def _at_best_peer(args: argparse.Namespace, rows: list[dict[str, Any]], gpus: int) -> list[Job]:
    """The runs the summary's `ttft_p99_later_at_best_peer_capacity_ms` needs and the sweeps
    did not make: each policy and seed at the rate of the best peer's capacity."""
    wanted = report.best_peer_rates(rows, gpus)
    have = {(r["workload"], r["policy"], r["seed"], r["rate"]) for r in rows}
    # A sweep whose later turns' p99 was already a miss (more than 1 % of them cut or failed) at a
    # lower rate: more load does not serve more of them, and its p99 there is a miss unrun.
    missed = {
        (r["workload"], r["policy"], r["seed"], r["rate"])
        for r in rows
        if r["collapsed_at_s"] is not None or math.isinf(r["ttft_later_ms"]["p99"] or 0.0)
    }
    jobs = []
    for workload, rate in wanted.items():
        for policy in args.policies.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                if (workload, policy, seed, rate) in have:
                    continue
                lower = (r for r in _rates(args, workload) if r < rate)
                if any((workload, policy, seed, r) in missed for r in lower):
                    continue
                jobs.append((args, workload, policy, rate, seed))
    return jobs


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    started = time.monotonic()
    sweeps = _sweeps(args)
    for workload in args.workloads.split(","):  # parse each trace once, before the workers fork
        arrivals(workload, 0.01, 1.0, 0, args.max_model_len)
    print(report.table([]).splitlines()[0], flush=True)
    if args.jobs > 1:
        # The costliest sweeps first, so that the last ones running are short and no worker idles
        # while one long sweep finishes.
        order = sorted(range(len(sweeps)), key=lambda i: _cost(sweeps[i]), reverse=True)
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            done = pool.map(_sweep, [sweeps[i] for i in order], chunksize=1)
        results = [r for _, r in sorted(zip(order, done, strict=True), key=lambda x: x[0])]
    else:
        results = [_sweep(s) for s in sweeps]
    rows = [row for sweep in results for row, _ in sweep]
    turns = [t for sweep in results for _, ts in sweep for t in ts]
    profile = _profile(args.profile)
    gpus = (args.prefill + args.decode) * profile.hardware.gpus_per_engine
    # Every policy at the best peer's capacity, where its sweep stopped short of it.
    missing = _at_best_peer(args, rows, gpus)
    if missing:
        if args.jobs > 1:
            with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
                extra = pool.map(_one, missing, chunksize=1)
        else:
            extra = [_one(job) for job in missing]
        for row, ts in extra:
            print(report.table([row]).splitlines()[1], flush=True)
            rows.append(row)
            turns.extend(ts)
    summary = report.summary(rows, gpus)
    utc = datetime.now(UTC)
    wall = round(time.monotonic() - started, 1)
    args_out = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = save(
        "fleet",
        finite({"wall_s": wall, "summary": summary, "runs": rows}),
        args=args_out,
        directory=args.out,
        utc=utc,
    )
    with gzip.open(path.with_name(path.stem + "-turns.jsonl.gz"), "wt") as f:
        for t in turns:
            f.write(json.dumps(t, separators=(",", ":")) + "\n")
    at = report.best_peer_rates(rows, gpus)
    for png in plots(rows, turns, at, summary, path.with_suffix("")):
        print(png)
    print()
    print(report.table(rows))
    print(
        json.dumps(
            {k: summary[k] for k in ("capacity_per_gpu", "ttft_p99_later_at_best_peer_capacity_ms", "wrong")},
            indent=1,
        )
    )
    print(f"{path} ({wall} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
