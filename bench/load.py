"""The bounded load run (issue 12 §4): conversations through gateway -> router -> registry, every
kvshuttle service its own process, over stand-in engines (bench/emulator/http/launcher.py: vLLM's HTTP
and KV-event surface, small fixed latencies, no model), at increasing offered rates, for three
registry configurations in one run:

    memory     the in-memory store (one registry process)
    redis-1    the Redis store, one registry replica (AOF on, appendfsync everysec)
    redis-2    the Redis store, two registry replicas over the same redis-server: the router
               and both agents balance over both (`REGISTRY__ADDRESS` "a,b", round robin; the
               block index is shared through Redis, so a report to either replica counts)

    python -m bench.load [--turns 2100] [--conversations 200] [--rates 15,30,45,60,80,110]
    python -m bench.load --full          # 10,000 turns per configuration

Workload: `--conversations` conversations, carried on from step to step (so prompts grow over the
run: `mean_prompt_tokens` per step); a conversation's first prompt is `--first-tokens` tokens,
every later prompt is the previous prompt + the answer + `--user-tokens` new tokens;
`--max-tokens` answer tokens, non-streaming. A warm-up of 40 turns on conversations of its own
comes first. Arrivals are open loop:
Poisson at the step's rate, `--turns / len(rates)` per step; an arrival goes to the longest idle
conversation whose think time (exponential, mean `--think-s`) has passed, and waits when none is
(a conversation's turns stay sequential, as a user's or an agent's are).

Per turn: `latency` = the client's request sent to the gateway's last byte (an arrival that found
no idle conversation waits first: `queued`, not in the latency); `engine` = the stand-in
engines' own time for the turn's requests (prefill and decode, receipt to last byte, as each
engine records it by X-Request-Id); `control plane` = latency - engine: everything kvshuttle adds
around the engines (the gateway's parsing and tokenizer-free turn handling, PlanTurn through the
router to the registry, the waits for the conversation's previous commit, the HTTP hops to the
engines). The KV read is engine time (the reader's). A turn is `wrong` when its answer differs
from a clean recompute of its prompt (`StandinPair.expected`); it must never happen.

Per step: offered and achieved turns/s, latency and control-plane p50/p99, reuse ratio, wrong
answers, errors, and CPU seconds per process (from /proc: registry replicas, router, gateway,
agents, engines, redis-server, this client) with each one's share of a core. The knee is the
highest rate whose achieved rate is >= 90% of the offered and whose control-plane p99 is at most
4x the first step's. RSS of every process before the first step, after the last and after
`--cool-down-s` idle. The machine's busy cores per step (/proc/stat) and those not this run's
(`others_cores`): on a shared machine, a step slowed by other work shows there.
Per step also, the control plane's own account: CPU milliseconds per turn per process (the
second table printed; `cp` is kvshuttle's processes together; `cp-idle` the same less each
process's CPU over `--idle-s` seconds with no turn, before the steps, scaled to the step's wall
time: the turns' own cost, which compares across rates), and per turn, from each service's
log (bench/load_account.py), its log lines and the RPCs it served by method and caller, and from
the router's and registry's /metrics the serialized request and response bytes by method.
`--profile DIR` records every kvshuttle process with py-spy over the steps (speedscope JSON in
DIR/<config>/; py-spy is in the dev extras; on a busy machine its on-CPU samples also catch a
process preempted at a syscall, so read shares, not absolute times; `--profile-gil` keeps only
samples holding the GIL, Python's own work).
Prints the tables, writes bench/results/load-<utc time>.json; `--keep-logs` keeps each
configuration's work folder under `--dir` (every service's structlog JSON: the gateway's
`request.done` per turn, one `rpc.done` per RPC with its duration).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import os
import random
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from deploy.local.processes import free_ports
from deploy.local.services import Service, grpc_ready, registry_service
from deploy.local.stack import HOST, KvshuttleStack, RegistryStore
from deploy.local.vllm_venv import ensure_model

from bench.emulator.http.launcher import StandinPair
from bench.load_account import LogAccount, Profiles, WireAccount
from bench.report import save

CONFIGS = ("memory", "redis-1", "redis-2")
# Prefill dear against moving KV: reuse wins whenever the prefix verifies.
PROFILE: dict[str, Any] = {
    "model": "m",
    "kv_bytes_per_token": 1024,
    "min_reuse_tokens": 64,
    "prefill": {"fixed_ms": 1.0, "per_token_ms": 0.05},
    "link": {"bandwidth_gb_s": 10.0, "fixed_ms": 0.2},
}
_TICK = os.sysconf("SC_CLK_TCK")
# kvshuttle's own processes, by name prefix (engines, redis-server and the client are not).
_CONTROL_PLANE = ("registry", "router", "gateway", "agent")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (every core, every process: the
    other work on a shared machine included), from /proc/stat's first line."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / _TICK  # all but idle and iowait (no guests)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Conversation:
    name: str
    prompt: list[int]
    turns: int = 0


@dataclass
class Step:
    rate: float
    turns: int
    latency_s: list[float] = field(default_factory=list)
    control_s: list[float] = field(default_factory=list)
    ids: list[tuple[str, float]] = field(default_factory=list)  # (request id, latency)
    queued_s: list[float] = field(default_factory=list)  # arrival -> sent (no idle conversation)
    prompt_tokens: list[int] = field(default_factory=list)
    reused: int = 0
    wrong: int = 0
    errors: int = 0
    wall_s: float = 0.0


class Run:
    """One configuration: its processes up, then every rate step."""

    def __init__(self, config: str, args: argparse.Namespace, work: Path) -> None:
        self.config, self.args, self.work = config, args, work
        model = ensure_model("tiny")
        self.pair = StandinPair(
            model,
            log_dir=work / "engines",
            prefill_prefix_caching=False,  # every reuse turn reads decode's KV
            prefill_us_per_token=args.prefill_us_per_token,
            decode_ms_per_token=args.decode_ms_per_token,
            read_us_per_block=args.read_us_per_block,
            num_blocks=args.num_blocks,
            # Room for a conversation that took every turn (long prompts: --first-tokens 32768).
            max_model_len=max(
                8192, args.first_tokens + (args.user_tokens + args.max_tokens) * args.turns + 64
            ),
        )
        store: RegistryStore = "memory" if config == "memory" else "redis"
        self.stack = KvshuttleStack(self.pair, work_dir=work, profile=PROFILE, registry_store=store)
        self.replica: Service | None = None
        self._tie = itertools.count(args.conversations)  # idle-heap order among equal times
        if config == "redis-2":
            env = self.stack.registry.env
            auth = {k.removeprefix("KVSHUTTLE_REGISTRY_"): v for k, v in env.items() if "AUTH__" in k}
            self.replica_addr = f"{HOST}:{free_ports(1)[0]}"
            assert self.stack.redis is not None
            self.replica = registry_service(
                listen=self.replica_addr, log_dir=work, auth=auth, redis_url=self.stack.redis.url,
                extra={"TELEMETRY__LOG_FORMAT": "json"}, name="registry-2",
            )  # fmt: skip
            both = f"{self.stack.registry_addr},{self.replica_addr}"
            self.stack.router.env["KVSHUTTLE_ROUTER_REGISTRY__ADDRESS"] = both
            # The block index is shared (kvshuttle.registry.feeds.redis_index): agents may report
            # to either replica, round robin as the router plans.
            for agent in self.stack.agents:
                agent.env["KVSHUTTLE_AGENT_REGISTRY__ADDRESS"] = both

    def processes(self) -> dict[str, int]:
        found = {s.name: s.proc.pid for s in self.stack.services if s.proc is not None}
        if self.replica is not None and self.replica.proc is not None:
            found["registry-2"] = self.replica.proc.pid
        for engine in self.pair.engines:
            if engine.pid is not None:
                found[f"engine-{engine.name}"] = engine.pid
        if self.stack.redis is not None and self.stack.redis.proc is not None:
            found["redis-server"] = self.stack.redis.proc.pid
        found["client"] = os.getpid()
        return found

    def logs(self) -> dict[str, Path]:
        """Every kvshuttle service's structlog file, by process name."""
        found = {s.name: s.log_path for s in self.stack.services}
        if self.replica is not None:
            found["registry-2"] = self.replica.log_path
        return found

    def start(self) -> None:
        self.pair.start()
        try:
            self.stack.start()
            if self.replica is not None:
                self.replica.start()
                deadline = time.monotonic() + 30
                while not grpc_ready(self.replica_addr):
                    self.replica.check()
                    if time.monotonic() > deadline:
                        raise TimeoutError("the second registry replica is not serving")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        try:
            if self.replica is not None:
                self.replica.stop()
            self.stack.stop()
        finally:
            self.pair.stop()

    def engine_times(self) -> dict[str, float]:
        times: dict[str, float] = {}
        for engine in self.pair.engines:
            times.update(engine.get_json("/standin/timings?clear=1")["timings"])
        return times

    def conversations(self, tag: str) -> list[tuple[float, int, Conversation]]:
        """Fresh conversations, as the idle heap `step` takes (by the time each may go on)."""
        rng = random.Random(tag)
        return [
            (
                0.0,
                i,
                Conversation(f"{tag}-{i}", [rng.randrange(10, 2000) for _ in range(self.args.first_tokens)]),
            )
            for i in range(self.args.conversations)
        ]

    async def step(
        self,
        session: aiohttp.ClientSession,
        rate: float,
        turns: int,
        idle: list[tuple[float, int, Conversation]],
    ) -> Step:
        """`turns` arrivals at `rate`, on the `idle` conversations (a heap by the time each may
        go on; they continue from step to step)."""
        args, rng = self.args, random.Random(f"{self.config}-{rate}")
        step = Step(rate, turns)
        tasks: list[asyncio.Task[None]] = []
        started = time.monotonic()
        waiting: deque[float] = deque()  # arrival times not yet given a conversation

        async def turn(conv: Conversation, arrived: float) -> None:
            body = {"model": "m", "prompt": conv.prompt, "max_tokens": args.max_tokens,
                    "return_token_ids": True, "conversation_id": conv.name}  # fmt: skip
            sent = time.monotonic()
            step.queued_s.append(sent - arrived)
            try:
                async with session.post(f"{self.stack.gateway_url}/v1/completions", json=body) as response:
                    answer = await response.json()
                    latency = time.monotonic() - sent
                    if response.status != 200:
                        step.errors += 1
                        return
                    out = answer["choices"][0]["token_ids"]
                    step.latency_s.append(latency)
                    step.prompt_tokens.append(len(conv.prompt))
                    step.ids.append((response.headers["X-Request-Id"], latency))
                    step.reused += int(response.headers["X-Kvshuttle-Reused-Tokens"]) > 0
                    step.wrong += out != self.pair.expected(conv.prompt, args.max_tokens)
                    conv.prompt = (
                        conv.prompt + out + [rng.randrange(10, 2000) for _ in range(args.user_tokens)]
                    )
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                step.errors += 1
            finally:
                conv.turns += 1
                again = time.monotonic() + rng.expovariate(1 / args.think_s)
                heapq.heappush(idle, (again, next(self._tie), conv))

        def dispatch(now: float) -> None:
            while waiting and idle and idle[0][0] <= now:
                tasks.append(asyncio.create_task(turn(heapq.heappop(idle)[2], waiting.popleft())))

        next_at = started
        for _ in range(turns):
            next_at += rng.expovariate(rate)
            while (now := time.monotonic()) < next_at:
                dispatch(now)
                await asyncio.sleep(min(0.002, next_at - now))
            waiting.append(next_at)
            dispatch(time.monotonic())
        while waiting:
            dispatch(time.monotonic())
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)
        step.wall_s = time.monotonic() - started
        times = await asyncio.to_thread(self.engine_times)
        for request_id, latency in step.ids:
            engine = sum(times.get(f"{request_id}{suffix}", 0.0) for suffix in ("-p", "-pr", "-d"))
            step.control_s.append(latency - engine)
        return step


