"""A fork at scale on stand-in engines (bench/emulator/http: profile-timed, no model) under
kvshuttle's real services, each agent with a DRAM pool (bench.emulator.http.agent): one parent turn
over a long context, then its children all at once, each the parent's history and answer plus a
task of its own, sent as a chat client sends them (no conversation id), against the same children
recomputing (each with a cache salt of its own, so nothing is found or read).

bench/forks.py's measurement at the scale real vLLM on two cores cannot reach: 32 children of a
40,000-token parent by default, the engines timed as the profile's GPU (default: Llama 3.1 8B on
one H100; its pool, block size, chunked prefill and link). Issue 31's fork target is every child
reusing the parent's prefix: each child is found by its prompt and forks a conversation of its
own; the first parks the parent's retention from decode into decode's agent pool, and every child
reads it there under a shared claim (kvshuttle.router.fork_reads). Each child's answer is checked
against a clean recompute's (`StandinPair.expected`): a read of the wrong blocks answers otherwise.

    python -m bench.forks_standin [--children 32] [--parent-tokens 40000] \
        [--profile deploy/profiles/llama-3.1-8b-h100-tp1.toml] [--time-scale 1.0] [--pool-gib 64] \
        [--work .run/bench-forks-standin]

Prints a table, writes bench/results/forks-standin-<utc time>.json. TTFT is client-observed
through the gateway, in real milliseconds (profile milliseconds at `--time-scale 1`): the modelled
GPU and link time plus the CPU every process takes on this machine (the control plane's, and the
stand-ins' own hashing and JSON of 40k-token prompts), which on two cores moves the fork arm's
p50 by a second or so between runs. The agents' pools are bookkeeping on stand-ins (no bytes are
allocated), so `--pool-gib` is the DRAM the pools model, not memory this machine needs.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from deploy.local.stack import KvshuttleStack
from tokenizers import Tokenizer

from bench.cluster.engines import router_profile
from bench.emulator.http.config import engine_profile
from bench.emulator.http.launcher import StandinPair
from bench.emulator.http.tokenizer import make_tokenizer
from bench.forks import children, summary
from bench.multiturn_reuse import Text, stream_chat
from bench.report import ROOT, save

DEFAULT_PROFILE = ROOT / "deploy" / "profiles" / "llama-3.1-8b-h100-tp1.toml"
TASK_TOKENS, PARENT_ANSWER, CHILD_ANSWER = 60, 64, 32


def stats(pair: StandinPair) -> dict[str, dict[str, int]]:
    """Each engine's counters now (`standin_*`: reads, failed loads, dropped holdings, ...)."""
    return {e.name: e.get_json("/standin/timings")["stats"] for e in pair.engines}


