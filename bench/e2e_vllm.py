"""End-to-end benchmark on real vLLM (CPU build, `small` model): TTFT of a conversation's next
turn with kvshuttle reusing decode's retained KV against recomputing it, from 1k to 8k tokens of
context, with prefix caching off on prefill (as vLLM's published benchmark) and on; and
kvshuttle's added latency per turn against calling prefill and decode directly.

    python -m bench.e2e_vllm [--contexts 1024,2048,4096,6144,7936] [--samples 20]

Prints a table, writes bench/results/e2e_vllm-<utc time>.json and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
import tomllib
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from deploy.local.launch import VllmPair, ensure_model
from deploy.local.stack import KvshuttleStack

RESULTS = Path(__file__).parent / "results"
PROFILE = Path(__file__).resolve().parents[1] / "deploy" / "profiles" / "cpu-small.toml"
NEW_TOKENS = 256  # the next user message
OUTPUT = 256  # turn 1's answer (an agent's reply or tool call)


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(10, 8000) for _ in range(n)]


def request(
    url: str, body: dict[str, Any], timeout: float = 600
) -> tuple[float, dict[str, Any], dict[str, str]]:
    """POST, streaming when asked: (TTFT or wall seconds, final JSON or {}, headers)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as response:
        headers = {k.lower(): v for k, v in response.headers.items()}
        if not body.get("stream"):
            return time.perf_counter() - start, json.loads(response.read()), headers
        first = None
        out: list[int] = []
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                if choice.get("token_ids") or choice.get("text"):
                    first = first if first is not None else time.perf_counter() - start
                    out.extend(choice.get("token_ids") or [])
        return first or 0.0, {"token_ids": out}, headers


