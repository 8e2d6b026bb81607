"""Gateway benchmark: the gateway's own latency per request (`added_ms`) for ~4k-token
multi-turn chats, every piece in its own process as deployed.

    python -m bench.gateway_added_latency [--conversations 20] [--turns 8] [--stream]

A registry and a router (the console scripts), two stand-in engines (bench/emulator: vLLM's
HTTP surface and KV transfer without a model, no simulated compute: they answer at once), and
`kvshuttle-gateway` (JSON logs, tracing on without an exporter, the tokenizer-verification
sampling at its default). The client sends one
request at a time and reads the gateway's `request.done` lines: `added_ms` (wall time less the
prefill and decode requests: parse, tokenize, PlanTurn, the engines' JSON, the response), and
its parts; the commits, which run after the response, from their `turn.committed` lines. Then,
in this process, tokenization alone: the whole chat through tokenizers vs. the gateway's
segment cache on the turn-by-turn growing conversation.
Prints the figures and writes bench/results/gateway_added_latency-<utc time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from google.protobuf.duration_pb2 import Duration

ROOT = Path(__file__).resolve().parents[1]
# The stand-in engine and its tokenizer live in the repo (deploy/), not the venv.
sys.path.insert(0, str(ROOT))

from bench.emulator.http.launcher import StandinEngineProcess, StandinPair  # noqa: E402
from bench.emulator.http.tokenizer import WORDS, make_tokenizer  # noqa: E402
from bench.report import save  # noqa: E402
from kvshuttle.gateway.config import ModelSettings  # noqa: E402
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer  # noqa: E402
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb  # noqa: E402
from kvshuttle.registry.v1 import registry_service_pb2_grpc as reg_grpc  # noqa: E402

MODEL = "Qwen/Qwen3-32B"
BLOCK_SIZE = 16
PROFILES = ROOT / "deploy" / "profiles" / "qwen3-32b-h200.toml"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args, env={**os.environ, **env}, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT
    )


async def wait_http(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def register(address: str, pair: StandinPair) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reg_grpc.RegistryServiceStub(channel)
        await asyncio.wait_for(channel.channel_ready(), 30)
        engines: tuple[tuple[str, reg_pb.NodeRole.ValueType, StandinEngineProcess], ...] = (
            ("nodes/p0", reg_pb.NODE_ROLE_PREFILL, pair.prefill),
            ("nodes/d0", reg_pb.NODE_ROLE_DECODE, pair.decode),
        )
        for name, role, engine in engines:
            node = reg_pb.Node(
                name=name,
                role=role,
                engine_id=engine.engine_id,
                http_endpoint=engine.url,
                side_channel_host=engine.spec.host,
                side_channel_port=engine.spec.side_channel_port,
                model=MODEL,
                block_size=BLOCK_SIZE,
                kv_bytes_per_token=262144,
            )
            ttl = Duration(seconds=300)  # the registry's maximum: the run is shorter
            got = await stub.RegisterNode(reg_pb.RegisterNodeRequest(node=node, ttl=ttl))
            await stub.HeartbeatNode(
                reg_pb.HeartbeatNodeRequest(
                    name=name,
                    incarnation=got.node.incarnation,
                    ttl=ttl,
                    load=reg_pb.NodeLoad(engine_healthy=True),
                )
            )


def words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


async def drive(url: str, conversations: int, turns: int, stream: bool, system_words: int) -> None:
    rnd = random.Random(7)
    async with aiohttp.ClientSession() as session:
        for c in range(conversations):
            messages: list[dict[str, Any]] = [{"role": "system", "content": words(rnd, system_words)}]
            for _ in range(turns):
                messages.append({"role": "user", "content": words(rnd, 60)})
                body = {
                    "model": MODEL,
                    "messages": messages,
                    "conversation_id": f"bench-{c}",
                    "stream": stream,
                }
                async with session.post(url + "/v1/chat/completions", json=body) as response:
                    raw = await response.read()
                    assert response.status == 200, raw[:300]
                if stream:
                    text = "".join(
                        json.loads(e[6:])["choices"][0]["delta"].get("content", "")
                        for e in raw.decode().split("\n\n")
                        if e.startswith("data: {") and '"choices":[{' in e
                    )
                else:
                    text = json.loads(raw)["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": text})


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def tokenization_bench(model_dir: Path, system_words: int, turns: int) -> dict[str, float]:
    tok = ChatTokenizer.load(MODEL, ModelSettings(tokenizer=model_dir))
    rnd = random.Random(9)
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(rnd, system_words)}]
    full, cached, render = [], [], []
    for _ in range(turns):
        messages.append({"role": "user", "content": words(rnd, 60)})
        t0 = time.perf_counter()
        text = tok.render(messages)
        t1 = time.perf_counter()
        exact = tok.encode_exact(text, add_special_tokens=False)
        t2 = time.perf_counter()
        ids = tok.encode_chat(text)
        t3 = time.perf_counter()
        assert ids == exact
        render.append((t1 - t0) * 1e3)
        full.append((t2 - t1) * 1e3)
        cached.append((t3 - t2) * 1e3)
        messages.append({"role": "assistant", "content": words(rnd, 15)})
    return {
        "tokens": len(exact),
        "render_ms_p50": statistics.median(render),
        "full_encode_ms_p50": statistics.median(full[1:]),
        "cached_encode_ms_p50": statistics.median(cached[1:]),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvshuttle-gw-bench-"))
    if args.keep:
        print(f"logs: {work}", file=sys.stderr)
    # GW_PROFILE=/tmp/gw.prof: the gateway runs under cProfile (written when it stops).
    profile = ["-m", "cProfile", "-o", os.environ["GW_PROFILE"]] if os.environ.get("GW_PROFILE") else []
    model_dir = make_tokenizer(work / "model")
    registry, router, gateway = (free_port() for _ in range(3))
    engines = StandinPair(
        model_dir,
        log_dir=work / "engines",
        served_model_name=MODEL,
        block_size=BLOCK_SIZE,
        prefill_us_per_token=0.0,
        decode_ms_per_token=0.0,
        read_us_per_block=0.0,
    )
    engines.start()
    procs = [
        spawn(
            [str(BIN / "kvshuttle-registry")],
            {"KVSHUTTLE_REGISTRY_SERVER__LISTEN": f"127.0.0.1:{registry}",
             "KVSHUTTLE_REGISTRY_TELEMETRY__LOG_FORMAT": "json"},
            work / "registry.log",
        ),
        spawn(
            [str(BIN / "kvshuttle-router")],
            {"KVSHUTTLE_ROUTER_SERVER__LISTEN": f"127.0.0.1:{router}",
             "KVSHUTTLE_ROUTER_REGISTRY__ADDRESS": f"127.0.0.1:{registry}",
             "KVSHUTTLE_ROUTER_PROFILES_FILE": str(PROFILES),
             "KVSHUTTLE_ROUTER_TURN_SIGNING_KEY": "bench-signing-key-0123456789",
             "KVSHUTTLE_ROUTER_TELEMETRY__LOG_FORMAT": "json"},
            work / "router.log",
        ),
        spawn(
            [sys.executable, *profile, "-m", "kvshuttle.gateway.main"],
            {"KVSHUTTLE_GATEWAY_LISTEN": f"127.0.0.1:{gateway}",
             "KVSHUTTLE_GATEWAY_ROUTER__ADDRESS": f"127.0.0.1:{router}",
             "KVSHUTTLE_GATEWAY_MODELS": json.dumps({MODEL: str(model_dir)}),
             "KVSHUTTLE_GATEWAY_TELEMETRY__LOG_FORMAT": "json"},
            work / "gateway.log",
        ),
    ]  # fmt: skip
    try:
        await register(f"127.0.0.1:{registry}", engines)
        url = f"http://127.0.0.1:{gateway}"
        await wait_http(url + "/health")
        await drive(url, 2, 2, args.stream, args.system_words)  # warm-up
        await asyncio.sleep(0.5)  # its log lines written
        warm = len((work / "gateway.log").read_text().splitlines())
        await drive(url, args.conversations, args.turns, args.stream, args.system_words)
        await asyncio.sleep(0.5)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
        engines.stop()
    lines = [
        json.loads(x) for x in (work / "gateway.log").read_text().splitlines()[warm:] if x.startswith("{")
    ]
    done = [x for x in lines if x.get("event") == "request.done"]
    assert done and all(x["status"] == 200 for x in done), done[:1]
    report: dict[str, Any] = {
        "requests": len(done),
        "stream": args.stream,
        "prompt_tokens_p50": pct([x["prompt_tokens"] for x in done], 0.5),
        "reuse_turns": sum(x["decision"] == "reuse" for x in done),
    }
    keys = (
        "tokenize_ms",
        "wait_ms",
        "plan_ms",
        "prefill_ms",
        "decode_ms",
        "ttft_added_ms",
        "added_ms",
        "total_ms",
    )
    for key in keys:
        values = [x[key] for x in done if key in x]
        if values:
            report[key] = {"p50": round(pct(values, 0.5), 3), "p90": round(pct(values, 0.9), 3)}
    # Commits run after the response (their own log line), off the client's time.
    commits = [x["commit_ms"] for x in lines if x.get("event") == "turn.committed"]
    report["commit_ms_background"] = {"p50": round(pct(commits, 0.5), 3), "p90": round(pct(commits, 0.9), 3)}
    own = [x["added_ms"] - x["plan_ms"] - x.get("wait_ms", 0.0) for x in done]
    report["added_less_router_calls_ms"] = {"p50": round(pct(own, 0.5), 3), "p90": round(pct(own, 0.9), 3)}
    served = [json.loads(x) for x in (work / "router.log").read_text().splitlines() if x.startswith("{")]
    for method in ("PlanTurn", "CommitTurn"):
        calls = [x for x in served if x.get("method") == method and x.get("event") == "rpc.done"]
        report[f"router_{method}_server_side_p50"] = {
            key: round(pct([x[key] for x in calls], 0.5), 3) for key in ("ms", "own_ms", "registry_ms")
        }
    report["tokenization_in_process"] = tokenization_bench(model_dir, args.system_words, args.turns * 2)
    if not args.keep:
        shutil.rmtree(work)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--system-words", type=int, default=3500, help="~tokens of the first prompt")
    ap.add_argument("--keep", action="store_true", help="keep the processes' logs (the path is printed)")
    args = ap.parse_args()
    r = asyncio.run(run(args))
    added, own, ttft = r["added_ms"], r["added_less_router_calls_ms"], r.get("ttft_added_ms")
    print(
        f"{r['requests']} requests ({args.conversations} conversations x {args.turns} turns, "
        f"{'streamed' if args.stream else 'not streamed'}), prompts p50 {r['prompt_tokens_p50']} tokens, "
        f"{r['reuse_turns']} reuse turns"
    )
    print(f"gateway added per request: p50 {added['p50']} ms, p90 {added['p90']} ms")
    print(f"  of which not PlanTurn or the commit wait: p50 {own['p50']} ms, p90 {own['p90']} ms")
    if ttft is not None:
        print(f"  added to TTFT: p50 {ttft['p50']} ms, p90 {ttft['p90']} ms")
    print(f"background CommitTurn: p50 {r['commit_ms_background']['p50']} ms")
    tok = r["tokenization_in_process"]
    print(
        f"tokenizing a {tok['tokens']}-token chat: {tok['full_encode_ms_p50']:.3f} ms from scratch, "
        f"{tok['cached_encode_ms_p50']:.3f} ms with the segment cache (p50)"
    )
    out = save("gateway_added_latency", {"result": r}, args=args)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
