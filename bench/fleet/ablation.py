"""What each of the router's changes bought on the fleet, measured alone: kvshuttle's variants,
each one setting away from the next, swept as the full run sweeps (every workload, its rates,
stopping at the first miss) on the same seeds, and their capacity per GPU.

    python -m bench.fleet.ablation                # seeds 1, all three workloads
    python -m bench.fleet.ablation --seeds 1,2,3 --workloads agent

The variants (`VARIANTS`), cumulative, in the order the changes were made:

    placement      the placement ledger and near-tie draws alone: superseded retentions kept
                   (release_superseded off), no parking, no short lane
    + release      a recomputing turn releases the retention it supersedes
    + parking      idle retentions parked into the agents' pools after 2 s, 64 moves in flight
    + short lane   long prefills kept off the 3/8 of the prefill nodes short turns use
    + next-turn    retention by what comes next: the learnt gaps after each kind of answer end
                   set when a retention parks: kvshuttle as shipped
    + extend       extend on the holder and prefetch on as well (the former kvshuttle-agents)

The router's other changes (decode placement by KV pressure and the holder first, a finished
turn's prefill taken off the ledger, extend priced with prefill's queue) are code, not settings:
every row has them.

The row before all of them is the last full run's `kvshuttle` (bench/results, the shipped
defaults then); the rows' runs are the same simulator's, so only the router's settings differ.
Saved as bench/results/fleet-ablation-<UTC>.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Final

from bench.fleet import report
from bench.fleet.__main__ import PROFILE, _args, _profile, _sweep, _sweeps, finite
from bench.fleet.kvshuttle_sim import AgentModel, Kvshuttle
from bench.fleet.run import HOST_GIB_PER_ENGINE, POLICIES, PolicySpec
from bench.fleet.workloads import WORKLOADS, arrivals
from bench.report import ROOT, save
from kvshuttle.router.policy import ExtendPolicy, NextTurnPolicy, RouterPolicy

SHIPPED: Final = RouterPolicy()
_NO_NEXT: Final = replace(SHIPPED, next_turn=NextTurnPolicy(enabled=False))
_NO_LANE: Final = replace(_NO_NEXT, weights=replace(SHIPPED.weights, short_lane_fraction=0.0))
VARIANTS: Final = {
    "placement": (
        replace(_NO_LANE, release_superseded=False, parking=replace(SHIPPED.parking, enabled=False)),
        0.0,
    ),
    "+release": (replace(_NO_LANE, parking=replace(SHIPPED.parking, enabled=False)), 0.0),
    "+parking": (_NO_LANE, HOST_GIB_PER_ENGINE),
    "+short-lane": (_NO_NEXT, HOST_GIB_PER_ENGINE),
    "+next-turn": (SHIPPED, HOST_GIB_PER_ENGINE),
    "+extend": (
        replace(
            SHIPPED,
            extend=ExtendPolicy(enabled=True),
            parking=replace(SHIPPED.parking, prefetch_enabled=True),
        ),
        HOST_GIB_PER_ENGINE,
    ),
}


def _register() -> None:
    for name, (policy, pool_gib) in VARIANTS.items():

        def build(
            fleet: Any, seed: int, name: str = name, policy: RouterPolicy = policy, pool: float = pool_gib
        ) -> Any:
            return Kvshuttle(fleet, name=name, policy=policy, agent=AgentModel(pool_gib=pool), seed=seed)

        POLICIES[name] = PolicySpec(name, build, retain_decode=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.fleet.ablation", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    _register()
    # The full run's arguments, with the variants as its policies.
    sweep_args = _args(
        [
            "--workloads",
            args.workloads,
            "--policies",
            args.variants,
            "--seeds",
            args.seeds,
            "--jobs",
            str(args.jobs),
        ]
    )
    started = time.monotonic()
    for workload in args.workloads.split(","):
        arrivals(workload, 0.01, 1.0, 0, sweep_args.max_model_len)
    sweeps = _sweeps(sweep_args)
    print(report.table([]).splitlines()[0], flush=True)
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        done = pool.map(_sweep, sweeps, chunksize=1)
    rows = [row for sweep in done for row, _ in sweep]
    gpus = (sweep_args.prefill + sweep_args.decode) * _profile(PROFILE).hardware.gpus_per_engine
    capacity = report.capacity(rows, gpus)
    wall = round(time.monotonic() - started, 1)
    path = save(
        "fleet-ablation",
        finite({"wall_s": wall, "capacity_per_gpu": capacity, "runs": rows}),
        args=vars(args),
        directory=ROOT / "bench/results",
    )
    print()
    print(report.table(rows))
    for workload, by in capacity.items():
        print(workload, {v: by[v]["median"] * gpus for v in VARIANTS if v in by}, "sessions/s")
    print(f"{path} ({wall} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
