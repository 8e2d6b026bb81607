"""A fork on real vLLM (CPU build, `small` model, prefix caching off on prefill): one parent turn
over a long context, then its children all at once, each the parent's history and answer plus a
task of its own, sent as a chat client sends them (no conversation id), against the same children
recomputing (each with a cache salt of its own, so nothing is found or read).

Issue 31's fork target is every child reusing the parent's prefix. Each child is found by its
prompt and forks a conversation of its own; the first parks the parent's retention from decode
into its agent's DRAM pool (decode frees its blocks at the first read), and every child reads it
there under a shared claim (kvshuttle.router.fork_reads). `--no-share` runs the router with
`share_forks` off: the first child reads decode's copy and the others recompute (FORK_UNSAFE).

    python -m bench.forks [--children 8] [--parent-tokens 4000] [--no-share]

Prints a table, writes bench/results/forks-<utc time>.json.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import statistics
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from deploy.local.vllm_venv import ensure_model
from tokenizers import Tokenizer

from bench.multiturn_reuse import BS, PROFILE, Text, stream_chat
from bench.report import save

POOL_BYTES = 1 << 30  # each agent's DRAM pool, as deploy/demo.py's


def children(
    url: str,
    parent: list[dict[str, Any]],
    tasks: list[str],
    salt: str | None,
    *,
    max_tokens: int = 32,
    expected: Callable[[list[int], int], list[int]] | None = None,
) -> list[dict[str, Any]]:
    """Every child at once (one thread each); `salt`: each child's own cache salt (recompute);
    `expected`: a clean recompute's answer to a prompt's ids, each child's checked against it.
    One child's failure is a row of its own (`error`), not the end of the run."""
    rows: list[dict[str, Any]] = [{} for _ in tasks]

    def child(i: int) -> None:
        body: dict[str, Any] = {"model": "m", "messages": [*parent, {"role": "user", "content": tasks[i]}],
                                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                "return_token_ids": True, "stream": True}  # fmt: skip
        if salt is not None:
            body["cache_salt"] = f"{salt}-{i}"
        try:
            got = stream_chat(f"{url}/v1/chat/completions", body)
        except Exception as exc:
            rows[i] = {"child": i, "error": f"{type(exc).__name__}: {exc}"}
            return
        h = got["headers"]
        rows[i] = {
            "child": i,
            "prompt": len(got["prompt"]),
            "reused": int(h.get("x-kvshuttle-reused-tokens", 0)),
            "decision": h.get("x-kvshuttle-decision"),
            "reason": h.get("x-kvshuttle-reason"),
            "ttft_ms": None if got["ttft_s"] is None else round(got["ttft_s"] * 1e3, 1),
        }
        if expected is not None:
            rows[i]["answer_ok"] = got["ids"] == expected(got["prompt"], max_tokens)

    threads = [threading.Thread(target=child, args=(i,)) for i in range(len(tasks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def percentile(values: list[float], q: float) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if "error" not in r]
    ttft = [r["ttft_ms"] for r in done if r["ttft_ms"] is not None] or [math.nan]
    return {
        "children": len(rows),
        "errors": len(rows) - len(done),
        "reusing": sum(r["decision"] == "reuse" for r in done),
        "reused_tokens": sum(r["reused"] for r in done),
        "prompt_tokens": sum(r["prompt"] for r in done),
        "wrong_answers": sum(not r["answer_ok"] for r in done if "answer_ok" in r),
        "ttft_ms_p50": float(statistics.median(ttft)),
        "ttft_ms_p90": percentile(ttft, 0.9),
        "ttft_ms_max": max(ttft),
        "reasons": sorted({str(r["reason"]) for r in done}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--children", type=int, default=8)
    ap.add_argument("--parent-tokens", type=int, default=4000)
    ap.add_argument("--no-share", action="store_true", help="the router's share_forks off")
    ap.add_argument("--work", default=".run/bench-forks")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work / "services", ignore_errors=True)
    model = ensure_model("small")
    text = Text(Tokenizer.from_file(str(model / "tokenizer.json")), random.Random(3))
    profile = tomllib.loads(PROFILE.read_text())["profile"][0]
    pair = VllmPair(model, log_dir=work / "vllm", block_size=BS, prefill_prefix_caching=False)
    tasks = [f"Subtask {i}: {text(60)}" for i in range(args.children)]
    started = time.perf_counter()
    env = {"router": {"POLICY__SHARE_FORKS": "false"}} if args.no_share else {}
    with (
        pair,
        KvshuttleStack(
            pair, work_dir=work / "services", profile=profile, pool_bytes=POOL_BYTES, extra_env=env
        ) as stack,
    ):
        parent = [
            {"role": "system", "content": text(args.parent_tokens)},
            {"role": "user", "content": "Plan the work, then hand each part to a subagent."},
        ]
        body = {"model": "m", "messages": parent, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": True}  # fmt: skip
        answer = stream_chat(f"{stack.gateway_url}/v1/chat/completions", body)
        history = [*parent, {"role": "assistant", "content": answer["text"]}]
        forked = children(stack.gateway_url, history, tasks, None)
        recomputed = children(stack.gateway_url, history, tasks, "recompute")
    results = {"fork": summary(forked), "recompute": summary(recomputed)}
    parent_tokens, answer_tokens = len(answer["prompt"]), len(answer["ids"])
    print(f"\n{args.children} children of a {parent_tokens}-token parent (its answer: {answer_tokens})")
    print(f"{'':>10} {'reusing':>8} {'reused':>8} {'TTFT p50':>9} {'TTFT max':>9}  reasons")
    for name, s in results.items():
        share = f"{s['reusing']}/{s['children']}"
        print(f"{name:>10} {share:>8} {s['reused_tokens']:8d} {s['ttft_ms_p50']:7.0f}ms "
              f"{s['ttft_ms_max']:7.0f}ms  {', '.join(s['reasons'])}")  # fmt: skip
    out = save("forks", {
        "wall_s": round(time.perf_counter() - started, 1),
        "workload": {"children": args.children, "parent_prompt_tokens": parent_tokens,
                     "parent_answer_tokens": answer_tokens, "child_task_tokens": 60, "child_answer": 32,
                     "block_size": BS, "prefill_prefix_caching": False, "model": "small",
                     "conversation_id": None, "share_forks": not args.no_share, "pool_bytes": POOL_BYTES},
        "summary": results, "children": {"fork": forked, "recompute": recomputed},
        "target": "every child reuses the parent's prefix (issue 31 item 3)",
        "met": results["fork"]["reusing"] == args.children},
        args=args)  # fmt: skip
    print(f"saved {out}")


if __name__ == "__main__":
    main()
