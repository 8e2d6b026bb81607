"""The fleet simulator against real vLLM: bench/conformance.py's scripted conversations through the
simulator (kvshuttle's real router and registry in virtual time, bench/fleet/kvshuttle_sim.py, on
one prefill and one decode engine timed by the profile the conformance run used, cpu-small), turn
by turn against the real-vLLM side of a conformance result: the same decision and reason, and
TTFT within 25 %.

    python -m bench.fleet.vllm_check [--conformance FILE] [--seeds 1,2,3] [--no-save]

`FILE`: a bench/results/conformance-*.json (default: the newest). TTFT is what the conformance
bench measures through the gateway, from the request to decode's first token: the control
plane's time (the measured PlanTurn delay, a lognormal drawn per seed: the simulation's only
randomness), prefill (its READ of decode's retained KV on a reuse turn), decode's READ of
prefill's KV and its first step. The setup is the conformance run's: prefix caching off on
prefill, on on decode, decode retaining for 480 s, the profile's block size, the script's
token counts times the run's scale, each turn sent when the previous one answered. Prints the
table (real, socket emulator and simulator TTFT, ratios, each side's parts where the result
file has the gateway's timings) and saves bench/results/fleet_vllm_check-<utc>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
from deploy.profiles.schema import EngineProfile, load_engine_profiles

from bench.cluster.workload.model import StopReason
from bench.conformance import CONVERSATIONS, MAX_TOKENS, TARGET
from bench.emulator.fleet import vtime
from bench.emulator.fleet.engine import Completion, Prompt
from bench.emulator.fleet.fleet import Fleet, FleetConfig
from bench.fleet.kvshuttle_sim import AgentModel, Kvshuttle, quiet_logs
from bench.fleet.replay import SimTurn
from bench.report import RESULTS, ROOT, save
from kvshuttle.core.hashing import chain_array

__all__ = ["Row", "SimResult", "compare", "latest_conformance", "simulate", "table"]

# deploy/local/stack.py's agents: a heartbeat every second, the engine's load every 0.5 s.
STACK_AGENT: Final = AgentModel(heartbeat_s=1.0, load_poll_s=0.5, lease_ttl_s=10.0)
# deploy/local/launch.py's VllmPair, as the conformance bench starts it.
DECODER_KV_BLOCKS_TTL_S: Final = 480.0
VOCAB: Final = (10, 2000)  # the script's fresh tokens are drawn from here, as bench.conformance's


@dataclass(frozen=True, slots=True)
class SimResult:
    """One simulated turn: kvshuttle's decision, prefill's cached tokens (what the gateway's
    x-kvshuttle-prefill-cached-tokens says), TTFT and its parts (ms): waiting for the plan,
    prefill (its READ included), decode's READ of prefill's KV, decode's first step."""

    conversation: str
    index: int
    prompt_tokens: int
    decision: str
    reason: str
    prefill_cached_tokens: int
    ttft_ms: float
    plan_ms: float
    prefill_ms: float
    decode_read_ms: float
    decode_first_ms: float


def _fresh_tokens(n: int, seed: int) -> list[int]:
    # Only the blocks they make matter here (any draw gives the same decisions and times).
    rng = random.Random(seed)
    return [rng.randrange(*VOCAB) for _ in range(n)]


def _prompt(tokens: list[int], block_size: int) -> Prompt:
    array = np.asarray(tokens, dtype=np.uint32)
    keys = chain_array(array, block_size)
    return Prompt(array, keys, zlib.crc32(array.tobytes()), keys.tolist())


def _parts(sent: float, prefill: Completion | None, decode: Completion) -> dict[str, float]:
    """A turn's TTFT split at the engines' own times (seconds): the request reaches prefill (or
    decode, without one) after the plan; decode starts once prefill's one token is out."""
    first = decode.token_times[0]
    read = decode.admitted_after_s
    if prefill is None:
        plan, prefill_s = decode.arrived - sent, 0.0
    else:
        plan, prefill_s = prefill.arrived - sent, prefill.token_times[0] - prefill.arrived
    return {
        "ttft_ms": (first - sent) * 1e3,
        "plan_ms": plan * 1e3,
        "prefill_ms": prefill_s * 1e3,
        "decode_read_ms": read * 1e3,
        "decode_first_ms": (first - decode.arrived - read) * 1e3,
    }


