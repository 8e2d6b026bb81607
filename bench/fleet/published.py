"""llm-d's agentic P/D run with and without peer-to-peer KV sharing, on the fleet simulator, against
the numbers llm-d published for it:

    python -m bench.fleet.published                  # seeds 1-3, every arm, 2P+4D
    python -m bench.fleet.published --seeds 1 --arms llm-d,llm-d-no-p2p

The run: "Pull, Don't Recompute: Peer-to-Peer KV Cache Sharing in llm-d" (llm-d.github.io,
blog/2026-08-15_p2p-kv-cache-sharing-llm-d.md @9a8058f7, section "Preserve Session History Across
P/D Roles") and its report (github zetxqx/llm-d@0db219d1, guides/p2p-kv-cache-sharing/
benchmark-results/qwen3-30b-h200-pd-agentic.md): Qwen3-30B-A3B-Thinking-2507, 2 prefill + 4
decode pods, one H200 each (TP 1), block 64, max-model-len 131072; "plain NIXL P/D" against the
same plus a 128 GiB CPU offload tier per pod (`offload_prompt_only: false`) and the pull
(`p2p-source-producer`, minCachedTokenDelta 1024); median TTFT 6.83 -> 1.09 s, 0.82 -> 1.24 req/s.

The engines: deploy/profiles/qwen3-30b-a3b-h200-tp1.toml (aiconfigurator, Qwen/Qwen3-30B-A3B, the
Thinking-2507 checkpoint's architecture, at TP 1 as deployed). The arms (`ARMS`):

    llm-d-no-p2p       bench/fleet/peers.py's LlmD without the pull, no CPU tier: the post's baseline
    llm-d              LlmD with the pull, a 128 GiB CPU tier on every pod: the post's P2P arm
    llm-d-cpu-no-pull  LlmD without the pull, the CPU tier kept: what the tier alone buys (the post
                       adds tier and pull together)
    kvshuttle, kvshuttle-no-pool   bench/fleet/run.py's POLICIES as they ship there (the
                       agents' host pools 256 GiB, or none), for the record

The workload (`Workload`, `conversations`): the post's "agentic-serving profile", driven as
inference-perf drives it ("288 requests at concurrency 16 ... through llmdbenchmark/
inference-perf"; kubernetes-sigs/inference-perf@7de5ef2, datagen/replay/
conversation_replay_datagen.py, apis/user_session.py, loadgen/load_generator.py, read for this):

* 24 conversations; a two-part system prompt, 3,000 tokens shared by all (every template of
  llm-d's guides/agentic-serving/benchmark-templates) then 10K-100K of the conversation's own
  (lognormal, mean 50K); 4-40 turns (lognormal, mean 12); per turn ~1,500 new input tokens
  (lognormal, std 1,200, 100-10,000, the templates'), ~425 output tokens (lognormal, std 825,
  50-10,000, the templates'), and a tool call of 1-20 s after the answer (whole seconds, as
  inference-perf samples them). Lognormals by mean and std, clipped and rounded, as
  inference-perf's `sample_from_distribution`.
* Request i is conversation i mod 24's next turn (round-robin), handed to worker (i mod 24) mod 8;
  each of the 8 workers takes its requests in order, at most 16 / 8 in flight. A request holds
  its worker slot while it waits for its conversation's previous turn (the session lock), while
  it is served, and through its tool call after the answer (slept before the lock is released).
  A conversation whose turns run out before the run's requests do starts over with its system
  prompt (inference-perf's recycling: a new session).
* A prompt is the system prompt, then each earlier turn's input and answer, then the turn's input;
  past max-model-len less the answer and 200 tokens, the oldest turns are dropped.
* Measured as inference-perf reports: TTFT from the request's send to its first token, over all
  requests; throughput = requests / (last end - first send), a request ending after its tool call.

Not published, so chosen here and saved with the figures: the system prompt's std (25,000: the
mean prompt over seeds 1-40 is 59.5K, 49-70K a seed, against the report's 61.9K; the templates'
coefficient of variation, 1.46, would give 50.0K), the turns' std (12), the tool call's mean and
std (5 s, 5 s), 8 workers (the templates'), the router's exact config (peers.py's rules; the
report says only that both arms place alike). `--kv-tokens`, `--pcie-gb-s`, `--output-mean` and
`--tool-mean` change one assumption at a time, to see what a figure hangs on.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import numpy as np
from deploy.profiles.schema import EngineProfile, load_engine_profiles

from bench.cluster.workload.blocks import BlockIds
from bench.cluster.workload.model import InputKind, Request, Session, StopReason
from bench.cluster.workload.tokens import TokenMap
from bench.emulator.fleet import vtime
from bench.emulator.fleet.fleet import Fleet, FleetConfig
from bench.fleet.kvshuttle_sim import quiet_logs
from bench.fleet.peers import LlmD
from bench.fleet.replay import Policy, ReplayResult, SimTurn, TurnRecord, _extends, _fill, _History, _seed
from bench.fleet.run import HOST_GIB_PER_ENGINE, POLICIES
from bench.report import ROOT, save

__all__ = [
    "ARMS",
    "PUBLISHED",
    "Arm",
    "Conversation",
    "Lognormal",
    "Workload",
    "conversations",
    "figures",
    "run_arm",
]

PROFILE: Final = ROOT / "deploy/profiles/qwen3-30b-a3b-h200-tp1.toml"
PREFILL: Final = 2
DECODE: Final = 4
BLOCK_SIZE: Final = 64
CPU_TIER_GIB: Final = 128.0  # per pod, the report's
# The published figures: median TTFT (s) and requests per second, without and with the pull.
PUBLISHED: Final = {
    "llm-d-no-p2p": {"ttft_p50_s": 6.83, "throughput_rps": 0.82},
    "llm-d": {"ttft_p50_s": 1.09, "throughput_rps": 1.24},
}
TOLERANCE: Final = 0.25
RUN_LIMIT_S: Final = 3600.0  # virtual seconds; a request still running then is cut


@dataclass(frozen=True, slots=True)
class Lognormal:
    """inference-perf's lognormal: the underlying normal moment-matched to `mean` and `std`,
    samples clipped to [low, high] and rounded to whole numbers."""

    mean: float
    std: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, count: int) -> list[int]:
        sigma2 = math.log(1 + (self.std / self.mean) ** 2)
        mu = math.log(self.mean) - sigma2 / 2
        drawn = rng.lognormal(mu, math.sqrt(sigma2), count)
        return [int(v) for v in np.clip(np.round(np.clip(drawn, self.low, self.high)), self.low, self.high)]


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int = 24
    requests: int = 288
    concurrency: int = 16
    workers: int = 8
    shared_system_tokens: int = 3000
    system_tokens: Lognormal = Lognormal(50_000, 25_000, 10_000, 100_000)
    turns: Lognormal = Lognormal(12, 12, 4, 40)
    input_tokens: Lognormal = Lognormal(1500, 1200, 100, 10_000)
    output_tokens: Lognormal = Lognormal(425, 825, 50, 10_000)
    tool_s: Lognormal = Lognormal(5, 5, 1, 20)
    max_model_len: int = 131_072
    block_size: int = BLOCK_SIZE

    def slots(self, worker: int) -> int:
        """A worker's share of the concurrency (inference-perf's _set_worker_concurrency)."""
        share, extra = divmod(self.concurrency, self.workers)
        return share + (worker < extra)


@dataclass(frozen=True, slots=True)
class Conversation:
    """One conversation's requests in the run, in order, as the sessions its slot runs (a new one
    each time it starts over), and the tool call slept after each request."""

    index: int
    sessions: tuple[Session, ...]
    tool_s: tuple[float, ...]

    @property
    def requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions)


class _Turns:
    """One session's prompts as block ids: the system prompt, then turn after turn."""

    def __init__(self, ids: BlockIds, system: tuple[int, ...], system_tokens: int, w: Workload) -> None:
        self.ids, self.system, self.system_tokens, self.w = ids, system, system_tokens, w
        self.history: list[tuple[int, int]] = []  # earlier turns' (input, output) tokens
        self.prompt_ids: tuple[int, ...] = ()
        self.prompt_tokens = 0
        self.requests: list[Request] = []

    def send(self, added: int, output: int, think_s: float) -> None:
        bs, limit = self.w.block_size, self.w.max_model_len - output - 200
        history = sum(i + o for i, o in self.history)
        if self.system_tokens + history + added > limit:
            # inference-perf drops the oldest turns to fit: the prompt after the system prompt is new.
            while self.history and self.system_tokens + history + added > limit:
                i, o = self.history.pop(0)
                history -= i + o
            total = self.system_tokens + history + added
            self.prompt_ids = self.ids.extend(self.system, self.system_tokens, total, bs)
        elif not self.requests:
            total = self.system_tokens + added
            self.prompt_ids = self.ids.extend(self.system, self.system_tokens, total, bs)
        else:
            total = self.prompt_tokens + self.requests[-1].output_tokens + added
            self.prompt_ids = self.ids.extend(self.prompt_ids, self.prompt_tokens, total, bs)
        self.prompt_tokens = total
        kind = InputKind.TOOL_RESULT if self.requests else InputKind.TEXT
        self.requests.append(
            Request(total, output, self.prompt_ids, kind, StopReason.TOOL_CALLS, think_time_ms=think_s * 1e3)
        )
        self.history.append((added, output))


