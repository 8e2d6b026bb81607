"""Tokens reused per turn, by how a client reaches kvshuttle, on real vLLM (CPU build, `small`
model, prefix caching off on prefill): a chat whose history goes back as text every turn, with and
without a conversation id, through one gateway and through two replicas, in one run:

    id                  one gateway, `conversation_id` in the body (the documented way)
    no-id               one gateway, no id at all (the OpenAI SDK without extra_body)
    no-id-2-replicas    no id, turns alternating between two gateway replicas (round robin)
    no-id-retokenize    no id, the model in history mode `retokenize` (no transcripts: what the
                        router finds by the prompt's chain alone)

Workload as bench.multiturn_reuse's (vLLM's multi-turn benchmark shape, scaled to two cores): a
common prefix of ~300 tokens, a per-conversation prefix of ~800, user turns of 120-160 tokens,
answers of 60-100 (greedy, `ignore_eos`); the same conversations (seeded) on every path, paths
interleaved, 2 clients.

Per reuse turn: reused tokens as a share of what the previous turn left retained (its prompt and
answer but the last token, which has no KV), recomputed minus new tokens, TTFT.

    python -m bench.reuse_paths [--turns 4] [--conversations 4] [--pool-mib 0]

With `--pool-mib`, each agent has a DRAM pool of that size: a turn of no conversation forks from
the one it continues and parks its decode-held retention into the pool before reading it there
(kvshuttle.router.fork_reads), where a named conversation's turn reads decode's copy; TTFT shows
what that park costs each turn.

Prints a table, writes bench/results/reuse_paths-<utc time>.json.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import shutil
import statistics
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

from deploy.local.launch import VllmPair
from deploy.local.processes import free_ports
from deploy.local.services import Service, http_ready
from deploy.local.stack import HOST, KvshuttleStack
from deploy.local.vllm_venv import ensure_model
from tokenizers import Tokenizer

from bench.multiturn_reuse import BS, PROFILE, Text, stream_chat
from bench.report import save

PATHS = ("id", "no-id", "no-id-2-replicas", "no-id-retokenize")


def conversation(
    urls: list[str], model: str, name: str | None, common: str, text: Text, rng: random.Random, turns: int
) -> list[dict[str, Any]]:
    """One conversation, turn i on urls[i % len(urls)]; `name` None: no conversation id. `common`
    starts with the path's own word: the same conversation on two paths shares no block (else a
    path without an id would find the other path's retention, a fork, and measure that)."""
    messages = [{"role": "user", "content": f"{common}\n{text(800)}\n{text(rng.randint(120, 160))}"}]
    rows: list[dict[str, Any]] = []
    prev: dict[str, Any] | None = None
    for i in range(turns):
        body = {"model": model, "messages": messages, "max_tokens": rng.randint(60, 100), "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
        if name is not None:
            body["conversation_id"] = name
        got = stream_chat(f"{urls[i % len(urls)]}/v1/chat/completions", body)
        prompt, h = got["prompt"], got["headers"]
        row = {
            "turn": i + 1,
            "prompt": len(prompt),
            "reused": int(h.get("x-kvshuttle-reused-tokens", 0)),
            "decision": h.get("x-kvshuttle-decision"),
            "ttft_ms": round(got["ttft_s"] * 1e3, 1),
        }
        if prev is not None:
            retained = len(prev["prompt"]) + len(prev["ids"]) - 1
            row["retained"] = retained
            row["reused_share"] = round(row["reused"] / retained, 4)
            row["new"] = len(prompt) - retained - 1
            row["recomputed_minus_new"] = len(prompt) - row["reused"] - row["new"]
        rows.append(row)
        prev = {"prompt": prompt, "ids": got["ids"]}
        messages = [*messages, {"role": "assistant", "content": got["text"]},
                    {"role": "user", "content": text(rng.randint(120, 160))}]  # fmt: skip
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    reuse = [r for r in rows if "retained" in r]
    shares = [r["reused_share"] for r in reuse]
    return {
        "reuse_turns": len(reuse),
        "reused_share_p50": float(statistics.median(shares)),
        "reused_share_min": min(shares),
        "turns_at_95pct": sum(s >= 0.95 for s in shares),
        "recomputed_minus_new_p50": float(statistics.median(r["recomputed_minus_new"] for r in reuse)),
        "reused_tokens": sum(r["reused"] for r in reuse),
        "retained_tokens": sum(r["retained"] for r in reuse),
        "ttft_ms_p50": float(statistics.median(r["ttft_ms"] for r in reuse)),
    }


def second_gateway(stack: KvshuttleStack, work: Path) -> tuple[Service, str]:
    """Another replica of the stack's gateway: same router, same cache-salt key, its own port."""
    (port,) = free_ports(1)
    gateway = Service("gateway-b", "kvshuttle.gateway.main", stack.gateway.env | {
        "KVSHUTTLE_GATEWAY_LISTEN": f"{HOST}:{port}"}, work)  # fmt: skip
    gateway.start()
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 60
    while not http_ready(f"{url}/health"):
        gateway.check()
        if time.monotonic() > deadline:
            raise TimeoutError("the second gateway did not start")
        time.sleep(0.2)
    return gateway, url


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--pool-mib", type=int, default=0, help="each agent's DRAM pool (0: none)")
    ap.add_argument("--work", default=".run/bench-reuse-paths")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work / "services", ignore_errors=True)
    model = ensure_model("small")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    common = Text(tok, random.Random(7))(300)
    profile = tomllib.loads(PROFILE.read_text())["profile"][0]
    models = {
        "m": {"tokenizer": str(model), "history": "exact_tokens"},
        "m-retokenize": {"tokenizer": str(model), "served_name": "m", "history": "retokenize"},
    }
    pair = VllmPair(model, log_dir=work / "vllm", block_size=BS, prefill_prefix_caching=False)
    extra = {"gateway": {"MODELS": json.dumps(models)}}
    jobs: queue.Queue[tuple[str, int]] = queue.Queue()
    for i in range(args.conversations):
        for path in PATHS:
            jobs.put((path, i))
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    started = time.perf_counter()
    with (
        pair,
        KvshuttleStack(
            pair,
            work_dir=work / "services",
            profile=profile,
            extra_env=extra,
            pool_bytes=args.pool_mib * 2**20,
        ) as stack,
    ):
        replica, replica_url = second_gateway(stack, work / "services")
        texts = {(p, i): Text(tok, random.Random(i)) for p in PATHS for i in range(args.conversations)}

        def client() -> None:
            while True:
                try:
                    path, i = jobs.get_nowait()
                except queue.Empty:
                    return
                urls = [stack.gateway_url, replica_url] if path == "no-id-2-replicas" else [stack.gateway_url]
                model_name = "m-retokenize" if path == "no-id-retokenize" else "m"
                name = f"c{i}-{path}" if path == "id" else None
                got = conversation(urls, model_name, name, f"{path}: {common}", texts[(path, i)],
                                   random.Random(-i - 1), args.turns)  # fmt: skip
                rows[path].extend(got)
                print(f"{path:>17} conversation {i}: {[r.get('reused_share') for r in got]}", flush=True)

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        replica.stop()
    results = {p: summary(rows[p]) for p in PATHS}
    print(f"\nreuse turns per path: {args.conversations} conversations x {args.turns - 1}")
    header = ("path", "reused/retained p50", "min", ">=95%", "recomp-new p50", "TTFT p50")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (17, 20, 6, 6, 15, 9), strict=True)))
    for p, s in results.items():
        print(f"{p:>17} {s['reused_share_p50']:20.4f} {s['reused_share_min']:6.3f} "
              f"{s['turns_at_95pct']:>3}/{s['reuse_turns']:<2} {s['recomputed_minus_new_p50']:15.0f} "
              f"{s['ttft_ms_p50']:7.0f}ms")  # fmt: skip
    out = save("reuse_paths", {
        "wall_s": round(time.perf_counter() - started, 1),
        "workload": {"common_prefix": 300, "conversation_prefix": 800, "user_turn": [120, 160],
                     "answer": [60, 100], "conversations": args.conversations, "clients": args.clients,
                     "turns": args.turns, "block_size": BS, "prefill_prefix_caching": False,
                     "model": "small", "pool_mib": args.pool_mib},
        "summary": results, "turns": rows,
        "target": "from turn 2: reused >= 95% of the previous prompt + answer (minus block rounding)"},
        args=args)  # fmt: skip
    print(f"saved {out}")


if __name__ == "__main__":
    main()