async def _script(profile: EngineProfile, scale: int, seed: int) -> list[SimResult]:
    bs = profile.engine.block_size
    fleet = Fleet(
        FleetConfig(
            profile,
            prefill=1,
            decode=1,
            block_size=bs,
            retain_decode=True,
            kv_blocks_ttl=DECODER_KV_BLOCKS_TTL_S,
            prefix_caching_roles=("decode",),  # --no-enable-prefix-caching on P, as the pair runs
        )
    )
    fleet.start()
    kvshuttle = Kvshuttle(fleet, agent=STACK_AGENT, seed=seed)
    await kvshuttle.start()
    loop = asyncio.get_running_loop()
    history: dict[str, list[int]] = {name: [] for name in CONVERSATIONS}
    out: list[SimResult] = []
    # bench.conformance.run_script's order: turn by turn, round robin, each sent when the
    # previous one answered.
    for index in range(max(len(steps) for steps in CONVERSATIONS.values())):
        for name, steps in CONVERSATIONS.items():
            if index >= len(steps):
                continue
            step, past = steps[index], history[name]
            if step.edit_at is not None:
                at = step.edit_at * scale
                past[at] = (past[at] + 1) % VOCAB[1] + VOCAB[0]
            tokens = past + _fresh_tokens(step.new * scale, step.seed)
            turn = SimTurn(name, index, _prompt(tokens, bs), MAX_TOKENS, None, StopReason.LENGTH)
            sent = loop.time()
            served = await kvshuttle.serve(turn)
            parts = _parts(sent, served.prefill_answer, served.answer)
            out.append(
                SimResult(
                    name,
                    index,
                    len(tokens),
                    served.decision,
                    served.reason,
                    served.reused_tokens,
                    **{k: round(v, 1) for k, v in parts.items()},
                )
            )
            history[name] = tokens + served.answer.output.tolist()
    await kvshuttle.close()
    await fleet.stop()
    return out


def simulate(profile: EngineProfile, scale: int, seed: int) -> list[SimResult]:
    """The conformance script on the simulated 1P+1D pair, in virtual time."""
    with quiet_logs():
        return vtime.run(_script(profile, scale, seed))


# -- the comparison ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One turn on every side; `sim_ttft_ms` and `ratios` (sim / real) by seed, in seed order."""

    conversation: str
    index: int
    prompt_tokens: int
    real_decision: str
    real_reason: str
    sim_decision: str
    sim_reason: str
    real_cached_tokens: int
    sim_cached_tokens: int
    real_ttft_ms: float
    emulated_ttft_ms: float
    sim_ttft_ms: tuple[float, ...]
    ratios: tuple[float, ...]
    real_parts: Mapping[str, float] | None
    sim_parts: Mapping[str, float]

    @property
    def same_decision(self) -> bool:
        return (self.real_decision, self.real_reason) == (self.sim_decision, self.sim_reason)

    @property
    def within_target(self) -> bool:
        """Every seed's ratio within TARGET of 1."""
        return all(abs(r - 1) <= TARGET for r in self.ratios)


def _real_parts(side: Mapping[str, Any]) -> dict[str, float] | None:
    """The gateway's timings of a real turn in the sim's parts (ms): its request to prefill's
    answer less PlanTurn, decode's first byte; the rest (the client's HTTP to the gateway and
    back, and the gateway's own time) is `other_ms`."""
    gateway = side.get("gateway")
    if not gateway:
        return None
    plan, prefill, first = gateway["plan_ms"], gateway.get("prefill_ms", 0.0), gateway["decode_ttfb_ms"]
    return {
        "plan_ms": plan,
        "prefill_ms": prefill,
        "decode_ttfb_ms": first,
        "other_ms": round(side["ttft_ms"] - plan - prefill - first, 1),
    }


def compare(conformance: Mapping[str, Any], sims: Sequence[Sequence[SimResult]]) -> list[Row]:
    """The conformance result's turns against the simulated runs (one per seed), turn by turn.
    Raises ValueError when they are not the same script."""
    rows = []
    turns = conformance["turns"]
    for sim in sims:
        if [(t["conversation"], t["turn"], t["prompt_tokens"]) for t in turns] != [
            (s.conversation, s.index, s.prompt_tokens) for s in sim
        ]:
            raise ValueError("the simulated script's turns are not the conformance result's")
    for i, turn in enumerate(turns):
        real, first = turn["real"], sims[0][i]
        ttfts = tuple(sim[i].ttft_ms for sim in sims)
        rows.append(
            Row(
                conversation=turn["conversation"],
                index=turn["turn"],
                prompt_tokens=turn["prompt_tokens"],
                real_decision=real["decision"],
                real_reason=real["reason"],
                sim_decision=first.decision,
                sim_reason=first.reason,
                real_cached_tokens=real["prefill_cached_tokens"],
                sim_cached_tokens=first.prefill_cached_tokens,
                real_ttft_ms=real["ttft_ms"],
                emulated_ttft_ms=turn["emulated"]["ttft_ms"],
                sim_ttft_ms=ttfts,
                ratios=tuple(round(t / real["ttft_ms"], 3) for t in ttfts),
                real_parts=_real_parts(real),
                sim_parts={k: v for k, v in asdict(first).items() if k.endswith("_ms") and k != "ttft_ms"},
            )
        )
        if any((s[i].decision, s[i].reason) != (first.decision, first.reason) for s in sims):
            raise ValueError(f"{turn['conversation']}/{turn['turn']}: the seeds decided differently")
    return rows


