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
import random
import shutil
import statistics
import time
import tomllib
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import grpc
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from deploy.local.vllm_venv import ensure_model
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from bench.report import save

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


def _log_events(path: Path, event: str) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in (json.loads(x) for x in lines if x.startswith("{")) if e.get("event") == event]


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def bare_grpc_hop_ms(address: str, samples: int = 60, idle_s: float = 0.05) -> dict[str, float | None]:
    """This machine's floor for one gRPC round trip between two processes: a health check
    against the router (no tracing, no handler work), back to back and after `idle_s` of quiet
    (the idle case is what a turn's PlanTurn meets: the router slept through the last answer)."""
    with grpc.insecure_channel(address) as channel:
        check: grpc.UnaryUnaryMultiCallable[HealthCheckRequest, HealthCheckResponse] = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString,
        )
        check(HealthCheckRequest(), timeout=5)
        warm: list[float] = []
        idle: list[float] = []
        for i in range(2 * samples):
            if i >= samples:
                time.sleep(idle_s)
            t0 = time.perf_counter()
            check(HealthCheckRequest(), timeout=5)
            (warm if i < samples else idle).append((time.perf_counter() - t0) * 1e3)
    return {"back_to_back_ms_p50": _p(warm, 0.5), "after_idle_ms_p50": _p(idle, 0.5), "idle_s": idle_s}


def added_latency(stack: KvshuttleStack, pair: VllmPair, samples: int, rng: random.Random) -> dict[str, Any]:
    """The same P->D request direct and through the gateway (no conversation: plain P->D), in
    alternation; the gateway's own `added_ms` (its time less waiting for P and D) and its parts
    from its log lines, with the router's side of each PlanTurn from the router's."""
    gateway_log, router_log = stack.work_dir / "gateway.log", stack.work_dir / "router.log"
    seen = len(_log_events(gateway_log, "request.done"))
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
    time.sleep(0.5)  # the last lines
    done = _log_events(gateway_log, "request.done")[seen:]
    served = _log_events(router_log, "rpc.done")
    plans = {e.get("request_id"): e for e in served if e.get("method") == "PlanTurn"}
    routed = [plans[d["request_id"]] for d in done if d.get("request_id") in plans]

    def parts(key: str, rows: list[dict[str, Any]]) -> dict[str, float | None]:
        values = [float(r[key]) for r in rows if r.get(key) is not None]
        return {"p50": _p(values, 0.5), "p90": _p(values, 0.9)}

    own = [d["added_ms"] - d["plan_ms"] for d in done if d.get("plan_ms") is not None]
    return {
        "samples": samples,
        "prompt_tokens": 512,
        "direct_ms_p50": round(statistics.median(direct) * 1e3, 2),
        "gateway_ms_p50": round(statistics.median(gateway) * 1e3, 2),
        "wall_difference_ms_p50": round((statistics.median(gateway) - statistics.median(direct)) * 1e3, 2),
        "gateway_added_ms": parts("added_ms", done),
        "gateway_plan_turn_ms": parts("plan_ms", done),
        "gateway_own_ms": {"p50": _p(own, 0.5), "p90": _p(own, 0.9)},
        "router_plan_turn_ms": parts("ms", routed),
        "router_plan_turn_cpu_ms": parts("own_cpu_ms", routed),
        "bare_grpc_hop": bare_grpc_hop_ms(stack.router_addr),
    }


def reuse_turn_overhead(stack: KvshuttleStack) -> dict[str, Any]:
    """What the gateway added to the TTFT of the sweep's streamed reuse turns (ttft less prefill
    less decode's first byte), and its parts, from its log lines: waiting for the previous
    turn's commit (the sweep sends turn 2 the moment turn 1's answer lands), PlanTurn (with its
    claim), and the rest (parsing and forwarding an up to 8k-token prompt twice)."""
    done = _log_events(stack.work_dir / "gateway.log", "request.done")
    rows = [e for e in done if e.get("decision") == "reuse" and e.get("ttft_added_ms") is not None]

    def p50(key: str) -> float | None:
        return _p([float(e.get(key) or 0.0) for e in rows], 0.5)

    return {
        "turns": len(rows),
        "ttft_added_ms_p50": p50("ttft_added_ms"),
        "commit_wait_ms_p50": p50("wait_ms"),
        "plan_turn_ms_p50": p50("plan_ms"),
    }


def run_config(prefix_caching: bool, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    label = "prefix caching ON on prefill" if prefix_caching else "prefix caching OFF on prefill"
    print(f"== {label}", flush=True)
    model = ensure_model("small")
    profile = tomllib.loads(PROFILE.read_text())["profile"][0]
    rng = random.Random(1)
    pair = VllmPair(model, log_dir=work / "vllm", block_size=32, prefill_prefix_caching=prefix_caching)
    services = work / f"services-{int(prefix_caching)}"
    shutil.rmtree(services, ignore_errors=True)  # the figures come from this run's log lines only
    with (
        pair,
        KvshuttleStack(pair, work_dir=services, profile=profile) as stack,
    ):
        rows = ttft_sweep(stack, pair, args.contexts, rng)
        reuse = reuse_turn_overhead(stack)
        added = added_latency(stack, pair, args.samples, rng) if not prefix_caching else None
    return {
        "prefill_prefix_caching": prefix_caching,
        "ttft": rows,
        "reuse_turn_overhead": reuse,
        "added_latency": added,
    }


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
    figures = {
        "contexts": args.contexts,
        "results": results,
        "targets": {"ttft_speedup_at_longest": 3.0, "added_ms_per_turn": 2.0},
    }
    out = save("e2e_vllm", figures, args=args)
    plot(results, out.with_suffix(".png"))
    longest = results[0]["ttft"][-1]
    print(
        f"longest context ({longest['context_tokens']} tokens, P cache off): {longest['speedup']}x lower TTFT"
    )
    added = results[0]["added_latency"]
    hop = added["bare_grpc_hop"]
    print(
        f"added per plain turn: gateway's own time p50 {added['gateway_added_ms']['p50']} ms "
        f"(PlanTurn {added['gateway_plan_turn_ms']['p50']} ms of it, the router's side "
        f"{added['router_plan_turn_ms']['p50']} ms); wall difference p50 {added['wall_difference_ms_p50']} ms"
    )
    print(
        f"this machine's bare gRPC round trip: {hop['back_to_back_ms_p50']} ms back to back, "
        f"{hop['after_idle_ms_p50']} ms after {hop['idle_s'] * 1e3:.0f} ms idle"
    )
    print(f"reuse turns, TTFT added by the gateway: {results[0]['reuse_turn_overhead']}")
    print(f"saved {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
