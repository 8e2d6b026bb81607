"""The fleet simulator's honesty check against the socket bench (bench/cluster): the same
sessions, turns, tokens and arrival times on both, 2P+2D of the same profile, the socket bench at
time scale 1; per policy, the decisions and TTFT p50/p90 side by side, their differences, and
whether they are within the issue's targets (decisions +-5 % of the turns, TTFT 20 %).

    python -m bench.fleet.socket_check                       # agent loop and Mooncake, seeds 1-2, 5 policies
    python -m bench.fleet.socket_check --workloads agent --seeds 1 --policies kvshuttle,recompute

What the simulator is fed is the socket bench's own plan (bench/cluster/plan.py's sessions,
bench/cluster/run.py's Poisson starts), replayed by the simulator's replay (bench/fleet/replay.py)
through `SocketClient`, which asks what the socket bench's client asks: answers capped at
`--max-output`, the trace's think time as the next-turn hint only where the socket bench sends
one (a think time, not a recorded offset), turns past `--max-turns` dropped. No history is sent
edited (`--edit-fraction 0` on the socket bench: the simulator's replay has no edits). The fleet
is the socket bench's engines: the profile's block size, decode retaining whatever it decoded
from a prefill (the stand-ins' bidirectional NixlConnector), for every policy; kvshuttle runs
with the router policy the socket bench's router is started with, read from the environment the
socket bench's stack gives it, and each agent's pool of the socket bench's size.

Figures per workload, seed and policy (`compare`): each decision's share of the served turns
(kvshuttle: extend, reuse, recompute; proxy: read, recompute; affinity-local: local, p2d),
the later turns that found their conversation's previous prompt (`history_hit_share`) and the
reuse ratio, TTFT p50/p90 over all served turns and over later turns (the socket bench's
`quantile` for both), and per turn served by both the socket bench's TTFT minus the simulator's
(`paired`; every turn side by side in `turns`). Before the runs, `idle_overhead`: the same
difference for one P->D turn at a time on an idle 1P+1D, by prompt size, which is the socket
bench's own time in a turn (HTTP, JSON, the stand-ins' Python) without load. Writes
bench/results/fleet_socket_check-<utc>.json (the load average before and after in it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import math
import os
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import aiohttp
import numpy as np
from deploy.profiles.schema import EngineProfile
from pydantic import TypeAdapter
from tokenizers import Tokenizer

from bench.cluster.engines import EmulatedCluster
from bench.cluster.kvshuttle_policy import POOL_BYTES
from bench.cluster.kvshuttle_policy import Kvshuttle as SocketKvshuttle
from bench.cluster.plan import Workload, sessions_per_rate
from bench.cluster.policies import Recompute as SocketRecompute
from bench.cluster.policies import Turn as SocketTurn
from bench.cluster.replay import ReplayConfig, think_s
from bench.cluster.replay import TurnRecord as SocketRecord
from bench.cluster.report import quantile
from bench.cluster.run import ClusterRun, run_policy
from bench.cluster.run import arrivals as socket_arrivals
from bench.cluster.workload.arrivals import Arrival as SocketArrival
from bench.cluster.workload.model import Session, StopReason
from bench.cluster.workload.tokens import TokenMap
from bench.emulator.fleet import vtime
from bench.emulator.fleet.engine import Prompt
from bench.emulator.fleet.fleet import Fleet, FleetConfig
from bench.emulator.http.config import engine_profile
from bench.emulator.http.tokenizer import SPECIAL, make_tokenizer
from bench.fleet.baselines import Recompute as SimRecompute
from bench.fleet.kvshuttle_sim import AgentModel, Kvshuttle, quiet_logs
from bench.fleet.replay import Arrival, Policy, Served, SimTurn, replay
from bench.fleet.replay import TurnRecord as SimRecord
from bench.fleet.run import POLICIES as FLEET_POLICIES
from bench.report import ROOT, save
from kvshuttle.core.hashing import chain_array
from kvshuttle.router.policy import RouterPolicy

__all__ = [
    "POLICIES",
    "SocketClient",
    "Turn",
    "compare",
    "figures",
    "fleet_arrivals",
    "idle_overhead",
    "line_fit",
    "overhead_fit",
    "paired",
    "router_policy_of",
    "simulate",
    "socket_plan",
    "socket_router_env",
    "socket_token_map",
    "turn_pairs",
]

# The policies both benches have (the socket bench's name: kvshuttle with parking, prefetch and
# extend on the holder, as bench/cluster runs it).
POLICIES: Final = ("recompute", "proxy", "prefix-aware", "affinity-local", "kvshuttle")
# (sessions per second, seconds of session starts): well below 2P+2D's saturation (measured P busy:
# the agent loop 10-15 %, Mooncake 25-45 %, its long prompts) and under ~5 turns per real second,
# which two cores drive at time scale 1; about 40 s of socket bench per policy.
LOADS: Final = {"agent": (1.0, 20.0), "mooncake": (1.0, 30.0)}
DECISION_TOLERANCE: Final = 0.05  # of the served turns
TTFT_TOLERANCE: Final = 0.20  # relative
_ROUTER_POLICY_ENV: Final = "KVSHUTTLE_ROUTER_POLICY__"
# The socket bench's drain: turns still in flight this long after the horizon are cut.
SOCKET_DRAIN_S: Final = ReplayConfig.drain_s  # its default
# The idle probe (`idle_overhead`): prompt sizes, turns of each, their answers, the pause between.
PROBE_TOKENS: Final = (1_000, 4_000, 16_000, 32_000)
PROBE_REPEATS: Final = 5
PROBE_OUTPUT: Final = 16
PROBE_GAP_S: Final = 0.2


# -- the plan --------------------------------------------------------------------------------


def socket_plan(
    workload: str, rate: float, window_s: float, seed: int, gap_divisor: float
) -> list[SocketArrival]:
    """The socket bench's one step at `rate`: its sessions (bench/cluster/plan.py) at the starts
    its run draws for them (bench/cluster/run.py: the first step's seed is the run's)."""
    [(_, sessions)] = sessions_per_rate(
        Workload(workload, (rate,)), window_s=window_s, seed=seed, gap_divisor=gap_divisor
    )
    return socket_arrivals(sessions, rate, seed)


def fleet_arrivals(plan: Sequence[SocketArrival], max_turns: int, at_s: float = 0.0) -> list[Arrival]:
    """The plan as the simulator's replay takes it: the same sessions at the same starts (after
    `at_s`), each cut to the turns the socket bench sends."""
    return [
        Arrival(at_s + a.time_s, dataclasses.replace(a.session, requests=a.session.requests[:max_turns]))
        for a in plan
    ]


class SocketClient:
    """A simulated policy asked what the socket bench's client (bench/cluster/replay.py) asks:
    answers capped at `max_output` tokens (the history goes on with the capped answer and the
    trace's tokens after the recorded one, as there), and the next-turn hint it sends. One
    difference stays: the simulator's replay ends a session where the prompt and the trace's
    uncapped answer would pass max_model_len, the socket bench's where the prompt and the capped
    one would; the check's plans have no such turn (tests/bench/test_fleet_socket_check.py)."""

    def __init__(self, policy: Policy, sessions: Mapping[str, Session], *, max_output: int, max_turns: int):
        self.policy, self.sessions = policy, sessions
        self.max_output, self.max_turns = max_output, max_turns
        self.name = policy.name

    async def serve(self, turn: SimTurn) -> Served:
        requests = self.sessions[turn.conversation].requests
        asked = dataclasses.replace(
            turn,
            output=min(turn.output, self.max_output),
            next_think_s=think_s(requests, turn.index, self.max_turns),
        )
        return await self.policy.serve(asked)


def router_policy_of(env: Mapping[str, str]) -> RouterPolicy:
    """The RouterPolicy a router started with `env` runs (KVSHUTTLE_ROUTER_POLICY__* read as
    its settings read them: nested by "__", the rest at their defaults)."""
    nested: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith(_ROUTER_POLICY_ENV):
            continue
        *path, leaf = key.removeprefix(_ROUTER_POLICY_ENV).lower().split("__")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return TypeAdapter(RouterPolicy).validate_python(nested)


def socket_router_env(run: ClusterRun, variant: str = "kvshuttle") -> dict[str, str]:
    """The environment the socket bench's stack starts its router with, for kvshuttle `variant`
    on `run`'s cluster (the stack built, nothing started)."""

    async def build() -> dict[str, str]:
        cluster = EmulatedCluster(
            run.model_dir, run.profile, prefill=run.prefill, decode=run.decode, time_scale=run.time_scale,
            max_model_len=run.max_model_len,
        )  # fmt: skip
        shuttle = SocketKvshuttle(cluster, name=variant)
        try:
            return dict(shuttle.stack.router.env)
        finally:
            await cluster.standin.stop()
            shutil.rmtree(shuttle.work_dir, ignore_errors=True)

    return asyncio.run(build())


# -- the two runs ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn as either bench recorded it. `decision`: recompute, read, local, p2d, or
    kvshuttle's router's; `reason`: kvshuttle's decision:reason, else the decision; `ttft_s`
    None when it was not served (an error, or cut at the step's end)."""

    session: str
    index: int
    sent_s: float
    prompt_tokens: int
    decision: str
    reason: str
    reused_tokens: int
    ttft_s: float | None


def from_socket(record: SocketRecord) -> Turn:
    served = record.error is None and record.ttft_s is not None
    return Turn(
        record.session,
        record.turn,
        record.sent_s,
        record.prompt_tokens,
        record.reason.split(":")[0],
        record.reason,
        record.reused_tokens,
        record.ttft_s if served else None,
    )


def from_sim(record: SimRecord, t0: float, *, detailed: bool) -> Turn:
    served = not record.error and record.ttft_s is not None
    reason = f"{record.decision}:{record.reason}" if detailed else record.decision
    return Turn(
        record.session,
        record.turn,
        record.sent_s - t0,
        record.prompt_tokens,
        record.decision,
        reason,
        record.reused_tokens,
        record.ttft_s if served else None,
    )


def _fleet_policy(name: str, fleet: Fleet, seed: int, router: RouterPolicy) -> Policy:
    if name == "kvshuttle":
        agent = AgentModel(pool_gib=POOL_BYTES / 2**30)
        return Kvshuttle(fleet, name=name, policy=router, agent=agent, seed=seed)
    return FLEET_POLICIES[name].build(fleet, seed)


def simulate(
    name: str,
    plan: Sequence[SocketArrival],
    run: ClusterRun,
    router: RouterPolicy,
    token_map: TokenMap,
) -> list[Turn]:
    """`name` on the simulated fleet of `run`'s engines over `plan`, in virtual time; its turns
    (times from the replay's start)."""
    profile = run.profile
    sessions = {a.session.session_id: a.session for a in plan}

    async def main() -> list[Turn]:
        fleet = Fleet(
            FleetConfig(
                profile,
                prefill=run.prefill,
                decode=run.decode,
                block_size=profile.engine.block_size,
                retain_decode=True,
            )
        )
        fleet.start()
        policy = _fleet_policy(name, fleet, run.seed, router)
        starter = getattr(policy, "start", None)
        if starter is not None:
            await starter()
        t0 = asyncio.get_running_loop().time()
        horizon = math.inf if run.horizon_s is None else run.horizon_s
        result = await replay(
            SocketClient(policy, sessions, max_output=run.max_output, max_turns=run.max_turns),
            fleet_arrivals(plan, run.max_turns, t0),
            token_map,
            block_size=profile.engine.block_size,
            max_model_len=run.max_model_len,
            send_until_s=t0 + horizon,
            end_s=t0 + horizon + SOCKET_DRAIN_S,
        )
        closer = getattr(policy, "close", None)
        if closer is not None:
            await closer()
        await fleet.stop()
        return [from_sim(r, t0, detailed=name == "kvshuttle") for r in result.records]

    with quiet_logs():
        return vtime.run(main())


def _probe_prompts(token_map: TokenMap, block_size: int) -> dict[int, list[list[int]]]:
    """PROBE_REPEATS prompts of each PROBE_TOKENS size, no two sharing a block (fresh trace ids)."""
    ids = itertools.count(1 << 40)
    return {
        n: [
            token_map.prompt([next(ids) for _ in range(-(-n // block_size))], n, block_size).tolist()
            for _ in range(PROBE_REPEATS)
        ]
        for n in PROBE_TOKENS
    }


async def _socket_probe(run: ClusterRun, prompts: Mapping[int, list[list[int]]]) -> dict[int, list[float]]:
    cluster = EmulatedCluster(
        run.model_dir, run.profile, prefill=1, decode=1, time_scale=run.time_scale,
        max_model_len=run.max_model_len,
    )  # fmt: skip
    ttft: dict[int, list[float]] = {}
    async with cluster, aiohttp.ClientSession() as http:
        policy = SocketRecompute(cluster)
        for n, of_size in prompts.items():
            for i, prompt in enumerate(of_size):
                await asyncio.sleep(PROBE_GAP_S * run.time_scale)
                sent = time.monotonic()
                served = await policy.serve(http, SocketTurn(f"probe-{n}-{i}", prompt, PROBE_OUTPUT))
                ttft.setdefault(n, []).append((served.answer.token_times[0] - sent) / run.time_scale)
    return ttft


async def _sim_probe(run: ClusterRun, prompts: Mapping[int, list[list[int]]]) -> dict[int, list[float]]:
    bs = run.profile.engine.block_size
    fleet = Fleet(FleetConfig(run.profile, prefill=1, decode=1, block_size=bs, retain_decode=True))
    fleet.start()
    policy, loop = SimRecompute(fleet), asyncio.get_running_loop()
    ttft: dict[int, list[float]] = {}
    for n, of_size in prompts.items():
        for i, prompt in enumerate(of_size):
            await asyncio.sleep(PROBE_GAP_S)
            tokens = np.asarray(prompt, np.uint32)
            keys = chain_array(tokens, bs)
            turn = SimTurn(
                f"probe-{n}-{i}",
                0,
                Prompt(tokens, keys, i, keys.tolist()),
                PROBE_OUTPUT,
                None,
                StopReason.STOP,
            )
            sent = loop.time()
            served = await policy.serve(turn)
            ttft.setdefault(n, []).append(served.answer.token_times[0] - sent)
    await fleet.stop()
    return ttft


def idle_overhead(run: ClusterRun, token_map: TokenMap) -> dict[str, Any]:
    """The socket bench's own time in a turn, without load: one P->D turn at a time (recompute,
    fresh prompts of PROBE_TOKENS sizes) on an idle 1P+1D of `run`'s profile, its TTFT against
    the simulator's for the same prompt (which is the profile's alone); per size the medians, and
    the difference fitted as fixed ms plus ms per 1,000 prompt tokens."""
    prompts = _probe_prompts(token_map, run.profile.engine.block_size)
    socket = asyncio.run(_socket_probe(run, prompts))
    with quiet_logs():
        sim = vtime.run(_sim_probe(run, prompts))
    sizes = {
        n: {"socket_ms": _ms(statistics.median(socket[n])), "sim_ms": _ms(statistics.median(sim[n]))}
        for n in PROBE_TOKENS
    }
    gaps = [(n / 1e3, (a - b) * 1e3) for n in PROBE_TOKENS for a, b in zip(socket[n], sim[n], strict=True)]
    return {"prompt_tokens": sizes, "fit": overhead_fit(gaps)}


def socket_token_map(model_dir: Path, seed: int) -> TokenMap:
    """The socket bench's (bench/cluster/run.py): the stand-ins' vocabulary, their special ids
    left out."""
    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    return TokenMap(vocab, seed=seed, reserved=len(SPECIAL))


# -- the comparison ----------------------------------------------------------------------------


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def figures(turns: Sequence[Turn], block_size: int) -> dict[str, Any]:
    """One bench's figures over its turns. A later turn hit its history when the tokens it did
    not compute cover the previous prompt's full blocks."""
    served = [t for t in turns if t.ttft_s is not None]
    later = [t for t in served if t.index > 0]
    prompts = {(t.session, t.index): t.prompt_tokens for t in turns}
    hits = sum(
        t.reused_tokens >= prompts.get((t.session, t.index - 1), math.inf) // block_size * block_size
        for t in later
    )
    prompt = sum(t.prompt_tokens for t in served)

    def ttft(of: Sequence[Turn], q: float) -> float | None:
        return _ms(quantile([t.ttft_s for t in of if t.ttft_s is not None], q))

    return {
        "turns": len(turns),
        "served": len(served),
        "later": len(later),
        "decisions": dict(sorted(Counter(t.decision for t in served).items())),
        "reasons": dict(sorted(Counter(t.reason for t in served).items())),
        "history_hit_share": round(hits / len(later), 3) if later else None,
        "reuse_ratio": round(sum(t.reused_tokens for t in served) / prompt, 3) if prompt else None,
        "ttft_ms": {
            "p50": ttft(served, 0.5),
            "p90": ttft(served, 0.9),
            "later_p50": ttft(later, 0.5),
            "later_p90": ttft(later, 0.9),
        },
    }


def _share_diff(socket: float, sim: float, tolerance: float) -> dict[str, Any]:
    return {
        "socket": socket,
        "sim": sim,
        "diff": round(sim - socket, 3),
        "within": abs(sim - socket) <= tolerance,
    }


def compare(
    socket: Mapping[str, Any],
    sim: Mapping[str, Any],
    *,
    decision_tolerance: float = DECISION_TOLERANCE,
    ttft_tolerance: float = TTFT_TOLERANCE,
) -> dict[str, Any]:
    """The simulator's figures against the socket bench's (both from `figures`): each decision's
    share of its bench's served turns and the history-hit share, their difference (sim - socket)
    within `decision_tolerance`; each TTFT percentile's relative difference (sim / socket - 1)
    within `ttft_tolerance`."""
    decisions = {}
    for label in sorted(set(socket["decisions"]) | set(sim["decisions"])):
        a = socket["decisions"].get(label, 0) / max(1, socket["served"])
        b = sim["decisions"].get(label, 0) / max(1, sim["served"])
        decisions[label] = _share_diff(round(a, 3), round(b, 3), decision_tolerance)
    hit = None
    if socket["history_hit_share"] is not None and sim["history_hit_share"] is not None:
        hit = _share_diff(socket["history_hit_share"], sim["history_hit_share"], decision_tolerance)
    ttft = {}
    for q, a_ms in socket["ttft_ms"].items():
        b_ms = sim["ttft_ms"][q]
        rel = None if a_ms is None or b_ms is None or a_ms == 0 else round(b_ms / a_ms - 1, 3)
        ttft[q] = {
            "socket": a_ms,
            "sim": b_ms,
            "rel": rel,
            "within": rel is not None and abs(rel) <= ttft_tolerance,
        }
    return {
        "decisions": decisions,
        "history_hit": hit,
        "ttft_ms": ttft,
        "decisions_within": all(d["within"] for d in decisions.values()) and (hit is None or hit["within"]),
        "ttft_within": all(t["within"] for t in ttft.values()),
    }


def _gap_s(pair: tuple[Turn, Turn]) -> float:
    socket, sim = pair
    assert socket.ttft_s is not None and sim.ttft_s is not None
    return socket.ttft_s - sim.ttft_s


def line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Theil-Sen y = a + b x over (x, y) points: b the median of the pairwise slopes, a the median
    of y - b x (a turn slowed by the machine's other load moves neither); None without two
    distinct x."""
    slopes = [
        (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1
    ]
    if not slopes:
        return None
    b = statistics.median(slopes)
    return statistics.median(y - b * x for x, y in points), b


def overhead_fit(points: Sequence[tuple[float, float]]) -> dict[str, float] | None:
    """(thousands of prompt tokens, ms) points as fixed ms plus ms per 1,000 prompt tokens."""
    fit = line_fit(points)
    return (
        None if fit is None else {"fixed_ms": round(fit[0], 1), "per_1k_prompt_tokens_ms": round(fit[1], 2)}
    )


def paired(socket: Sequence[Turn], sim: Sequence[Turn], block_size: int) -> dict[str, Any]:
    """Per turn served by both, the socket bench's TTFT minus the simulator's (ms): over every such
    turn, and over those both did the same work for (the same decision, the same tokens reused to
    within a block), whose difference is the time the simulator does not model; that difference
    by decision, and fitted as fixed ms plus ms per 1,000 prompt tokens."""
    by_key = {(t.session, t.index): t for t in sim if t.ttft_s is not None}
    both = [
        (s, by_key[(s.session, s.index)])
        for s in socket
        if s.ttft_s is not None and (s.session, s.index) in by_key
    ]
    same = [
        (a, b)
        for a, b in both
        if a.decision == b.decision and abs(a.reused_tokens - b.reused_tokens) < block_size
    ]

    def spread(pairs: Sequence[tuple[Turn, Turn]]) -> dict[str, float | None]:
        gaps = [_gap_s(p) for p in pairs]
        return {f"p{q}": _ms(quantile(gaps, q / 100)) for q in (10, 50, 90)}

    return {
        "matched": len(both),
        "same_prompt_tokens": sum(a.prompt_tokens == b.prompt_tokens for a, b in both),
        "same_decision": sum(a.decision == b.decision for a, b in both),
        "same_work": len(same),
        "socket_minus_sim_ms": spread(both),
        "same_work_ms": spread(same),
        "same_work_fit": overhead_fit([(a.prompt_tokens / 1e3, _gap_s((a, b)) * 1e3) for a, b in same]),
        "same_work_by_decision": {
            d: {"turns": len(p), **spread(p)}
            for d in sorted({a.decision for a, _ in same})
            if (p := [(a, b) for a, b in same if a.decision == d])
        },
    }


def turn_pairs(socket: Sequence[Turn], sim: Sequence[Turn]) -> list[list[Any]]:
    """Every turn either bench sent, side by side: [session, turn, prompt tokens, then for the
    socket bench and the simulator each: sent s, reason, tokens reused, TTFT ms] (None where that
    bench did not send it or did not serve it)."""
    by_key: dict[tuple[str, int], list[Turn | None]] = {}
    for i, turns in enumerate((socket, sim)):
        for turn in turns:
            by_key.setdefault((turn.session, turn.index), [None, None])[i] = turn
    out: list[list[Any]] = []
    for (session, index), pair in sorted(by_key.items()):
        prompt = next(t.prompt_tokens for t in pair if t is not None)
        row: list[Any] = [session, index, prompt]
        for t in pair:
            row += [None] * 4 if t is None else [round(t.sent_s, 3), t.reason, t.reused_tokens, _ms(t.ttft_s)]
        out.append(row)
    return out


# -- the check ---------------------------------------------------------------------------------


def _socket_run(
    name: str,
    run: ClusterRun,
    plan: Sequence[SocketArrival],
    rate: float,
    workload: str,
    log: Callable[[str], None],
) -> tuple[dict[str, Any], list[Turn]]:
    sessions = [a.session for a in plan]
    rows, records = asyncio.run(run_policy(name, run, [(rate, sessions)], log, workload=workload))
    keep = ("errors", "cut", "wrong", "prefill_nodes_busy", "control_plane_cpu_ms_per_turn", "wall_s")
    return {k: rows[0]["summary"][k] for k in keep}, [from_socket(r) for r in records]


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per workload, seed and policy: turns, decisions and TTFTs socket / sim."""
    head = (f"{'workload':8} {'seed':>4} {'policy':14} {'turns':>7}  {'hist hit':>9} "
            f"{'TTFT p50':>13} {'p90':>13} {'later p50':>13} {'later p90':>13} {'d-ok':>4} {'t-ok':>4}  "
            "decisions socket / sim")  # fmt: skip
    lines = [head]
    for row in rows:
        c, s, m = row["comparison"], row["socket"], row["sim"]
        t = c["ttft_ms"]
        hit = c["history_hit"]
        cells = [f"{_f(t[q]['socket'])}/{_f(t[q]['sim'])}" for q in ("p50", "p90", "later_p50", "later_p90")]
        decisions = ", ".join(f"{k} {d['socket']:.2f}/{d['sim']:.2f}" for k, d in c["decisions"].items())
        lines.append(
            f"{row['workload']:8} {row['seed']:4d} {row['policy']:14} {s['served']:>3}/{m['served']:<3}  "
            f"{(_f(hit['socket'], 2) + '/' + _f(hit['sim'], 2)) if hit else '-':>9} "
            + " ".join(f"{cell:>13}" for cell in cells)
            + f" {_yes(c['decisions_within']):>4} {_yes(c['ttft_within']):>4}  {decisions}"
        )
    return "\n".join(lines)


def check_one(
    name: str,
    workload: str,
    rate: float,
    plan: Sequence[SocketArrival],
    run: ClusterRun,
    router: RouterPolicy,
    token_map: TokenMap,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """`name` on the socket bench, then on the simulator, over `plan`: the row of figures."""
    summary, socket_turns = _socket_run(name, run, plan, rate, workload, log)
    cpu0 = time.process_time()
    sim_turns = simulate(name, plan, run, router, token_map)
    sim_cpu_s = time.process_time() - cpu0
    bs = run.profile.engine.block_size
    socket, sim = figures(socket_turns, bs), figures(sim_turns, bs)
    return {
        "workload": workload,
        "seed": run.seed,
        "policy": name,
        "rate": rate,
        "sessions": len(plan),
        "socket": {**socket, "run": summary},
        "sim": {**sim, "cpu_s": round(sim_cpu_s, 2)},
        "comparison": compare(socket, sim),
        "paired": paired(socket_turns, sim_turns, bs),
        "turns": turn_pairs(socket_turns, sim_turns),
    }


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.fleet.socket_check", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--workloads", default=",".join(LOADS), help=f"of {', '.join(LOADS)}")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"of {', '.join(POLICIES)}")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--profile", type=Path, default=ROOT / "deploy" / "profiles" / "qwen3-32b-h200-tp2.toml")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=1.0, help="the socket bench's")
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--horizon", type=float, default=40.0, help="no turn is sent later (s into the step)")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--gap-divisor", type=float, default=60.0, help="mooncake: turn gaps divided by this")
    ap.add_argument("--model-dir", type=Path, default=ROOT / ".run" / "models" / "standin")
    args = ap.parse_args(argv)
    for option, chosen, known in (
        ("workloads", args.workloads, LOADS),
        ("policies", args.policies, POLICIES),
    ):
        unknown = set(chosen.split(",")) - set(known)
        if unknown:
            ap.error(f"unknown {option} {sorted(unknown)}; choose from {', '.join(known)}")
    return args


def _cluster_run(args: argparse.Namespace, profile: EngineProfile, seed: int) -> ClusterRun:
    return ClusterRun(
        model_dir=args.model_dir, profile=profile, prefill=args.prefill, decode=args.decode,
        time_scale=args.time_scale, max_model_len=args.max_model_len, max_output=args.max_output,
        max_turns=args.max_turns, edit_fraction=0.0, seed=seed, horizon_s=args.horizon,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if not (args.model_dir / "tokenizer.json").exists():
        make_tokenizer(args.model_dir)
    profile = engine_profile(args.profile)
    seeds = [int(s) for s in args.seeds.split(",")]
    began, started = time.monotonic(), datetime.now(UTC)

    def log(line: str) -> None:
        print(f"[{time.monotonic() - began:5.0f} s] {line}", flush=True)

    out: dict[str, Any] = {"load_average_before": os.getloadavg()}
    out["idle_overhead"] = idle = idle_overhead(
        _cluster_run(args, profile, seeds[0]), socket_token_map(args.model_dir, seeds[0])
    )
    log(f"idle P->D turn, socket bench minus simulator: {idle['fit']} ({idle['prompt_tokens']})")
    rows: list[dict[str, Any]] = []
    for workload in args.workloads.split(","):
        rate, window = LOADS[workload]
        for seed in seeds:
            run = _cluster_run(args, profile, seed)
            plan = socket_plan(workload, rate, window, seed, args.gap_divisor)
            router = router_policy_of(socket_router_env(run))
            token_map = socket_token_map(args.model_dir, seed)
            for name in args.policies.split(","):
                rows.append(check_one(name, workload, rate, plan, run, router, token_map, log))
                log(table(rows[-1:]).splitlines()[1])
                out |= {"total_wall_s": round(time.monotonic() - began, 1), "rows": rows}
                save("fleet_socket_check", out, args=args, utc=started)  # a stopped run keeps it
    out["load_average_after"] = os.getloadavg()
    path = save("fleet_socket_check", out, args=args, utc=started)
    print(table(rows))
    print(f"total {time.monotonic() - began:.0f} s; load average {out['load_average_after']}; wrote {path}")


if __name__ == "__main__":
    main()
