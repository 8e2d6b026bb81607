"""Router replicas benchmark (issue 12 §2): the retention-hint hit rate, reuse and PlanTurn
latency over 3 router replicas, gateway round robin against conversation affinity, in one run.

    python -m bench.router_replicas [--conversations 60] [--turns 5] [--concurrency 6]

Every piece is its own process as deployed (deploy.local.control_plane): one registry (in
memory), three routers sharing a turn-signing key, and two `kvshuttle-gateway` processes over
the same three router addresses, one with ROUTER__AFFINITY=round_robin (one channel balancing
every call) and one with ROUTER__AFFINITY=conversation (kvshuttle.gateway.affinity). The
engines are stand-ins in this process (bench/emulator/http/engine.py: vLLM's HTTP surface and
kv_transfer_params, no model, answers at once). The same chats run through both gateways at
once (so both see the same machine), on conversations of their own: `--conversations` chats of
`--turns` turns per gateway, up to `--concurrency` chats at a time each, each chat's turns one
after another.

Read from the routers' own `rpc.done` lines of PlanTurn (`retention_hint`, `decision`,
`reusable_tokens`, `ms`, `registry_ms`) and from the gateways' `request.done` lines (`plan_ms`):
the hint outcome of every turn after a conversation's first, the reuse plans, the tokens reused
per reuse plan (a hint carries the last answer's tokens, so its cut is token granular; a plan
on the registry's retention is cut at a block boundary), and PlanTurn latency with and without
a hint. Prints a table and writes bench/results/router_replicas-<utc time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # deploy/ (the control plane, the stand-in engine) is not installed

from deploy.local.control_plane import ControlPlane  # noqa: E402
from deploy.local.processes import free_ports  # noqa: E402

from bench.emulator.http.config import in_process_config  # noqa: E402
from bench.emulator.http.engine import StandinEngine  # noqa: E402
from bench.emulator.http.tokenizer import WORDS, make_tokenizer  # noqa: E402
from bench.report import save  # noqa: E402
from kvshuttle.core.digest import log_name  # noqa: E402

MODEL = "Qwen/Qwen3-32B"
MODES = ("round_robin", "conversation")
BS = 16  # the engines' block size, as registered


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)


def json_lines(path: Path, skip: int = 0) -> list[dict[str, Any]]:
    lines = path.read_text(errors="replace").splitlines()[skip:]
    return [json.loads(x) for x in lines if x.startswith("{")]


def spawn_gateway(
    plane: ControlPlane, mode: str, port: int, model_dir: Path, work: Path
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSHUTTLE_")} | {
        "KVSHUTTLE_GATEWAY_LISTEN": f"127.0.0.1:{port}",
        "KVSHUTTLE_GATEWAY_ROUTER__ADDRESS": ",".join(plane.router_addrs),
        "KVSHUTTLE_GATEWAY_ROUTER__AFFINITY": mode,
        "KVSHUTTLE_GATEWAY_ROUTER__TOKEN_FILE": str(plane.token_file("gateway")),
        "KVSHUTTLE_GATEWAY_ROUTER__TIMEOUT": "10",
        "KVSHUTTLE_GATEWAY_MODELS": json.dumps({MODEL: str(model_dir)}),
        "KVSHUTTLE_GATEWAY_CACHE_SALT_KEY": "bench-cache-salt-key-0123456789",
        "KVSHUTTLE_GATEWAY_TELEMETRY__LOG_FORMAT": "json",
    }
    log = (work / f"gateway-{mode}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "kvshuttle.gateway.main"], env=env, stdout=log, stderr=subprocess.STDOUT
    )


async def wait_http(url: str, proc: subprocess.Popen[bytes]) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {proc.returncode}")
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def drive(url: str, mode: str, args: argparse.Namespace) -> float:
    """Every chat through the gateway at `url`; the wall time."""
    limit = asyncio.Semaphore(args.concurrency)

    async def chat(session: aiohttp.ClientSession, c: int) -> None:
        rnd = random.Random(c)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": " ".join(rnd.choice(WORDS) for _ in range(args.system_words))}
        ]
        async with limit:
            for _ in range(args.turns):
                messages.append({"role": "user", "content": " ".join(rnd.choice(WORDS) for _ in range(40))})
                body = {"model": MODEL, "messages": messages, "conversation_id": f"{mode}-{c}"}
                async with session.post(url + "/v1/chat/completions", json=body) as response:
                    answer = await response.json()
                    assert response.status == 200, answer
                messages.append(answer["choices"][0]["message"])

    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(chat(session, c) for c in range(args.conversations)))
    return time.perf_counter() - started


def summarize(plans: list[dict[str, Any]], gateway: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    later = [p for p in plans if p.get("generation", 1) > 1]  # a first turn has no retention yet
    outcomes = {o: sum(p.get("retention_hint") == o for p in later) for o in ("hit", "miss", "refused")}
    reuse = [p for p in later if p.get("decision") == "reuse"]

    def latency(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "n": len(rows),
            "ms_p50": pct([r["ms"] for r in rows], 0.5),
            "ms_p90": pct([r["ms"] for r in rows], 0.9),
            "registry_ms_p50": pct([r.get("registry_ms", 0.0) for r in rows], 0.5),
        }

    def reused(rows: list[dict[str, Any]]) -> dict[str, Any]:
        tokens = [r["reusable_tokens"] for r in rows]
        return {
            "n": len(rows),
            "mean_tokens": round(statistics.fmean(tokens), 2) if tokens else None,
            "off_block_boundary": sum(t % BS != 0 for t in tokens),
            # What a token-granular cut adds over a cut at the last full block.
            "partial_block_tokens_mean": round(statistics.fmean(t % BS for t in tokens), 2)
            if tokens
            else None,
        }

    done = [x for x in gateway if x.get("event") == "request.done"]
    return {
        "turns": len(plans),
        "turns_after_first": len(later),
        "wall_s": round(wall_s, 2),
        "hint_outcomes": outcomes,
        "hint_hit_rate": round(outcomes["hit"] / len(later), 4) if later else None,
        "reuse_plans": len(reuse),
        "reuse_rate": round(len(reuse) / len(later), 4) if later else None,
        "decisions": {
            f"{d}/{r}": sum(p.get("decision") == d and p.get("reason") == r for p in later)
            for d, r in sorted({(p.get("decision"), p.get("reason")) for p in later}, key=str)
        },
        "reused_tokens_per_reuse_plan": reused(reuse),
        "reused_tokens_by_hint": {
            o: reused([p for p in reuse if p.get("retention_hint") == o]) for o in ("hit", "miss", "refused")
        },
        "plan_turn_server_side": {
            o: latency([p for p in later if p.get("retention_hint") == o]) for o in outcomes
        },
        "gateway_plan_ms_p50": pct([x["plan_ms"] for x in done if "plan_ms" in x], 0.5),
        "gateway_plan_ms_p90": pct([x["plan_ms"] for x in done if "plan_ms" in x], 0.9),
        "gateway_errors": sum(x.get("status") != 200 for x in done),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvshuttle-router-replicas-"))
    model_dir = make_tokenizer(work / "model")
    # Room for every conversation's retained KV (held 480 s) with the prefix cache beside it.
    common: dict[str, Any] = {"served_model_name": MODEL, "block_size": BS, "num_blocks": 65536}
    prefill = StandinEngine(in_process_config("prefill", "engine-p0", model_dir, **common))
    decode = StandinEngine(in_process_config("decode", "engine-d0", model_dir, **common))
    report: dict[str, Any] = {}
    with ControlPlane(work / "plane", routers=3) as plane:
        await prefill.start()
        await decode.start()
        for name, engine in (("nodes/p0", prefill), ("nodes/d0", decode)):
            plane.register_node(
                name,
                engine.config.role,
                http_endpoint=engine.url,
                model=MODEL,
                engine_id=engine.config.engine_id,
                block_size=BS,
                side_channel_port=engine.side_channel_port,
            )
        ports = dict(zip(MODES, free_ports(len(MODES)), strict=True))
        gateways = {m: spawn_gateway(plane, m, ports[m], model_dir, work) for m in MODES}
        try:
            for mode in MODES:
                await wait_http(f"http://127.0.0.1:{ports[mode]}/health", gateways[mode])
            # Both at once, so both see the same machine (other processes share its cores).
            walls = await asyncio.gather(*(drive(f"http://127.0.0.1:{ports[m]}", m, args) for m in MODES))
            await asyncio.sleep(1.0)  # the last commits and log lines written
            mode_of = {
                log_name(f"tenants/default/conversations/{m}-{c}"): m
                for m in MODES
                for c in range(args.conversations)
            }
            plans = [
                x
                for r in plane.routers
                for x in json_lines(r.log_path)
                if x.get("event") == "rpc.done" and x.get("method") == "PlanTurn"
            ]
            for mode, wall_s in zip(MODES, walls, strict=True):
                mine = [x for x in plans if mode_of.get(x.get("conversation", "")) == mode]
                report[mode] = summarize(mine, json_lines(work / f"gateway-{mode}.log"), wall_s)
        finally:
            for proc in gateways.values():
                proc.terminate()
            for proc in gateways.values():
                proc.wait(15)
            await prefill.stop()
            await decode.stop()
    if args.keep:
        print(f"logs: {work}", file=sys.stderr)
    else:
        shutil.rmtree(work)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=60)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=800, help="~tokens of the first prompt")
    ap.add_argument("--keep", action="store_true", help="keep the processes' logs (the path is printed)")
    args = ap.parse_args()
    report = asyncio.run(run(args))
    print(f"3 router replicas, {args.conversations} conversations x {args.turns} turns per mode")
    print(f"{'':34}" + "".join(f"{m:>16}" for m in MODES))
    rows: list[tuple[str, Callable[[dict[str, Any]], object]]] = [
        ("hint hit rate (turns 2+)", lambda r: r["hint_hit_rate"]),
        ("hint hit / miss / refused", lambda r: "/".join(str(v) for v in r["hint_outcomes"].values())),
        ("reuse plans (turns 2+)", lambda r: r["reuse_plans"]),
        ("reused tokens per reuse plan", lambda r: r["reused_tokens_per_reuse_plan"]["mean_tokens"]),
        ("  cut inside a block", lambda r: r["reused_tokens_per_reuse_plan"]["off_block_boundary"]),
        (
            "  tokens past the last full block",
            lambda r: r["reused_tokens_per_reuse_plan"]["partial_block_tokens_mean"],
        ),
        ("PlanTurn ms p50, hint refused", lambda r: r["plan_turn_server_side"]["refused"]["ms_p50"]),
        ("PlanTurn ms p50, hint hit", lambda r: r["plan_turn_server_side"]["hit"]["ms_p50"]),
        ("PlanTurn ms p50, no hint", lambda r: r["plan_turn_server_side"]["miss"]["ms_p50"]),
        ("gateway plan_ms p50", lambda r: r["gateway_plan_ms_p50"]),
        ("gateway errors", lambda r: r["gateway_errors"]),
    ]
    for label, get in rows:
        print(f"{label:34}" + "".join(f"{get(report[m])!s:>16}" for m in MODES))
    out = save("router_replicas", report, args=args)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