def delta(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The counters' growth from `a` to `b` (gauges, as `holdings`, at `b`)."""
    return {
        name: {k: v if k == "holdings" else v - a[name].get(k, 0) for k, v in now.items()}
        for name, now in b.items()
    }


def log_digest(gateway: Path, router: Path) -> dict[str, Any]:
    """The gateway's turns (decision / reason counts; median plan, prefill and TTFT ms by
    decision) and the router's moves (kind / reason / outcome counts)."""

    def entries(path: Path) -> list[dict[str, Any]]:
        got = []
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            try:
                got.append(json.loads(line))
            except ValueError:
                continue
        return got

    turns: Counter[str] = Counter()
    parts: dict[str, dict[str, list[float]]] = {}
    for e in entries(gateway):
        if e.get("event") == "request.done":
            turns[f"{e.get('decision')}/{e.get('reason')}"] += 1
            by = parts.setdefault(str(e.get("decision")), {})
            for key in ("tokenize_ms", "plan_ms", "prefill_ms", "ttft_ms"):
                if isinstance(e.get(key), (int, float)):
                    by.setdefault(key, []).append(float(e[key]))
    moves = Counter(
        f"{e.get('kind')}/{e.get('reason')}/{e.get('outcome')}"
        for e in entries(router)
        if e.get("event") == "shuttle.move"
    )
    medians = {d: {k: round(statistics.median(v), 1) for k, v in by.items()} for d, by in parts.items()}
    fork_parks = [
        {k: e.get(k) for k in ("outcome", "kv_bytes", "seconds", "idle_s", "pool")}
        for e in entries(router)
        if e.get("event") == "shuttle.move" and e.get("reason") == "fork"
    ]
    return {"turns": dict(turns), "median_ms_by_decision": medians, "moves": dict(moves),
            "fork_parks": fork_parks}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The stack up on the stand-ins, the parent, then both arms; the figures to save."""
    work = Path(args.work)
    for sub in ("services", "engines"):
        shutil.rmtree(work / sub, ignore_errors=True)
    model_dir = make_tokenizer(work / "model")
    profile = engine_profile(args.profile)
    pool_bytes = int(args.pool_gib * 2**30)
    text = Text(Tokenizer.from_file(str(model_dir / "tokenizer.json")), random.Random(3))
    text.words.sort()  # the tokenizer's vocabulary comes in no fixed order: the same text every run
    pair = StandinPair(
        model_dir,
        log_dir=work / "engines",
        max_model_len=args.parent_tokens + 4096,
        prefill_prefix_caching=False,  # every reuse reads its KV over the side channel
        profile=args.profile,  # the profile's block size, KV capacity (blocks) and timing
        time_scale=args.time_scale,
    )
    stack = KvshuttleStack(
        pair,
        work_dir=work / "services",
        profile=router_profile(profile, args.time_scale, model="m"),
        block_size=profile.engine.block_size,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        pool_bytes=pool_bytes,
        pool_regions=1,
        agent_module="bench.emulator.http.agent",
    )
    tasks = [f"Subtask {i}: {text(TASK_TOKENS)}" for i in range(args.children)]
    parent = [
        {"role": "system", "content": text(args.parent_tokens)},
        {"role": "user", "content": "Plan the work, then hand each part to a subagent."},
    ]
    rows: dict[str, list[dict[str, Any]]] = {}
    walls: dict[str, float] = {}
    counters = []
    started = time.perf_counter()
    with pair:
        stack.start()
        try:
            body = {"model": "m", "messages": parent, "max_tokens": PARENT_ANSWER, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
            answer = stream_chat(f"{stack.gateway_url}/v1/chat/completions", body)
            history = [*parent, {"role": "assistant", "content": answer["text"]}]
            counters.append(stats(pair))
            for arm, salt in (("fork", None), ("recompute", "recompute")):
                t0 = time.perf_counter()
                rows[arm] = children(stack.gateway_url, history, tasks, salt, max_tokens=CHILD_ANSWER,
                                     expected=pair.expected)  # fmt: skip
                walls[arm] = round(time.perf_counter() - t0, 2)
                counters.append(stats(pair))
        finally:
            codes = stack.stop()
    results = {arm: {**summary(got), "wall_s": walls[arm]} for arm, got in rows.items()}
    engines = {arm: delta(counters[i], counters[i + 1]) for i, arm in enumerate(rows)}
    gb_s = profile.link.bandwidth_gb_s / args.time_scale
    for arm, by_engine in engines.items():
        # The KV each engine read in the arm, and the time its link takes for it alone (the
        # reads one engine makes share its link: a floor under the arm's last TTFT).
        for name, got in by_engine.items():
            read = got["kv_blocks_read_total"] * profile.engine.block_size * profile.kv_bytes_per_token
            results[arm][f"{name}_kv_read_gb"] = round(read / 1e9, 2)
            results[arm][f"{name}_link_s"] = round(read / 1e9 / gb_s, 2)
    where = args.profile.relative_to(ROOT) if args.profile.is_relative_to(ROOT) else args.profile
    return {
        "wall_s": round(time.perf_counter() - started, 1),
        "workload": {"children": args.children, "parent_prompt_tokens": len(answer["prompt"]),
                     "parent_answer_tokens": len(answer["ids"]),
                     "parent_ttft_ms": round(answer["ttft_s"] * 1e3, 1),
                     "child_task_tokens": TASK_TOKENS, "child_answer": CHILD_ANSWER,
                     "conversation_id": None, "share_forks": True},
        "standins": {"profile": str(where), "time_scale": args.time_scale,
                     "block_size": profile.engine.block_size,
                     "num_blocks": profile.engine.kv_capacity_blocks,
                     "kv_bytes_per_token": profile.kv_bytes_per_token,
                     "max_num_batched_tokens": profile.engine.max_num_batched_tokens,
                     "prefill_prefix_caching": False, "pool_bytes": pool_bytes,
                     "pool_note": "a stand-in pool's slots are bookkeeping: no bytes allocated"},
        "summary": results, "children": rows,
        "engines": engines,
        "logs": log_digest(stack.gateway.log_path, stack.router.log_path),
        "exit_codes": codes,
        "target": "every child reuses the parent's prefix (issue 31 item 3), each answer a clean "
                  "recompute's",
        "met": results["fork"]["reusing"] == args.children and results["fork"]["wrong_answers"] == 0,
    }  # fmt: skip


def table(args: argparse.Namespace, figures: dict[str, Any]) -> str:
    w = figures["workload"]
    lines = [
        f"{args.children} children of a {w['parent_prompt_tokens']}-token parent (its answer: "
        f"{w['parent_answer_tokens']}, TTFT {w['parent_ttft_ms']:.0f} ms); stand-ins: "
        f"{args.profile.name}, time scale {args.time_scale}",
        f"{'':>10} {'reusing':>8} {'reused':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'TTFT max':>9} "
        f"{'wall':>7} {'wrong':>5}  reasons",
    ]
    for name, s in figures["summary"].items():
        share = f"{s['reusing']}/{s['children']}"
        lines.append(
            f"{name:>10} {share:>8} {s['reused_tokens']:9d} {s['ttft_ms_p50']:7.0f}ms "
            f"{s['ttft_ms_p90']:7.0f}ms {s['ttft_ms_max']:7.0f}ms {s['wall_s']:6.1f}s "
            f"{s['wrong_answers']:5d}  {', '.join(s['reasons'])}"
        )
    for name, s in figures["summary"].items():
        lines.append(
            f"{name}: KV read by prefill {s['prefill_kv_read_gb']} GB (its link alone: "
            f"{s['prefill_link_s']} s), by decode {s['decode_kv_read_gb']} GB ({s['decode_link_s']} s)"
        )
    lines.append(f"target: {figures['target']}: {'met' if figures['met'] else 'NOT met'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--children", type=int, default=32)
    ap.add_argument("--parent-tokens", type=int, default=40_000)
    ap.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, help="the engines' (deploy/profiles)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="the engines' times x this")
    pool_help = "each agent's DRAM pool (a stand-in pool's slots are bookkeeping: no bytes allocated)"
    ap.add_argument("--pool-gib", type=float, default=64.0, help=pool_help)
    ap.add_argument("--work", default=".run/bench-forks-standin")
    args = ap.parse_args()
    figures = run(args)
    print("\n" + table(args, figures))
    print(f"saved {save('forks-standin', figures, args=args)}")


if __name__ == "__main__":
    main()
