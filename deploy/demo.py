"""`make demo`: kvshuttle's whole job on real vLLM, on this machine.

Starts a prefill and a decode vLLM server (CPU build, the `small` model, NixlConnector both
ways, prefix caching off on prefill as in vLLM's published benchmark), then kvshuttle beside
them: registry, router, one agent per engine, the gateway. Runs a scripted agent session through
the gateway's OpenAI chat API with real tool calls (`tools`, a named `tool_choice` per turn,
the call parsed from decode's output; tool results sent back as `tool` messages), growing to
several thousand tokens over ten turns. Every turn runs twice: through kvshuttle (the conversation's
retained KV reused where it verifies) and with reuse disabled (no conversation: plain P->D, the
whole prompt recomputed). Each agent has a DRAM pool and the router prefetches: every turn
that ends in a tool call carries a think-time hint (the gateway's AGENT_THINK_TIME_S), so while
the tool runs the router moves the conversation's KV from decode into the prefill node's agent,
and the next turn's prefill reads it there ("KV from" in the table). Prints a per-turn table,
writes the run's JSON and a PNG of TTFT against context length under .run/demo/, and stops
everything it started, also on Ctrl-C.

The registry keeps its state in memory, or with `--registry-store redis` (or
KVSHUTTLE_DEMO_REGISTRY_STORE=redis; `make demo REGISTRY_STORE=redis`) in a redis-server the demo
starts on loopback beside it (AOF on, data under .run/demo/services/redis; needs the Debian
package `redis-server`).

With `--otlp-endpoint URL` (or KVSHUTTLE_OTLP_ENDPOINT; `make demo OTLP_ENDPOINT=URL`) the
services and both vLLM engines export their spans to that OTLP/gRPC collector: each turn one
trace, the engines' `llm_request` spans included (docs/operations/tracing.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import tomllib
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display here
import matplotlib.pyplot as plt
from tokenizers import Tokenizer

from deploy.local.launch import VllmPair
from deploy.local.otlp import OTLP_ENDPOINT_ENV
from deploy.local.redis import RedisDied, RedisNotInstalled, redis_server_binary
from deploy.local.stack import REGISTRY_STORES, KvshuttleStack
from deploy.local.vllm_engine import EngineDied
from deploy.local.vllm_venv import ensure_model
from kvshuttle.gateway.config import DEFAULT_TENANT

RUN_DIR = Path(".run/demo")
STORE_ENV = "KVSHUTTLE_DEMO_REGISTRY_STORE"
# The small CPU model's costs, measured here (deploy/vllm/README.md); turns recalibrate them.
PROFILE = Path(__file__).parent / "profiles" / "cpu-small.toml"
SYSTEM = (
    "You are a coding agent. You work in a repository through tools: read_file, run_tests, grep. "
    "Think step by step, call one tool at a time, and report what you changed."
)
TOOLS = ["read_file", "run_tests", "grep"]
# Each agent's DRAM pool: room for the session's whole conversation (~100 MiB of KV at 6k tokens).
POOL_BYTES = 1 << 30
# What the demo's stack runs with beyond the defaults: parking and prefetch on, a 2 s think time
# for turns that declare tools (a tool runs before the next turn).
DATA_PLANE = {
    "router": {
        "POLICY__PARKING__ENABLED": "true",
        "POLICY__PARKING__PREFETCH_ENABLED": "true",
        "POLICY__PARKING__TICK_S": "0.2",
    },
    "gateway": {"AGENT_THINK_TIME_S": "2"},
}
WORDS = [
    *("def", "class", "return", "import", "self", "async", "await", "raise", "test", "assert", "cache"),
    *("block", "token", "prefill", "decode", "router", "registry", "lease", "claim", "retention", "node"),
    *("engine", "error", "passed", "failed", "line"),
]


def say(text: str) -> None:
    print(f"\033[1m== {text}\033[0m" if sys.stdout.isatty() else f"== {text}", flush=True)


def tool_result(rng: random.Random, turn: int) -> str:
    """A few hundred tokens of plausible tool output (a file, a test log, grep hits)."""
    words = WORDS
    lines = [
        f"{rng.choice(['src', 'tests', 'lib'])}/module_{turn}_{i}.py:{rng.randrange(1, 400)}: "
        + " ".join(rng.choice(words) for _ in range(rng.randrange(6, 14)))
        for i in range(14)
    ]
    return "\n".join(lines)


def tool_specs() -> list[dict[str, Any]]:
    """The agent's tools, OpenAI-style. Strict with small argument spaces (enums): vLLM then
    holds a call's arguments to the schema, and the demo's random-weight model ends each call
    in a few dozen tokens."""
    files = [f"src/module_{i}.py" for i in range(1, 7)] + ["tests/test_cache.py"]
    params = {
        "read_file": {"path": {"type": "string", "enum": files}},
        "run_tests": {"suite": {"type": "string", "enum": ["unit", "e2e", "all"]}},
        "grep": {"pattern": {"type": "string", "enum": ["block_size", "BLOCK", "evict"]}},
    }
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name.replace('_', ' ')} in the repository",
                "strict": True,
                "parameters": {
                    "type": "object",
                    "properties": props,
                    "required": list(props),
                    "additionalProperties": False,
                },
            },
        }
        for name, props in params.items()
    ]


def no_free_whitespace(model: Path) -> dict[str, float]:
    """logit_bias against whitespace-only tokens: JSON allows whitespace anywhere, and a random
    model left free fills its calls with it. Where the call format needs a space or a newline,
    the constraint still forces it."""
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    blank = [i for i in range(tok.get_vocab_size()) if (t := tok.decode([i])) and not t.strip()]
    return {str(i): -100.0 for i in blank}


def chat(url: str, body: dict[str, Any], conversation: str | None) -> dict[str, Any]:
    """One streamed chat turn through the gateway (with `conversation`: kvshuttle's reuse;
    without: plain P->D, the whole prompt recomputed)."""
    body = {**body, "temperature": 0, "return_token_ids": True, "stream": True}
    if conversation:
        body["conversation_id"] = conversation
    return streamed(f"{url}/v1/chat/completions", body)


def streamed(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """TTFT (the first chunk: decode's first token), the content, the tool calls, prompt and
    output ids and kvshuttle's headers."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    start = time.perf_counter()
    ttft = None
    text: list[str] = []
    ids: list[int] = []
    prompt: list[int] = []
    calls: dict[int, dict[str, Any]] = {}
    try:
        response = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as err:
        raise SystemExit(
            f"demo: the gateway answered {err.code}: {err.read()[:300].decode(errors='replace')}"
        ) from None
    with response:
        headers = {k.lower(): v for k, v in response.headers.items() if k.lower().startswith("x-kvshuttle")}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            prompt = event.get("prompt_token_ids") or prompt
            for choice in event.get("choices", []):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                delta = choice.get("delta", {})
                if delta.get("content"):
                    text.append(delta["content"])
                for tc in delta.get("tool_calls") or ():
                    call = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                    call["id"] = tc.get("id") or call["id"]
                    call["name"] += (tc.get("function") or {}).get("name") or ""
                    call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
                ids.extend(choice.get("token_ids") or [])
    return {
        "ttft_ms": round((ttft or 0.0) * 1e3, 1),
        "text": "".join(text),
        "calls": [calls[i] for i in sorted(calls)],
        "ids": ids,
        "prompt_ids": prompt,
        "headers": headers,
    }


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    ctx = [r["context_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(ctx, [r["ttft_recompute_ms"] / 1e3 for r in rows], "o-", label="reuse disabled (recompute)")
    ax.plot(ctx, [r["ttft_kvshuttle_ms"] / 1e3 for r in rows], "s-", label="kvshuttle (verified reuse)")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Agent session on vLLM CPU (small model), prefill/decode over NIXL")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def run(args: argparse.Namespace) -> int:
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    if args.registry_store == "redis":
        redis_server_binary()  # before a minute of vLLM start-up: RedisNotInstalled says what to install
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    say(f"building the {args.size} model (seconds; cached under .run/models)")
    model = ensure_model(args.size)
    say("starting vLLM prefill (core 0) and decode (core 1) with NixlConnector both ways")
    if args.otlp_endpoint:
        say(f"tracing: services and engines export their spans to {args.otlp_endpoint}")
    pair = VllmPair(
        model,
        log_dir=RUN_DIR / "vllm",
        block_size=32,
        prefill_prefix_caching=False,
        otlp_traces_endpoint=args.otlp_endpoint,
        progress=lambda name, elapsed, step: print(f"  [{elapsed:3.0f} s] {name:<7} {step}", flush=True),
    )
    stack: KvshuttleStack | None = None
    try:
        pair.start()
        say("starting kvshuttle: registry, router, two agents, gateway")
        profile = tomllib.loads(PROFILE.read_text())["profile"][0]
        stack = KvshuttleStack(
            pair,
            work_dir=RUN_DIR / "services",
            profile=profile,
            progress=lambda m: print(f"  {m}", flush=True),
            extra_env=DATA_PLANE,
            pool_bytes=POOL_BYTES,
            registry_store=args.registry_store,
            otlp_endpoint=args.otlp_endpoint,
        )
        stack.start()
        say(f"registry store: {store_description(stack)}")
        rows = session(stack, model, args)
        report(rows, stamp, pair, stack)
    finally:
        say("stopping everything the demo started")
        if stack is not None:
            codes = stack.stop()
            print("  services exited: " + ", ".join(f"{k}={v}" for k, v in codes.items()), flush=True)
        pair.stop()
        print("  vLLM pair stopped", flush=True)
    return 0


def store_description(stack: KvshuttleStack) -> str:
    if stack.redis is None:
        return "memory (one process; --registry-store redis keeps it in Redis)"
    return f"redis, {stack.redis.describe()}"


def kv_holder(stack: KvshuttleStack, conversation: str) -> str:
    """The node holding the conversation's retained KV now ("-": none), e.g. "prefill-pool"."""
    held = stack.retention_holder(f"tenants/{DEFAULT_TENANT}/conversations/{conversation}")
    return held.removeprefix("nodes/") or "-"


def session(stack: KvshuttleStack, model: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    gateway = stack.gateway_url
    rng = random.Random(7)
    conversation = f"demo-{int(time.time())}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": "The cache tests fail after the block-size change. Find out why and fix "
            "it; run the tests when you are done.",
        },
    ]
    tools, bias = tool_specs(), no_free_whitespace(model)
    rows: list[dict[str, Any]] = []
    say(f"agent session: {args.turns} turns through the gateway (conversation {conversation})")
    print(
        f"{'turn':>4} {'context':>8} {'reused':>7}  {'decision':<10} {'KV from':<13} {'tool call':<34} "
        f"{'TTFT kvshuttle':>15} {'TTFT recompute':>15} {'speedup':>8}  same output",
        flush=True,
    )
    for turn in range(1, args.turns + 1):
        # Every turn calls a tool (a named tool_choice: the model is random, so the call is
        # forced), but the last, which answers in words.
        last = turn == args.turns
        name = TOOLS[(turn - 1) % len(TOOLS)]
        body: dict[str, Any] = {
            "model": "m",
            "messages": messages,
            "tools": tools,
            "tool_choice": "none" if last else {"type": "function", "function": {"name": name}},
            "max_tokens": args.max_tokens if last else 64,
            "logit_bias": bias,
        }
        if last:
            body["ignore_eos"] = True
        kv_from = kv_holder(stack, conversation)
        shuttle = chat(gateway, body, conversation)
        plain = chat(gateway, body, None)
        h = shuttle["headers"]
        call = shuttle["calls"][0] if shuttle["calls"] else None
        row = {
            "turn": turn,
            "context_tokens": int(h.get("x-kvshuttle-prompt-tokens", 0)),
            "reused_tokens": int(h.get("x-kvshuttle-reused-tokens", 0)),
            "prefill_cached_tokens": int(h.get("x-kvshuttle-prefill-cached-tokens", 0) or 0),
            "decision": h.get("x-kvshuttle-decision", "?"),
            "reason": h.get("x-kvshuttle-reason", "?"),
            # Where the retention was when the turn planned: decode, or an agent's pool.
            "kv_from": kv_from,
            "tool_call": f"{call['name']}({call['arguments']})" if call else None,
            "ttft_kvshuttle_ms": shuttle["ttft_ms"],
            "ttft_recompute_ms": plain["ttft_ms"],
            # The same prompt ids, the same output ids, the same call: reuse changed nothing.
            "output_identical": shuttle["prompt_ids"] == plain["prompt_ids"]
            and shuttle["ids"] == plain["ids"]
            and [(c["name"], c["arguments"]) for c in shuttle["calls"]]
            == [(c["name"], c["arguments"]) for c in plain["calls"]],
        }
        rows.append(row)
        speedup = row["ttft_recompute_ms"] / max(row["ttft_kvshuttle_ms"], 1e-3)
        shown = (row["tool_call"] or "(answer) " + shuttle["text"][:24].replace("\n", " "))[:34]
        print(
            f"{turn:>4} {row['context_tokens']:>8} {row['reused_tokens']:>7}  {row['decision']:<10} "
            f"{row['kv_from']:<13} "
            f"{shown:<34} {row['ttft_kvshuttle_ms']:>12.0f} ms {row['ttft_recompute_ms']:>12.0f} ms "
            f"{speedup:>7.1f}x  {'yes' if row['output_identical'] else 'NO'}",
            flush=True,
        )
        if call is None:
            break
        messages.append(
            {
                "role": "assistant",
                "content": shuttle["text"] or None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(rng, turn)})
    return rows


def report(rows: list[dict[str, Any]], stamp: str, pair: VllmPair, stack: KvshuttleStack) -> None:
    out_json = RUN_DIR / f"demo-{stamp}.json"
    out_png = RUN_DIR / f"demo-{stamp}.png"
    out_json.write_text(
        json.dumps(
            {
                "time": stamp,
                "registry_store": stack.registry_store,
                "pair": pair.describe(),
                "turns": rows,
                "logs": str(stack.work_dir),
            },
            indent=2,
        )
        + "\n"
    )
    plot(rows, out_png)
    reused = [r for r in rows if r["decision"] == "reuse"]
    last = rows[-1]
    say("summary")
    print(
        f"  {len(reused)} of {len(rows)} turns reused retained KV; outputs identical in "
        f"{sum(r['output_identical'] for r in rows)} of {len(rows)} turns",
        flush=True,
    )
    prefetched = [r for r in reused if r["kv_from"].endswith("-pool")]
    print(
        f"  {len(prefetched)} of the {len(reused)} reused turns read their KV from an agent's pool "
        f"(moved there while the tool ran), {len(reused) - len(prefetched)} from decode",
        flush=True,
    )
    print(
        f"  longest context {last['context_tokens']} tokens: TTFT {last['ttft_kvshuttle_ms']:.0f} ms with "
        f"kvshuttle vs {last['ttft_recompute_ms']:.0f} ms recomputing",
        flush=True,
    )
    print(f"  wrote {out_json} and {out_png}; service logs in {stack.work_dir}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=48, help="answer length per turn")
    ap.add_argument(
        "--registry-store",
        choices=REGISTRY_STORES,
        default=os.environ.get(STORE_ENV) or "memory",
        help=f"where the registry keeps its state (default: ${STORE_ENV}, else memory); "
        "redis starts a local redis-server (Debian package redis-server)",
    )
    ap.add_argument(
        "--otlp-endpoint",
        default=os.environ.get(OTLP_ENDPOINT_ENV) or None,
        help=f"OTLP/gRPC collector for the services' and engines' spans (default: ${OTLP_ENDPOINT_ENV})",
    )
    args = ap.parse_args()
    if args.registry_store not in REGISTRY_STORES:  # argparse checks choices on the command line only
        ap.error(f"${STORE_ENV}={args.registry_store!r}: choose from {', '.join(REGISTRY_STORES)}")

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        sys.exit(run(args))
    except KeyboardInterrupt:
        print("\ninterrupted; everything the demo started has been stopped", flush=True)
        sys.exit(130)
    except EngineDied as exc:  # the message names the engine's log and ends with its tail
        print(f"\nvLLM did not start: {exc}", flush=True)
        sys.exit(1)
    except (RedisNotInstalled, RedisDied) as exc:
        print(f"\n{exc}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