def conversations(workload: Workload, seed: int) -> list[Conversation]:
    """The run's conversations, a function of `workload` and `seed` alone."""
    w, bs = workload, workload.block_size
    rng = np.random.default_rng(seed)
    turns = w.turns.sample(rng, w.conversations)
    own = w.system_tokens.sample(rng, w.conversations)
    total = sum(turns)
    inputs, outputs, tools = (d.sample(rng, total) for d in (w.input_tokens, w.output_tokens, w.tool_s))
    ids = BlockIds()
    shared = ids.fresh(w.shared_system_tokens // bs)
    out = []
    first = 0
    for c in range(w.conversations):
        n = turns[c]
        system_tokens = w.shared_system_tokens + own[c]
        system = ids.extend(shared, len(shared) * bs, system_tokens, bs)
        mine = range(c, w.requests, w.conversations)  # round-robin over the conversations
        sessions: list[Session] = []
        gaps: list[float] = []
        current: _Turns | None = None
        for r in range(len(mine)):
            t = r % n
            if t == 0:
                if current is not None:
                    sessions.append(Session(f"conv-{c}~{len(sessions)}", bs, tuple(current.requests)))
                # A fresh session: the same system prompt; new tokens after it, as the model's
                # answers differ on a replay and so does all that follows them.
                current = _Turns(ids, system, system_tokens, w)
            assert current is not None
            think = float(tools[first + t - 1]) if t else 0.0
            current.send(inputs[first + t], outputs[first + t], think)
            gaps.append(float(tools[first + t]))
        if current is not None:
            sessions.append(Session(f"conv-{c}~{len(sessions)}", bs, tuple(current.requests)))
        out.append(Conversation(c, tuple(sessions), tuple(gaps)))
        first += n
    return out


# -- the closed loop ----------------------------------------------------------------------------


@dataclass(slots=True)
class Sent:
    """A request as the client saw it: its record, when it ended (after its tool call), what the
    prefill pulled from a peer."""

    record: TurnRecord
    end_s: float | None = None
    pulled_tokens: int = 0


class _Client:
    """inference-perf's concurrent load over the conversations (see the module's docstring)."""

    def __init__(self, policy: Policy, convs: Sequence[Conversation], w: Workload) -> None:
        self.policy, self.w = policy, w
        self.convs = convs
        self.tokens = TokenMap(151_000, seed=0, reserved=1_000)
        self.sent: list[Sent] = []
        self.result = ReplayResult()  # where _fill puts token gaps (not reported here)
        self._locks: dict[str, asyncio.Lock] = {}
        self._history: dict[str, _History] = {}

    async def run(self) -> None:
        w = self.w
        queues: list[list[tuple[Conversation, int, int, int]]] = [[] for _ in range(w.workers)]
        position = [(0, 0)] * len(self.convs)  # (session, request) next per conversation
        taken = [0] * len(self.convs)
        for i in range(sum(c.requests for c in self.convs)):
            c = self.convs[i % w.conversations]
            s, k = position[c.index]
            queues[c.index % w.workers].append((c, s, k, taken[c.index]))
            taken[c.index] += 1
            position[c.index] = (s, k + 1) if k + 1 < len(c.sessions[s].requests) else (s + 1, 0)
        workers = [self._worker(q, w.slots(n)) for n, q in enumerate(queues) if w.slots(n)]
        await asyncio.gather(*workers)

    async def _worker(self, queue: list[tuple[Conversation, int, int, int]], slots: int) -> None:
        free = asyncio.Semaphore(slots)
        tasks = []
        for item in queue:
            await free.acquire()
            tasks.append(asyncio.create_task(self._request(*item, free)))
        await asyncio.gather(*tasks)

    async def _request(self, conv: Conversation, s: int, k: int, n: int, free: asyncio.Semaphore) -> None:
        try:
            session = conv.sessions[s]
            lock = self._locks.setdefault(session.session_id, asyncio.Lock())
            async with lock:  # the session lock: the previous turn answered and its tool call done
                await self._turn(session, k, conv.tool_s[n])
        finally:
            free.release()

    async def _turn(self, session: Session, k: int, tool_s: float) -> None:
        loop = asyncio.get_running_loop()
        bs = session.block_size
        history = self._history.setdefault(session.session_id, _History(bs))
        request = session.requests[k]
        trace = self.tokens.prompt(request.hash_ids, request.input_tokens, bs)
        previous = session.requests[k - 1] if k else None
        if previous is not None and _extends(previous.hash_ids, request.hash_ids, previous.input_tokens, bs):
            history.extend(trace[previous.input_tokens + previous.output_tokens :])
        else:
            history.set(trace)
        turn = SimTurn(
            conversation=session.session_id,
            index=k,
            prompt=history.prompt(_seed(history.keys, history.tokens, bs)),
            output=request.output_tokens,
            next_think_s=tool_s,
            stop=request.stop_reason,
        )
        sent = loop.time()
        record = TurnRecord(session.session_id, k, sent, len(history.tokens), turn.output)
        entry = Sent(record)
        self.sent.append(entry)
        try:
            served = await self.policy.serve(turn)
        except asyncio.CancelledError:
            record.error = "cut"
            raise
        _fill(record, served, sent, loop.time(), self.result)
        if served.reason == "p2p" and served.prefill_answer is not None:
            entry.pulled_tokens = served.prefill_answer.read_tokens
        history.extend(served.answer.output)
        await asyncio.sleep(tool_s)
        entry.end_s = loop.time()


# -- arms and runs ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arm:
    """A policy and the fleet it ships with: host DRAM per engine for the CPU tier, on which roles,
    and whether decode retains its KV for a later reader (kvshuttle's)."""

    name: str
    build: Callable[[Fleet, int], Policy]
    host_gib: float = 0.0
    host_roles: tuple[str, ...] = ()
    retain_decode: bool = False


def _from_run(name: str) -> Arm:
    spec = POLICIES[name]
    host = HOST_GIB_PER_ENGINE if spec.host_roles else 0.0
    return Arm(name, spec.build, host, spec.host_roles, spec.retain_decode)


ARMS: Final = {
    a.name: a
    for a in (
        Arm("llm-d-no-p2p", lambda f, s: LlmD(f, seed=s, p2p=False)),
        Arm("llm-d", lambda f, s: LlmD(f, seed=s, p2p=True), CPU_TIER_GIB, ("prefill", "decode")),
        Arm(
            "llm-d-cpu-no-pull", lambda f, s: LlmD(f, seed=s, p2p=False), CPU_TIER_GIB, ("prefill", "decode")
        ),
        _from_run("kvshuttle"),
        _from_run("kvshuttle-no-pool"),
    )
}


@dataclass(frozen=True, slots=True)
class Topology:
    """The fleet: the report's 2P+4D, PCIe per GPU for CPU-tier loads (FleetConfig's 50 GB/s), and
    the engines' KV capacity (None: the profile's), the last two for what-ifs."""

    prefill: int = PREFILL
    decode: int = DECODE
    pcie_gb_s: float = 50.0
    kv_tokens: int | None = None

    def engines(self, profile: EngineProfile) -> EngineProfile:
        if self.kv_tokens is None:
            return profile
        return replace(profile, engine=replace(profile.engine, kv_capacity_tokens=self.kv_tokens))


@dataclass
class ArmRun:
    arm: str
    seed: int
    sent: list[Sent]
    engines: dict[str, dict[str, float]] = field(default_factory=dict)
    cpu_s: float = 0.0


async def _run(
    arm: Arm,
    convs: Sequence[Conversation],
    w: Workload,
    profile: EngineProfile,
    seed: int,
    topology: Topology,
) -> ArmRun:
    fleet = Fleet(
        FleetConfig(
            topology.engines(profile),
            prefill=topology.prefill,
            decode=topology.decode,
            block_size=w.block_size,
            pcie_gb_s_per_gpu=topology.pcie_gb_s,
            host_gib_per_engine=arm.host_gib,
            host_roles=arm.host_roles,
            retain_decode=arm.retain_decode,
        )
    )
    fleet.start()
    policy = arm.build(fleet, seed)
    starter = getattr(policy, "start", None)
    if starter is not None:
        await starter()
    client = _Client(policy, convs, w)
    try:
        async with asyncio.timeout(RUN_LIMIT_S):
            await client.run()
    except TimeoutError:
        pass  # what is still running is cut: counted as failed
    closer = getattr(policy, "close", None)
    if closer is not None:
        await closer()
    engines = {
        e.name: {
            "prefill_s": round(e.timing.prefill_ms / 1e3, 3),
            "busy_s": round(e.timing.busy_ms / 1e3, 3),
            "computed_tokens": e.counters.computed_tokens,
            "gpu_hit_tokens": e.counters.gpu_hit_tokens,
            "host_hit_tokens": e.counters.host_hit_tokens,
            "nic_bytes": e.nic.bytes_moved,
        }
        for e in fleet.engines
    }
    await fleet.stop()
    return ArmRun(arm.name, seed, client.sent, engines)


def run_arm(
    arm: str,
    workload: Workload,
    profile: EngineProfile,
    seed: int,
    topology: Topology = Topology(),
) -> ArmRun:
    """One arm on the workload of `seed` (the policy's draws seeded alike), in virtual time."""
    started = time.process_time()
    convs = conversations(workload, seed)
    with quiet_logs():
        out = vtime.run(_run(ARMS[arm], convs, workload, profile, seed, topology))
    out.cpu_s = time.process_time() - started
    return out


def figures(run: ArmRun) -> dict[str, Any]:
    """What inference-perf's report gives, and where the prompt tokens came from."""
    sent = run.sent
    done = [
        (s.record, s.end_s, s.record.ttft_s)
        for s in sent
        if s.end_s is not None and s.record.ttft_s is not None and not s.record.error
    ]
    ttft = [t for _, _, t in done]
    first = min(s.record.sent_s for s in sent)
    end = max((e for _, e, _ in done), default=first)
    span = max(end - first, 1e-9)
    prompts = [s.record.prompt_tokens for s in sent]
    engines = run.engines

    def role(key: str, name: str) -> float:
        return round(sum(v[key] for e, v in engines.items() if e.startswith(name)), 3)

    return {
        "arm": run.arm,
        "seed": run.seed,
        "requests": len(sent),
        "failed": len(sent) - len(done),
        "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
        "ttft_p95_s": round(float(np.percentile(ttft, 95)), 3) if ttft else None,
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3) if ttft else None,
        "ttft_mean_s": round(statistics.fmean(ttft), 3) if ttft else None,
        "latency_p50_s": round(statistics.median([e - r.sent_s for r, e, _ in done]), 3) if done else None,
        "throughput_rps": round(len(done) / span, 4),
        "output_tok_s": round(sum(r.output_tokens for r, _, _ in done) / span, 1),
        "duration_s": round(span, 1),
        "prompt_tokens_mean": round(statistics.fmean(prompts)),
        "computed_tokens_per_request": round(sum(s.record.computed_tokens for s in sent) / len(sent)),
        "host_tokens_per_request": round(sum(s.record.host_tokens for s in sent) / len(sent)),
        "pulls": sum(s.record.reason == "p2p" for s in sent),
        "pulled_tokens": sum(s.pulled_tokens for s in sent),
        "prefill_busy_s": role("prefill_s", "prefill"),
        "decode_busy_s": role("busy_s", "decode"),
        "decisions": dict(sorted(Counter(f"{s.record.decision}:{s.record.reason}" for s in sent).items())),
        "cpu_s": round(run.cpu_s, 2),
    }