def summarize_step(
    step: Step, cpu: dict[str, float], machine_s: float, idle: dict[str, float]
) -> dict[str, Any]:
    ms = 1e3
    done = len(step.latency_s)
    # Every turn costs CPU, a failed one too: CPU per turn is per arrival.
    per_turn = {k: round(v * ms / max(step.turns, 1), 2) for k, v in cpu.items()}
    net = {
        k: round(max(v - idle.get(k, 0.0) * step.wall_s, 0.0) * ms / max(step.turns, 1), 2)
        for k, v in cpu.items()
    }
    p = {f"{name}_{q}_ms": (None if (v := pct(values, qq)) is None else round(v * ms, 2))
         for name, values in (("latency", step.latency_s), ("control_plane", step.control_s))
         for q, qq in (("p50", 0.5), ("p99", 0.99))}  # fmt: skip
    return {
        "offered_turns_s": step.rate,
        "achieved_turns_s": round(done / step.wall_s, 1) if step.wall_s else 0.0,
        "turns": step.turns,
        "served": done,
        "errors": step.errors,
        "wrong": step.wrong,
        "reuse_ratio": round(step.reused / done, 3) if done else 0.0,
        "queued_p99_ms": None if (q := pct(step.queued_s, 0.99)) is None else round(q * ms, 2),
        "mean_prompt_tokens": round(sum(step.prompt_tokens) / done) if done else 0,
        **p,
        "wall_s": round(step.wall_s, 2),
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
        "cpu_ms_per_turn": per_turn,
        "control_plane_cpu_ms_per_turn": round(
            sum(v for k, v in per_turn.items() if k.startswith(_CONTROL_PLANE)), 2
        ),
        # Less each process's idle CPU over the step's wall time: the turns' own cost.
        "idle_cpu_ms_per_s": {k: round(v * ms, 2) for k, v in idle.items()},
        "cpu_ms_per_turn_less_idle": net,
        "control_plane_cpu_ms_per_turn_less_idle": round(
            sum(v for k, v in net.items() if k.startswith(_CONTROL_PLANE)), 2
        ),
        "cpu_share_all": round(sum(cpu.values()) / step.wall_s, 2) if step.wall_s else 0.0,
        "cpu_share_of_core": {k: round(v / step.wall_s, 2) for k, v in cpu.items()} if step.wall_s else {},
        # Cores the whole machine kept busy, and those of it not this run's processes (other
        # work on a shared machine): low cpu_share_all with a busy machine is contention.
        "machine_busy_cores": round(machine_s / step.wall_s, 2) if step.wall_s else 0.0,
        "others_cores": round(max(machine_s - sum(cpu.values()), 0.0) / step.wall_s, 2)
        if step.wall_s
        else 0.0,
    }


