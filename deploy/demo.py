"""`make demo`: kvshuttle's whole job on real vLLM, on this machine.

Starts a prefill and a decode vLLM server (CPU build, the `small` model, NixlConnector both
ways, prefix caching off on prefill as in vLLM's published benchmark), then kvshuttle beside
them: registry, router, one agent per engine, the gateway. Runs a scripted agent session through
the gateway's OpenAI chat API (system prompt, tool calls and tool results, growing to several
thousand tokens over ten turns). Every turn runs twice: through kvshuttle (the conversation's
retained KV reused where it verifies) and with reuse disabled (no conversation: plain P->D, the
whole prompt recomputed). Prints a per-turn table, writes the run's JSON and a PNG of TTFT
against context length under .run/demo/, and stops everything it started, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
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

from deploy.local.launch import EngineDied, VllmPair, ensure_model
from deploy.local.stack import KvshuttleStack

RUN_DIR = Path(".run/demo")
# The small CPU model's costs, measured here (deploy/vllm/README.md); turns recalibrate them.
PROFILE = Path(__file__).parent / "profiles" / "cpu-small.toml"
SYSTEM = (
    "You are a coding agent. You work in a repository through tools: read_file, run_tests, grep. "
    "Think step by step, call one tool at a time, and report what you changed."
)
TOOLS = ["read_file", "run_tests", "grep"]
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


def chat(
    url: str, messages: list[dict[str, str]], conversation: str | None, max_tokens: int
) -> dict[str, Any]:
    """One streamed chat turn; returns TTFT (first content byte), the text and kvshuttle's headers."""
    body: dict[str, Any] = {
        "model": "m",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    if conversation:
        body["conversation_id"] = conversation
    return streamed(f"{url}/v1/chat/completions", body)


def plain_turn(url: str, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """The same token ids as one plain turn (no conversation: plain P->D, the whole prompt
    recomputed): with exact-token history a conversation's prompt carries decode's generated
    ids, which re-tokenizing its messages would not give back."""
    body = {"model": "m", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
    return streamed(f"{url}/v1/completions", body)


def streamed(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """TTFT (first output byte), the text, prompt and output ids and kvshuttle's headers."""
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
                piece = choice.get("delta", {}).get("content") or choice.get("text")
                prompt = choice.get("prompt_token_ids") or prompt
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(piece)
                ids.extend(choice.get("token_ids") or [])
    return {"ttft_ms": round((ttft or 0.0) * 1e3, 1), "text": "".join(text), "ids": ids,
            "prompt_ids": prompt, "headers": headers}  # fmt: skip


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
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    say(f"building the {args.size} model (seconds; cached under .run/models)")
    model = ensure_model(args.size)
    say("starting vLLM prefill (core 0) and decode (core 1) with NixlConnector both ways")
    pair = VllmPair(
        model,
        log_dir=RUN_DIR / "vllm",
        block_size=32,
        prefill_prefix_caching=False,
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
        )
        stack.start()
        rows = session(stack.gateway_url, args)
        report(rows, stamp, pair, stack)
    finally:
        say("stopping everything the demo started")
        if stack is not None:
            codes = stack.stop()
            print("  services exited: " + ", ".join(f"{k}={v}" for k, v in codes.items()), flush=True)
        pair.stop()
        print("  vLLM pair stopped", flush=True)
    return 0


def session(gateway: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(7)
    conversation = f"demo-{int(time.time())}"
    messages = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": "The cache tests fail after the block-size change. Find out why and fix "
            "it; run the tests when you are done.",
        },
    ]
    rows: list[dict[str, Any]] = []
    say(f"agent session: {args.turns} turns through the gateway (conversation {conversation})")
    print(
        f"{'turn':>4} {'context':>8} {'reused':>7}  {'decision':<10} {'reason':<16} "
        f"{'TTFT kvshuttle':>15} {'TTFT recompute':>15} {'speedup':>8}  same output",
        flush=True,
    )
    for turn in range(1, args.turns + 1):
        shuttle = chat(gateway, messages, conversation, args.max_tokens)
        plain = plain_turn(gateway, shuttle["prompt_ids"], args.max_tokens)
        h = shuttle["headers"]
        row = {
            "turn": turn,
            "context_tokens": int(h.get("x-kvshuttle-prompt-tokens", 0)),
            "reused_tokens": int(h.get("x-kvshuttle-reused-tokens", 0)),
            "prefill_cached_tokens": int(h.get("x-kvshuttle-prefill-cached-tokens", 0) or 0),
            "decision": h.get("x-kvshuttle-decision", "?"),
            "reason": h.get("x-kvshuttle-reason", "?"),
            "ttft_kvshuttle_ms": shuttle["ttft_ms"],
            "ttft_recompute_ms": plain["ttft_ms"],
            "output_identical": shuttle["ids"] == plain["ids"] and shuttle["text"] == plain["text"],
        }
        rows.append(row)
        speedup = row["ttft_recompute_ms"] / max(row["ttft_kvshuttle_ms"], 1e-3)
        print(
            f"{turn:>4} {row['context_tokens']:>8} {row['reused_tokens']:>7}  {row['decision']:<10} "
            f"{row['reason']:<16} {row['ttft_kvshuttle_ms']:>12.0f} ms {row['ttft_recompute_ms']:>12.0f} ms "
            f"{speedup:>7.1f}x  {'yes' if row['output_identical'] else 'NO'}",
            flush=True,
        )
        tool = TOOLS[turn % len(TOOLS)]
        messages.append(
            {
                "role": "assistant",
                "content": shuttle["text"] + f'\n<tool_call>{{"name": "{tool}", "arguments": '
                f'{{"path": "src/module_{turn}.py"}}}}</tool_call>',
            }
        )
        messages.append({"role": "tool", "content": tool_result(rng, turn)})
    return rows


def report(rows: list[dict[str, Any]], stamp: str, pair: VllmPair, stack: KvshuttleStack) -> None:
    out_json = RUN_DIR / f"demo-{stamp}.json"
    out_png = RUN_DIR / f"demo-{stamp}.png"
    out_json.write_text(
        json.dumps(
            {"time": stamp, "pair": pair.describe(), "turns": rows, "logs": str(stack.work_dir)}, indent=2
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
    args = ap.parse_args()

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


if __name__ == "__main__":
    main()