# -- the comparison -----------------------------------------------------------------------------


def _median(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def compare(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median over seeds of each arm's TTFT p50 and throughput, their ranges, the two ratios
    (TTFT without / with the pull, throughput with / without), each against the published one."""
    arms: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == name]
        arms[name] = {
            key: {"median": _median(mine, key), "seeds": [r[key] for r in mine]}
            for key in ("ttft_p50_s", "throughput_rps", "prompt_tokens_mean", "pulls", "pulled_tokens")
        }
    out: dict[str, Any] = {"arms": arms, "checks": {}}
    checks = out["checks"]
    for name, published in PUBLISHED.items():
        if name not in arms:
            continue
        for key, theirs in published.items():
            ours = arms[name][key]["median"]
            checks[f"{name} {key}"] = _check(ours, theirs)
    base, p2p = arms.get("llm-d-no-p2p"), arms.get("llm-d")
    if base is not None and p2p is not None:
        by_seed = {r["seed"]: r for r in rows if r["arm"] == "llm-d-no-p2p"}
        ttft, rps = [], []
        for r in rows:
            b = by_seed.get(r["seed"])
            if r["arm"] == "llm-d" and b is not None and r["ttft_p50_s"] and b["ttft_p50_s"]:
                ttft.append(b["ttft_p50_s"] / r["ttft_p50_s"])
                rps.append(r["throughput_rps"] / b["throughput_rps"])
        theirs_ttft = PUBLISHED["llm-d-no-p2p"]["ttft_p50_s"] / PUBLISHED["llm-d"]["ttft_p50_s"]
        theirs_rps = PUBLISHED["llm-d"]["throughput_rps"] / PUBLISHED["llm-d-no-p2p"]["throughput_rps"]
        if ttft:
            checks["ttft_p50 ratio (without / with)"] = _check(statistics.median(ttft), theirs_ttft, ttft)
            checks["throughput ratio (with / without)"] = _check(statistics.median(rps), theirs_rps, rps)
    return out


def _check(ours: float | None, theirs: float, seeds: Sequence[float] = ()) -> dict[str, Any]:
    off = None if ours is None else ours / theirs - 1
    return {
        "sim": None if ours is None else round(ours, 3),
        "published": round(theirs, 3),
        "off": None if off is None else round(off, 3),
        "within_25pct": off is not None and abs(off) <= TOLERANCE,
        **({"seeds": [round(v, 3) for v in seeds]} if seeds else {}),
    }


# (key, heading, width, decimals) of each column of the per-run table
_COLUMNS: Final = (
    ("ttft_p50_s", "TTFT p50", 8, 2),
    ("ttft_p95_s", "p95", 6, 2),
    ("ttft_mean_s", "mean", 6, 2),
    ("throughput_rps", "req/s", 6, 3),
    ("duration_s", "dur s", 6, 0),
    ("latency_p50_s", "lat p50", 7, 2),
    ("prompt_tokens_mean", "prompt", 7, 0),
    ("computed_tokens_per_request", "computed", 8, 0),
    ("host_tokens_per_request", "host", 6, 0),
    ("pulls", "pulls", 5, 0),
    ("pulled_tokens", "pulled", 8, 0),
    ("prefill_busy_s", "pf busy", 7, 0),
    ("failed", "fail", 4, 0),
)


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'arm':18} {'seed':>4} " + " ".join(f"{h:>{w}}" for _, h, w, _ in _COLUMNS)]
    for r in rows:
        cells = [f"{'-':>{w}}" if r[k] is None else f"{r[k]:{w}.{d}f}" for k, _, w, d in _COLUMNS]
        lines.append(f"{r['arm']:18} {r['seed']:4d} " + " ".join(cells))
    return "\n".join(lines)


def checks_table(summary: dict[str, Any]) -> str:
    lines = [f"{'figure':40} {'sim':>8} {'published':>9} {'off':>7}  within 25 %  (per seed)"]
    for name, c in summary["checks"].items():
        sim = "-" if c["sim"] is None else f"{c['sim']:.3f}"
        off = "-" if c["off"] is None else f"{c['off']:+.1%}"
        seeds = " ".join(f"{v:.2f}" for v in c.get("seeds", []))
        lines.append(f"{name:40} {sim:>8} {c['published']:9.3f} {off:>7}  {c['within_25pct']!s:11}  {seeds}")
    return "\n".join(lines)


# -- the command --------------------------------------------------------------------------------


Job = tuple[str, Workload, Path, int, Topology]


def _one(job: Job) -> dict[str, Any]:
    arm, workload, profile_path, seed, topology = job
    return figures(run_arm(arm, workload, load_engine_profiles(profile_path)[0], seed, topology))


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet.published", description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--profile", type=Path, default=PROFILE)
    ap.add_argument("--prefill", type=int, default=PREFILL)
    ap.add_argument("--decode", type=int, default=DECODE)
    ap.add_argument("--kv-tokens", type=int, help="each engine's KV capacity (default: the profile's)")
    ap.add_argument("--pcie-gb-s", type=float, default=Topology().pcie_gb_s, help="CPU-tier loads, per GPU")
    ap.add_argument("--output-mean", type=float, help="mean output tokens per turn (default 425)")
    ap.add_argument("--tool-mean", type=float, help="mean tool call, s (default 5; std as large)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
    return args


def workload_of(args: argparse.Namespace) -> Workload:
    w = Workload()
    if args.output_mean is not None:
        w = replace(w, output_tokens=replace(w.output_tokens, mean=args.output_mean))
    if args.tool_mean is not None:
        w = replace(w, tool_s=replace(w.tool_s, mean=args.tool_mean, std=args.tool_mean))
    return w


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    started = time.monotonic()
    workload = workload_of(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    topology = Topology(args.prefill, args.decode, args.pcie_gb_s, args.kv_tokens)
    jobs: list[Job] = [
        (arm, workload, args.profile, seed, topology) for seed in seeds for arm in args.arms.split(",")
    ]
    if args.jobs > 1:
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            rows = pool.map(_one, jobs, chunksize=1)
    else:
        rows = [_one(job) for job in jobs]
    summary = compare(rows)
    wall = round(time.monotonic() - started, 1)
    args_out = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = save(
        "fleet_published",
        {
            "wall_s": wall,
            "published": PUBLISHED,
            "workload": asdict(workload),
            "topology": {**asdict(topology), "cpu_tier_gib": CPU_TIER_GIB},
            "summary": summary,
            "runs": rows,
        },
        args=args_out,
        directory=args.out,
        utc=datetime.now(UTC),
    )
    print(table(rows))
    print()
    print(checks_table(summary))
    print(f"{path} ({wall} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