def knee(steps: list[dict[str, Any]]) -> dict[str, Any]:
    base = steps[0]["control_plane_p99_ms"] or 0.0
    good = [
        s
        for s in steps
        if s["achieved_turns_s"] >= 0.9 * s["offered_turns_s"]
        and (s["control_plane_p99_ms"] or 0) <= 4 * base
    ]
    top = steps[-1]["cpu_share_of_core"]
    busiest = sorted(((v, k) for k, v in top.items()), reverse=True)[:3]
    return {
        "knee_offered_turns_s": good[-1]["offered_turns_s"] if good else None,
        "knee_achieved_turns_s": good[-1]["achieved_turns_s"] if good else None,
        "max_achieved_turns_s": max(s["achieved_turns_s"] for s in steps),
        "busiest_at_top_step": [{"process": k, "core_share": v} for v, k in busiest],
    }


async def run_config(run: Run, args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    per_step = max(1, args.turns // len(args.rates))
    connector = aiohttp.TCPConnector(limit=2000)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # Warm-up (connections, the tokenizer's and the stores' first calls) on conversations of its own.
        await run.step(session, 5.0, 40, run.conversations(f"{run.config}-warmup"))
        conversations = run.conversations(run.config)
        procs = run.processes()
        # Each process's CPU a second with no turn at all (heartbeats, polls): what a step's
        # per-turn figures less idle leave out, so that steps at different rates compare.
        cpu0 = {k: cpu_seconds(p) for k, p in procs.items()}
        await asyncio.sleep(args.idle_s)
        idle = {k: (cpu_seconds(p) - cpu0[k]) / args.idle_s for k, p in procs.items()} if args.idle_s else {}
        rss_before = {k: round(rss_mib(p), 1) for k, p in procs.items()}
        account = LogAccount(run.logs())
        wire = WireAccount(
            {name: f"http://{HOST}:{port}/metrics" for name, port in run.stack.metrics_ports.items()}
        )
        profiles = None
        if args.profile is not None:
            services = {k: p for k, p in procs.items() if k.startswith(_CONTROL_PLANE)}
            profiles = Profiles(args.profile / run.config, services, gil=args.profile_gil)
        steps = []
        for rate in args.rates:
            account.mark()
            await asyncio.to_thread(wire.mark)
            cpu0, machine0 = {k: cpu_seconds(p) for k, p in procs.items()}, machine_busy_seconds()
            step = await run.step(session, rate, per_step, conversations)
            cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in procs.items()}
            steps.append(summarize_step(step, cpu, machine_busy_seconds() - machine0, idle))
            steps[-1]["per_turn"] = account.per_turn(step.turns)
            steps[-1]["per_turn"]["bytes"] = await asyncio.to_thread(wire.per_turn, step.turns)
            s = steps[-1]
            log(f"{run.config:8} {rate:6.0f}/s -> {s['achieved_turns_s']:6.1f}/s  cp p50 "
                f"{s['control_plane_p50_ms']} p99 {s['control_plane_p99_ms']} ms  reuse {s['reuse_ratio']}  "
                f"wrong {s['wrong']} errors {s['errors']}  cpu {s['cpu_share_all']} cores "
                f"(machine {s['machine_busy_cores']}, others {s['others_cores']})")  # fmt: skip
        if profiles is not None:
            await asyncio.to_thread(profiles.stop)
            log(f"{run.config}: profiles in {args.profile / run.config}")
        rss_after = {k: round(rss_mib(p), 1) for k, p in procs.items()}
        await asyncio.sleep(args.cool_down_s)
        rss_cool = {k: round(rss_mib(p), 1) for k, p in procs.items()}
    return {
        "config": run.config,
        "steps": steps,
        **knee(steps),
        "rss_mib": {"before": rss_before, "after": rss_after, "after_cool_down": rss_cool},
        "engine_stats": {e.name: e.get_json("/standin/timings?clear=1")["stats"] for e in run.pair.engines},
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'config':8} {'offered':>8} {'achieved':>8} {'cp p50':>7} {'cp p99':>7} {'lat p99':>7} "
             f"{'reuse':>5} {'wrong':>5} {'err':>4} {'cores':>5} {'others':>6}  "
             "busiest (share of a core)"]  # fmt: skip
    for r in results:
        for s in r["steps"]:
            top = sorted(s["cpu_share_of_core"].items(), key=lambda kv: -kv[1])[:3]
            lines.append(
                f"{r['config']:8} {s['offered_turns_s']:8.0f} {s['achieved_turns_s']:8.1f} "
                f"{s['control_plane_p50_ms']:7.1f} {s['control_plane_p99_ms']:7.1f} "
                f"{s['latency_p99_ms']:7.1f} "
                f"{s['reuse_ratio']:5.2f} {s['wrong']:5d} {s['errors']:4d} {s['cpu_share_all']:5.2f} "
                f"{s['others_cores']:6.2f}  " + ", ".join(f"{k} {v:.2f}" for k, v in top)
            )
        lines.append(
            f"{r['config']:8} knee {r['knee_offered_turns_s']}/s offered "
            f"({r['knee_achieved_turns_s']}/s achieved), max {r['max_achieved_turns_s']}/s"
        )
    return "\n".join(lines) + "\n\n" + cpu_table(results) + "\n\n" + account_table(results)


