"""Router benchmark: PlanTurn + CommitTurn over gRPC, many concurrent conversations whose
prompts grow turn by turn (to 24k tokens by default), against real `kvshuttle-registry` and
`kvshuttle-router` processes.

    python -m bench.router_bench [--conversations 64] [--turns 20] [--max-tokens 24576]

Reports, per turn (one PlanTurn + one CommitTurn):
- router time: what the router itself spends (its canonical log lines' own_ms, registry
  waits excluded), hashing and verifying the whole prompt included;
- wall time seen by the client (router + registry hops + gRPC on a shared 2-core machine);
- turns/s over the run.
Prints a table and writes bench/results/router_bench-<utc time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from bench.report import save
from kvshuttle.registry.v1 import registry_service_pb2 as rpb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as rpb_grpc
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.router.v1 import router_service_pb2_grpc as pb_grpc
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams

MODEL = "bench-model"
BLOCK = 16
# A CPU-class profile: reuse wins whenever the prefix verifies, so every turn after the first
# takes the full path (verify, claim, truncate).
PROFILE = {
    "model": MODEL,
    "kv_bytes_per_token": 65536,
    "min_reuse_tokens": 64,
    "prefill": {"fixed_ms": 5.0, "per_token_ms": 0.3},
    "link": {"bandwidth_gb_s": 10.0, "fixed_ms": 2.0},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


async def start(cmd: str, env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    out = log.open("wb")
    return await asyncio.create_subprocess_exec(sys.executable, "-m", cmd, env=env, stdout=out, stderr=out)


async def wait_ready(addr: str) -> None:
    async with grpc.aio.insecure_channel(addr) as ch:
        await asyncio.wait_for(ch.channel_ready(), 60)


async def register_nodes(registry: str) -> None:
    async with grpc.aio.insecure_channel(registry) as ch:
        stub = rpb_grpc.RegistryServiceStub(ch)
        for name, role in (("nodes/p0", rpb.NODE_ROLE_PREFILL), ("nodes/d0", rpb.NODE_ROLE_DECODE)):
            node = (
                await stub.RegisterNode(
                    rpb.RegisterNodeRequest(
                        ttl=Duration(seconds=300),
                        node=rpb.Node(
                            name=name,
                            role=role,
                            engine_id=f"engine-{name[6:]}",
                            http_endpoint=f"http://{name[6:]}:8000",
                            side_channel_host="127.0.0.1",
                            side_channel_port=5600,
                            model=MODEL,
                            block_size=BLOCK,
                            kv_bytes_per_token=65536,
                        ),
                    )
                )
            ).node
            await stub.HeartbeatNode(
                rpb.HeartbeatNodeRequest(
                    name=name,
                    incarnation=node.incarnation,
                    ttl=Duration(seconds=300),
                    load=rpb.NodeLoad(engine_healthy=True),
                )
            )


async def conversation(
    stub: pb_grpc.RouterServiceAsyncStub, index: int, turns: int, max_tokens: int, out: list[dict[str, Any]]
) -> None:
    rng = random.Random(index)
    per_turn = max_tokens // turns
    output = max(per_turn // 8, 16)
    sequence: list[int] = []
    block_id = 1
    for turn in range(1, turns + 1):
        prompt = sequence + [rng.randrange(10, 150_000) for _ in range(per_turn - output)]
        t0 = time.perf_counter()
        plan = await stub.PlanTurn(
            pb.PlanTurnRequest(
                conversation=f"tenants/bench/conversations/c{index}", model=MODEL, prompt_token_ids=prompt
            )
        )
        t1 = time.perf_counter()
        answer = [rng.randrange(10, 150_000) for _ in range(output)]
        sequence = prompt + answer
        blocks = -(-len(sequence) // BLOCK)
        params = KvTransferParams(
            do_remote_decode=True,
            remote_engine_id=plan.decode.engine_id,
            remote_request_id=f"cmpl-{turn}",
            remote_host="127.0.0.1",
            remote_port=5600,
            remote_num_tokens=len(sequence) - 1,
            remote_block_ids=[BlockIdList(block_ids=range(block_id, block_id + blocks))],
        )
        block_id += blocks
        t2 = time.perf_counter()
        await stub.CommitTurn(
            # The output alone, as the gateway sends it: this replica planned the turn.
            pb.CommitTurnRequest(
                turn=plan.turn,
                output_token_ids=pb.OutputTokenIds(token_ids=answer),
                decode_kv_transfer_params=params,
            )
        )
        t3 = time.perf_counter()
        out.append(
            {
                "conversation": index,
                "turn": turn,
                "prompt_tokens": len(prompt),
                "decision": pb.Decision.Name(plan.decision),
                "reason": pb.DecisionReason.Name(plan.reason),
                "reusable_tokens": plan.reusable_tokens,
                "plan_ms": (t1 - t0) * 1e3,
                "commit_ms": (t3 - t2) * 1e3,
            }
        )


def own_cpu_by_prompt(log: Path) -> dict[int, dict[str, list[float]]]:
    """The router's own CPU per RPC by the turn's prompt length: PlanTurn lines carry
    prompt_tokens, and a CommitTurn line is tied to its plan's by the turn handle's digest."""
    plans: dict[str, tuple[int, float]] = {}
    commits: dict[str, float] = {}
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") != "rpc.done" or "own_cpu_ms" not in event or "turn" not in event:
            continue
        if event.get("method") == "PlanTurn" and "prompt_tokens" in event:
            plans[event["turn"]] = (int(event["prompt_tokens"]), float(event["own_cpu_ms"]))
        elif event.get("method") == "CommitTurn":
            commits[event["turn"]] = float(event["own_cpu_ms"])
    out: dict[int, dict[str, list[float]]] = {}
    for turn, (tokens, plan_ms) in plans.items():
        sizes = out.setdefault(tokens, {"PlanTurn": [], "CommitTurn": []})
        sizes["PlanTurn"].append(plan_ms)
        if turn in commits:
            sizes["CommitTurn"].append(commits[turn])
    return out


def own_times(log: Path, key: str) -> dict[str, list[float]]:
    """The router's own time per RPC (`key`: own_ms wall, own_cpu_ms CPU), from its `rpc.done` lines."""
    times: dict[str, list[float]] = {"PlanTurn": [], "CommitTurn": []}
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") == "rpc.done" and event.get("method") in times and key in event:
            times[event["method"]].append(float(event[key]))
    return times


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    registry, router = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSHUTTLE_")}
    procs = [
        await start(
            "kvshuttle.registry.main",
            base
            | {
                "KVSHUTTLE_REGISTRY_SERVER__LISTEN": registry,
                "KVSHUTTLE_REGISTRY_TELEMETRY__LOG_FORMAT": "json",
                "KVSHUTTLE_REGISTRY_TELEMETRY__LOG_LEVEL": "warning",
            },
            workdir / "registry.log",
        ),
        await start(
            "kvshuttle.router.main",
            base
            | {
                "KVSHUTTLE_ROUTER_SERVER__LISTEN": router,
                "KVSHUTTLE_ROUTER_REGISTRY__ADDRESS": registry,
                "KVSHUTTLE_ROUTER_PROFILES": json.dumps([PROFILE]),
                "KVSHUTTLE_ROUTER_TURN_SIGNING_KEY": "b" * 32,
                "KVSHUTTLE_ROUTER_TELEMETRY__LOG_FORMAT": "json",
            },
            workdir / "router.log",
        ),
    ]
    try:
        await wait_ready(registry)
        await wait_ready(router)
        await register_nodes(registry)
        rows: list[dict[str, Any]] = []
        options = [
            ("grpc.max_send_message_length", 64 * 2**20),
            ("grpc.max_receive_message_length", 64 * 2**20),
        ]
        async with grpc.aio.insecure_channel(router, options=options) as ch:
            stub: pb_grpc.RouterServiceAsyncStub = pb_grpc.RouterServiceStub(ch)
            start_t = time.perf_counter()
            await asyncio.gather(
                *(conversation(stub, i, args.turns, args.max_tokens, rows) for i in range(args.conversations))
            )
            wall = time.perf_counter() - start_t
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            await asyncio.wait_for(proc.wait(), 30)
    own = own_times(workdir / "router.log", "own_cpu_ms")
    wall_own = own_times(workdir / "router.log", "own_ms")
    by_prompt = own_cpu_by_prompt(workdir / "router.log")
    per_turn_own = [p + c for p, c in zip(own["PlanTurn"], own["CommitTurn"], strict=False)]
    per_turn_own_wall = [p + c for p, c in zip(wall_own["PlanTurn"], wall_own["CommitTurn"], strict=False)]
    per_turn_wall = [r["plan_ms"] + r["commit_ms"] for r in rows]
    longest = [r for r in rows if r["turn"] == args.turns]
    reasons: dict[str, int] = {}
    for r in rows:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    return {
        "turns": len(rows),
        "turns_per_s": round(len(rows) / wall, 1),
        "wall_s": round(wall, 2),
        "max_prompt_tokens": max(r["prompt_tokens"] for r in rows),
        "router_ms_per_turn": {
            "p50": round(pct(per_turn_own, 0.5), 3),
            "p99": round(pct(per_turn_own, 0.99), 3),
            "mean": round(statistics.fmean(per_turn_own), 3),
        },
        "router_wall_ms_per_turn": {
            "p50": round(pct(per_turn_own_wall, 0.5), 3),
            "p99": round(pct(per_turn_own_wall, 0.99), 3),
        },
        "router_ms_plan": {
            "p50": round(pct(own["PlanTurn"], 0.5), 3),
            "p99": round(pct(own["PlanTurn"], 0.99), 3),
        },
        "router_ms_commit": {
            "p50": round(pct(own["CommitTurn"], 0.5), 3),
            "p99": round(pct(own["CommitTurn"], 0.99), 3),
        },
        # Own CPU p50 by prompt length (every conversation's turn t has the same length).
        "router_ms_by_prompt_tokens": {
            str(tokens): {
                "plan_p50": round(pct(times["PlanTurn"], 0.5), 3),
                "commit_p50": round(pct(times["CommitTurn"], 0.5), 3) if times["CommitTurn"] else None,
            }
            for tokens, times in sorted(by_prompt.items())
        },
        "wall_ms_per_turn": {
            "p50": round(pct(per_turn_wall, 0.5), 2),
            "p99": round(pct(per_turn_wall, 0.99), 2),
        },
        "wall_ms_per_turn_at_longest": {
            "p50": round(pct([r["plan_ms"] + r["commit_ms"] for r in longest], 0.5), 2)
        },
        "reasons": reasons,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=24_576, help="prompt length reached at the last turn")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    r = result
    print(
        f"{r['turns']} turns ({args.conversations} conversations x {args.turns}), prompts up to "
        f"{r['max_prompt_tokens']} tokens: {r['turns_per_s']} turns/s"
    )
    print(
        f"router CPU time per turn (own, hashing included): p50 {r['router_ms_per_turn']['p50']} ms, "
        f"p99 {r['router_ms_per_turn']['p99']} ms  [plan p50 {r['router_ms_plan']['p50']} / "
        f"commit p50 {r['router_ms_commit']['p50']}]"
    )
    print(
        f"router wall time per turn (own, preemption on 2 shared cores included): "
        f"p50 {r['router_wall_ms_per_turn']['p50']} ms, p99 {r['router_wall_ms_per_turn']['p99']} ms"
    )
    print(
        f"client wall time per turn (router + registry + gRPC, 2 shared cores): "
        f"p50 {r['wall_ms_per_turn']['p50']} ms, p99 {r['wall_ms_per_turn']['p99']} ms"
    )
    print("router CPU p50 by prompt tokens (plan / commit, ms):")
    print(
        "  "
        + "  ".join(
            f"{tokens}: {v['plan_p50']}/{v['commit_p50']}"
            for tokens, v in r["router_ms_by_prompt_tokens"].items()
        )
    )
    print(f"decisions: {r['reasons']}")
    figures = {"result": result, "targets": {"router_ms_p50": 0.5, "router_ms_p99": 2.0}}
    out = save("router_bench", figures, args=args)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