def completion(prompt: list[int], conversation: str | None, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": OUTPUT,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if conversation:
        body["conversation_id"] = conversation
    return body


def next_turn(
    gateway: str, context: int, conversation: str | None, rng: random.Random
) -> tuple[list[int], Any]:
    """Turn 1 (a prompt and a 256-token answer), then turn 2's prompt: history + a new message.
    Returns turn 2's prompt and (TTFT seconds, answer, headers) of turn 2, streamed."""
    first = tokens(context - NEW_TOKENS - OUTPUT, rng)
    _, answer, _ = request(gateway, completion(first, conversation, stream=False))
    prompt = first + answer["choices"][0]["token_ids"] + tokens(NEW_TOKENS, rng)
    return prompt, request(gateway, completion(prompt, conversation))


def ttft_sweep(
    stack: KvshuttleStack, pair: VllmPair, contexts: list[int], rng: random.Random
) -> list[dict[str, Any]]:
    """Per context, two conversations of the same shape: one through kvshuttle (turn 2 reuses
    decode's KV), one with reuse disabled (no conversation: plain P->D). Each runs its own turn 1
    first, so prefill's prefix cache (when on) holds the same kind of history in both."""
    rows = []
    gateway = f"{stack.gateway_url}/v1/completions"
    for context in contexts:
        prompt, (reuse_s, reuse_out, headers) = next_turn(
            gateway, context, f"bench-{uuid.uuid4().hex[:8]}", rng
        )
        _, (recompute_s, _, _) = next_turn(gateway, context, None, rng)
        # The reuse turn's answer against the same prompt computed from scratch on one server.
        _, ref, _ = request(
            f"{pair.decode.url}/v1/completions",
            completion(prompt, None, stream=False) | {"cache_salt": uuid.uuid4().hex},
        )
        rows.append(
            {
                "context_tokens": len(prompt),
                "reused_tokens": int(headers.get("x-kvshuttle-reused-tokens", 0)),
                "decision": headers.get("x-kvshuttle-decision"),
                "reason": headers.get("x-kvshuttle-reason"),
                "ttft_reuse_ms": round(reuse_s * 1e3, 1),
                "ttft_recompute_ms": round(recompute_s * 1e3, 1),
                "speedup": round(recompute_s / max(reuse_s, 1e-6), 2),
                "output_identical": reuse_out["token_ids"] == ref["choices"][0]["token_ids"],
            }
        )
        r = rows[-1]
        print(
            f"  {r['context_tokens']:>6} tokens: reuse {r['ttft_reuse_ms']:>8.0f} ms "
            f"({r['reused_tokens']} reused, {r['reason']})  recompute {r['ttft_recompute_ms']:>8.0f} ms  "
            f"{r['speedup']:>5.1f}x  same output as a from-scratch run: {r['output_identical']}",
            flush=True,
        )
    return rows


def added_latency(stack: KvshuttleStack, pair: VllmPair, samples: int, rng: random.Random) -> dict[str, Any]:
    """The same P->D request direct and through the gateway (no conversation: plain P->D), in
    alternation; and the gateway's own `added_ms` (its time minus waiting for P and D, the
    router's PlanTurn and CommitTurn included) from its log lines."""
    direct, gateway = [], []
    for _ in range(samples):
        prompt = tokens(512, rng)
        t0 = time.perf_counter()
        _, p_answer, _ = request(
            f"{pair.prefill.url}/v1/completions",
            {
                "model": "m",
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
            },
        )
        request(
            f"{pair.decode.url}/v1/completions",
            {
                "model": "m",
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "kv_transfer_params": p_answer["kv_transfer_params"],
            },
        )
        direct.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        request(
            f"{stack.gateway_url}/v1/completions", completion(prompt, None, stream=False) | {"max_tokens": 8}
        )
        gateway.append(time.perf_counter() - t0)
    logged = []
    for line in (stack.work_dir / "gateway.log").read_text().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "request.done" and "added_ms" in event:
                logged.append(float(event["added_ms"]))
    return {
        "samples": samples,
        "prompt_tokens": 512,
        "direct_ms_p50": round(statistics.median(direct) * 1e3, 2),
        "gateway_ms_p50": round(statistics.median(gateway) * 1e3, 2),
        "wall_difference_ms_p50": round((statistics.median(gateway) - statistics.median(direct)) * 1e3, 2),
        "gateway_added_ms_p50": round(statistics.median(logged), 2) if logged else None,
        "gateway_added_ms_p90": round(sorted(logged)[int(len(logged) * 0.9)], 2) if logged else None,
    }


def run_config(prefix_caching: bool, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    label = "prefix caching ON on prefill" if prefix_caching else "prefix caching OFF on prefill"
    print(f"== {label}", flush=True)
    model = ensure_model("small")
    profile = tomllib.loads(PROFILE.read_text())["profile"][0]
    rng = random.Random(1)
    pair = VllmPair(model, log_dir=work / "vllm", block_size=32, prefill_prefix_caching=prefix_caching)
    with (
        pair,
        KvshuttleStack(pair, work_dir=work / f"services-{int(prefix_caching)}", profile=profile) as stack,
    ):
        rows = ttft_sweep(stack, pair, args.contexts, rng)
        added = added_latency(stack, pair, args.samples, rng) if not prefix_caching else None
    return {"prefill_prefix_caching": prefix_caching, "ttft": rows, "added_latency": added}


def plot(results: list[dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for res in results:
        tag = "P cache on" if res["prefill_prefix_caching"] else "P cache off"
        ctx = [r["context_tokens"] for r in res["ttft"]]
        ax.plot(ctx, [r["ttft_recompute_ms"] / 1e3 for r in res["ttft"]], "o--", label=f"recompute ({tag})")
        ax.plot(ctx, [r["ttft_reuse_ms"] / 1e3 for r in res["ttft"]], "s-", label=f"kvshuttle reuse ({tag})")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("TTFT of the next turn (s)")
    ax.set_title("vLLM CPU (small model), P/D over NIXL: reuse vs recompute")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,2048,4096,6144,7936")
    ap.add_argument("--samples", type=int, default=20, help="requests for the added-latency figure")
    ap.add_argument("--work", default=".run/bench-e2e")
    args = ap.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    work = Path(args.work)
    results = [run_config(False, args, work), run_config(True, args, work)]
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"e2e_vllm-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "bench": "e2e_vllm",
                "time": stamp,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "contexts": args.contexts,
                "results": results,
                "targets": {"ttft_speedup_at_longest": 3.0, "added_ms_per_turn": 2.0},
            },
            indent=2,
        )
        + "\n"
    )
    plot(results, out.with_suffix(".png"))
    longest = results[0]["ttft"][-1]
    print(
        f"longest context ({longest['context_tokens']} tokens, P cache off): {longest['speedup']}x lower TTFT"
    )
    print(f"added latency: {results[0]['added_latency']}")
    print(f"saved {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