def cpu_table(results: list[dict[str, Any]]) -> str:
    """CPU milliseconds per turn, one column per process, one row per step; `cp` is kvshuttle's
    own processes together (the engines, redis-server and the client apart)."""
    names = sorted({k for r in results for s in r["steps"] for k in s["cpu_ms_per_turn"]})
    lines = [f"{'CPU ms/turn':11} {'offered':>7} {'cp':>6} {'cp-idle':>7} "
             + " ".join(f"{n[:14]:>14}" for n in names)]  # fmt: skip
    for r in results:
        for s in r["steps"]:
            row = s["cpu_ms_per_turn"]
            lines.append(
                f"{r['config']:11} {s['offered_turns_s']:7.0f} {s['control_plane_cpu_ms_per_turn']:6.2f} "
                f"{s['control_plane_cpu_ms_per_turn_less_idle']:7.2f} "
                + " ".join(f"{row[n]:14.2f}" if n in row else f"{'':14}" for n in names)
            )
    return "\n".join(lines)


def account_table(results: list[dict[str, Any]]) -> str:
    """Per turn: the RPCs each service served (by method and caller) and the serialized bytes
    of each method's requests and responses."""
    lines = [f"{'per turn':11} {'offered':>7} {'service':9} {'method <- caller':44} {'calls':>6} "
             f"{'req B':>9} {'resp B':>8}"]  # fmt: skip
    for r in results:
        for s in r["steps"]:
            account = s["per_turn"]
            for service, calls in account["rpcs"].items():
                wire = account.get("bytes", {}).get(service, {})
                for key, count in calls.items():
                    method = key.split(" <- ")[0]
                    sizes = wire.get(method, {})
                    share = count / sum(v for k, v in calls.items() if k.split(" <- ")[0] == method)
                    lines.append(
                        f"{r['config']:11} {s['offered_turns_s']:7.0f} {service:9} {key[:44]:44} "
                        f"{count:6.3f} {sizes.get('request', 0) * share:9.0f} "
                        f"{sizes.get('response', 0) * share:8.0f}"
                    )
            total = sum(sum(v.values()) for v in account["rpcs"].values())
            nbytes = sum(
                x for m in account.get("bytes", {}).values() for sides in m.values() for x in sides.values()
            )
            lines.append(f"{r['config']:11} {s['offered_turns_s']:7.0f} all: {total:.2f} RPCs, "
                         f"{nbytes:.0f} bytes per turn")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=2100, help="turns per configuration (all its steps)")
    ap.add_argument("--full", action="store_true", help="10,000 turns per configuration")
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--rates", default="15,30,45,60,80,110", help="offered turns/s, one step each")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--first-tokens", type=int, default=512)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--prefill-us-per-token", type=float, default=5.0)
    ap.add_argument("--decode-ms-per-token", type=float, default=0.2)
    ap.add_argument("--read-us-per-block", type=float, default=20.0)
    ap.add_argument("--num-blocks", type=int, default=65536)
    ap.add_argument("--cool-down-s", type=float, default=10.0)
    ap.add_argument("--idle-s", type=float, default=10.0,
                    help="seconds with no turn before the steps, for each process's idle CPU")  # fmt: skip
    ap.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where each configuration's work folder (logs, tokens, Redis) is made",
    )
    ap.add_argument("--profile", type=Path, default=None,
                    help="py-spy profiles of the services, in PROFILE/<config>/")  # fmt: skip
    ap.add_argument("--profile-gil", action="store_true",
                    help="profile only samples that hold the GIL (py-spy --gil)")  # fmt: skip
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the work folders (services' structlog JSON, engines' logs)")  # fmt: skip
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.full:
        args.turns = 10_000
    configs = args.configs.split(",")
    began = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - began:6.0f} s] {line}", flush=True)

    started = datetime.now(UTC)
    results: list[dict[str, Any]] = []
    for config in configs:
        results.append(run_one(config, args, log))
        # Written after every configuration (the same file): a long run that stops early keeps
        # what it measured.
        out = {
            "total_wall_s": round(time.monotonic() - began, 1),
            "results": results,
            "control_plane_definition": "client latency - the stand-in engines' own time for the turn",
        }
        path = save("load", out, args=args, utc=started)
    print(table(results))
    print(f"total {round(time.monotonic() - began, 1)} s; wrote {path}")


def run_one(config: str, args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """One configuration, started afresh once more when it does not come up (on a shared
    machine another process may take a port between its probe and the service's bind)."""
    retried = False
    while True:
        work = Path(tempfile.mkdtemp(prefix=f"kvshuttle-load-{config}-", dir=args.dir))
        run = Run(config, args, work)
        log(f"{config}: starting")
        try:
            run.start()
        except (RuntimeError, TimeoutError) as exc:
            if retried:
                raise
            retried = True
            log(f"{config}: did not start ({str(exc).splitlines()[0]}); once more, on new ports")
            continue
        try:
            return asyncio.run(run_config(run, args, log))
        finally:
            run.stop()
            if args.keep_logs:
                log(f"{config}: logs kept in {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