def _span(values: Sequence[float], fmt: str) -> str:
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def table(rows: Sequence[Row]) -> str:
    head = (
        f"{'turn':<11} {'prompt':>6} {'decision (reason)':<26} {'same':>4} {'cached r/s':>11} "
        f"{'real ms':>7} {'emul ms':>7} {'sim ms':>9} {'sim/real':>11} {'sim/emul':>8}"
    )
    lines = [head]
    for r in rows:
        decision = f"{r.real_decision} ({r.real_reason})"
        sim_emul = statistics.median(r.sim_ttft_ms) / r.emulated_ttft_ms
        lines.append(
            f"{r.conversation + '/' + str(r.index):<11} {r.prompt_tokens:>6} {decision:<26} "
            f"{'yes' if r.same_decision else 'NO':>4} {f'{r.real_cached_tokens}/{r.sim_cached_tokens}':>11} "
            f"{r.real_ttft_ms:>7.0f} {r.emulated_ttft_ms:>7.0f} {_span(r.sim_ttft_ms, '.0f'):>9} "
            f"{_span(r.ratios, '.2f'):>11} {sim_emul:>8.2f}"
        )
    lines.append("")
    lines.append(
        f"{'parts (ms)':<11} {'real: plan':>10} {'prefill':>8} {'D 1st':>6} {'other':>6}  "
        f"{'sim: plan':>9} {'prefill':>8} {'D read':>7} {'D 1st':>6}"
    )
    for r in rows:
        real = r.real_parts
        real_text = (
            f"{real['plan_ms']:>10.0f} {real['prefill_ms']:>8.0f} {real['decode_ttfb_ms']:>6.0f} "
            f"{real['other_ms']:>6.0f}"
            if real
            else f"{'(not in the result file)':>33}"
        )
        s = r.sim_parts
        lines.append(
            f"{r.conversation + '/' + str(r.index):<11} {real_text}  {s['plan_ms']:>9.0f} "
            f"{s['prefill_ms']:>8.0f} {s['decode_read_ms']:>7.0f} {s['decode_first_ms']:>6.0f}"
        )
    return "\n".join(lines)


def latest_conformance(directory: Path = RESULTS) -> Path:
    found = sorted(directory.glob("conformance-*.json"))
    if not found:
        raise FileNotFoundError(f"no conformance-*.json under {directory}")
    return found[-1]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.fleet.vllm_check", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("--conformance", type=Path, help="default: the newest bench/results/conformance-*.json")
    ap.add_argument("--seeds", default="1,2,3", help="the control plane's delay draws")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    source = (args.conformance or latest_conformance()).resolve()
    conformance = json.loads(source.read_text())
    scale = int(conformance["header"]["args"]["scale"])
    profile_path = ROOT / conformance["profile"]
    profile = load_engine_profiles(profile_path)[0]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = compare(conformance, [simulate(profile, scale, seed) for seed in seeds])
    where = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
    load = conformance.get("load_average_after")
    print(f"{where} (real vLLM, load average after {load}) against the simulator, seeds {args.seeds}")
    print(table(rows))
    same = sum(r.same_decision for r in rows)
    within = sum(r.within_target for r in rows)
    print(
        f"decision and reason identical: {same}/{len(rows)} turns; TTFT sim/real within "
        f"{TARGET:.0%}: {within}/{len(rows)} turns (every seed)"
    )
    if not args.no_save:
        figures = {
            "conformance": str(where),
            "conformance_utc": conformance["header"]["utc"],
            "conformance_load_average": {
                k: conformance[k] for k in ("load_average_before", "load_average_after") if k in conformance
            },
            "profile": str(profile_path.relative_to(ROOT)),
            "scale": scale,
            "seeds": seeds,
            "target": TARGET,
            "same_decision": same,
            "within_target": within,
            "turns": [
                asdict(r) | {"same_decision": r.same_decision, "within_target": r.within_target} for r in rows
            ],
        }
        print(f"saved {save('fleet_vllm_check', figures, args=args)}")


if __name__ == "__main__":
    main()
