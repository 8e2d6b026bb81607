"""Where each of the router's decisions wins: reuse on prefill (read the history's KV from its
decode holder, compute the new tokens), recompute on prefill, or extend on the holder (the
decode node that holds the history computes the new tokens itself), by history length, new
input and the holder's running decodes, under one model profile's cost model.

    python -m bench.decisions [--profile deploy/profiles/qwen3-32b-h200-tp2.toml]

The router's own pricing (kvshuttle.router.cost: CostModel, price_extend) with extend on at its
defaults. The prefill node holds none of the history in its prefix cache (a fleet: the
conversation's last prompt is on another prefill node, or evicted), and the prefill path's
decode is another node than the holder (it reads the whole prompt's KV from prefill). TTFT here
is the turn's own: extend's interference (its running decodes' delay) is its price, not its
TTFT. Prints a table and saves bench/results/decisions-<utc>.json.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.report import save
from kvshuttle.router.cost import CostModel, ModelProfile, load_profiles, price_extend
from kvshuttle.router.policy import ExtendPolicy

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = ROOT / "deploy" / "profiles" / "qwen3-32b-h200-tp2.toml"
HISTORIES = (2048, 8192, 32768, 100_000)
NEW_TOKENS = (100, 700, 2048, 8192)
RUNNING = (0, 32)


@dataclass(frozen=True, slots=True)
class Cell:
    history: int
    new_tokens: int
    running: int
    decision: str
    # This turn's expected time to first token on each path (ms); reuse None below its floor.
    recompute_ms: float
    reuse_ms: float | None
    extend_ms: float
    # What extending would cost the holder's running decodes, weighted (its price, not TTFT).
    extend_interference_ms: float
    # Why extend did not win where it did not ("" where it won).
    extend_out: str


def cell(
    cost: CostModel,
    policy: ExtendPolicy,
    history: int,
    new: int,
    running: int,
    *,
    decode_is_holder: bool = False,
) -> Cell:
    """The router's choice for a turn of `new` tokens on a `history`-token retention held by a
    decode node running `running` requests, block size 16; the prefill path's decode another
    node than the holder unless `decode_is_holder`."""
    n = history + new
    held = history // 16 * 16
    # The prefill path's decode reads the prompt's KV from prefill (the holder: past its blocks).
    handoff = cost.transfer_ms(n - (held if decode_is_holder else 0))
    recompute = cost.recompute(n, 0)
    reuse = cost.reuse(n, history, 0) if history >= cost.profile.min_reuse_tokens else None
    other = reuse if reuse is not None and reuse.total_ms < recompute.total_ms else recompute
    extend, wins = price_extend(
        cost, policy, prompt_tokens=n, held_tokens=held, running=running, waiting=0, other=other,
        decode_is_holder=decode_is_holder,
    )  # fmt: skip
    assert extend is not None  # enabled, something held, room: always priced here
    if wins:
        decision, out = "extend", ""
    else:
        decision = "reuse" if other is reuse else "recompute"
        out = "max_prefill_ms" if extend.prefill_ms > policy.max_prefill_ms else "cost"
    return Cell(
        history, new, running, decision,
        recompute_ms=recompute.total_ms + handoff,
        reuse_ms=reuse.total_ms + handoff if reuse is not None else None,
        extend_ms=extend.prefill_ms,
        extend_interference_ms=extend.interference_ms,
        extend_out=out,
    )  # fmt: skip


def decision_map(profile: ModelProfile, policy: ExtendPolicy | None = None) -> list[Cell]:
    cost, policy = CostModel(profile), policy or ExtendPolicy(enabled=True)
    return [cell(cost, policy, h, c, r) for r in RUNNING for h in HISTORIES for c in NEW_TOKENS]


def table(cells: list[Cell]) -> str:
    lines = [f"{'running':>7} {'history':>8} {'new':>6}  {'decision':<9} {'recompute':>9} {'reuse':>8} "
             f"{'extend':>8} {'+interf':>8}  extend out by"]  # fmt: skip
    for c in cells:
        reuse = f"{c.reuse_ms:8.0f}" if c.reuse_ms is not None else f"{'-':>8}"
        turn = f"{c.running:>7} {c.history:>8} {c.new_tokens:>6}  {c.decision:<9}"
        times = f"{c.recompute_ms:9.0f} {reuse} {c.extend_ms:8.0f} {c.extend_interference_ms:8.0f}"
        lines.append(f"{turn} {times}  {c.extend_out}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    args = parser.parse_args()
    (profile, *_) = load_profiles(args.profile)
    cells = decision_map(profile)
    policy = ExtendPolicy(enabled=True)
    print(f"{profile.model} ({args.profile.name}); times in ms, TTFT of the turn itself; extend at "
          f"interference_weight {policy.interference_weight}, "
          f"max_prefill_ms {policy.max_prefill_ms:.0f}")  # fmt: skip
    print(table(cells))
    figures: dict[str, Any] = {
        "profile": str(args.profile),
        "model": profile.model,
        "extend_policy": asdict(policy),
        "cells": [asdict(c) for c in cells],
    }
    print(f"saved: {save('decisions', figures, args=args, utc=datetime.now(UTC))}")


if __name__ == "__main__":
    main()
