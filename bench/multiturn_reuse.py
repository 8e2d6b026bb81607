"""Tokens recomputed per reuse turn on a workload shaped like vLLM's multi-turn benchmark, real
vLLM (CPU build, `small` model, prefix caching off on prefill), four configurations in one run:

    retokenize+block   the gateway re-tokenizes the whole chat; the router cuts at full blocks
    exact+block        exact-token history (decode's ids for an unchanged answer); full blocks
    retokenize+token   re-tokenized chat; the router cuts at the last verified token
    exact+token        both levers (the defaults)

Workload (benchmarks/multi_turn's shape, scaled to two cores): a common prefix of ~300 tokens, a
per-conversation prefix of ~800, user turns of 120-160 tokens, answers of 60-100 (greedy,
`ignore_eos`), the answer's text sent back as the assistant message; 6 conversations per
configuration, 2 clients, configurations interleaved, `--turns` turns each (fewer than the
benchmark's: a run stays near 10 minutes on this machine).

Per reuse turn: prompt tokens, reused tokens, recomputed = prompt - reused, split into new
tokens (prompt - previous prompt - previous answer), re-tokenization drift (tokens of the
previous prompt + answer before the first id where the new prompt differs) and block rounding
(the rest: what the cut left of the verified prefix); TTFT (streamed, client-observed).

    python -m bench.multiturn_reuse [--turns 4] [--conversations 6]

Prints a table, writes bench/results/multiturn_reuse-<utc time>.json.
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
import urllib.request
from pathlib import Path
from typing import Any

from deploy.local.launch import VllmPair
from deploy.local.processes import free_ports
from deploy.local.services import Service, http_ready
from deploy.local.stack import HOST, KvshuttleStack
from deploy.local.vllm_venv import ensure_model
from tokenizers import Tokenizer

from bench.report import save

PROFILE = Path(__file__).resolve().parents[1] / "deploy" / "profiles" / "cpu-small.toml"
BS = 32
CONFIGS = ("retokenize+block", "exact+block", "retokenize+token", "exact+token")


class Text:
    """Random text of about n tokens (words from the tokenizer's vocabulary)."""

    def __init__(self, tok: Tokenizer, rng: random.Random) -> None:
        self.tok, self.rng = tok, rng
        self.words = [w for w in tok.get_vocab() if w.isalpha() and w.isascii() and 3 <= len(w) <= 8]

    def __call__(self, n: int) -> str:
        words: list[str] = []
        while len(self.tok.encode(" ".join(words), add_special_tokens=False).ids) < n:
            words.extend(self.rng.choice(self.words) for _ in range(max(1, (n - len(words)) // 3)))
        text = " ".join(words)
        ids = self.tok.encode(text, add_special_tokens=False).ids[:n]
        return self.tok.decode(ids).strip()


def stream_chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    start = time.perf_counter()
    ttft, text = None, ""
    out: list[int] = []
    prompt: list[int] = []
    with urllib.request.urlopen(req, timeout=600) as response:
        headers = {k.lower(): v for k, v in response.headers.items()}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            prompt = event.get("prompt_token_ids") or prompt
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                text += piece
                out.extend(choice.get("token_ids") or [])
    return {"ttft_s": ttft, "text": text, "ids": out, "prompt": prompt, "headers": headers}


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def conversation(
    url: str, model: str, name: str, common: str, text: Text, rng: random.Random, turns: int
) -> list[dict[str, Any]]:
    messages = [{"role": "user", "content": f"{common}\n{text(800)}\n{text(rng.randint(120, 160))}"}]
    rows: list[dict[str, Any]] = []
    prev: dict[str, Any] | None = None
    for i in range(turns):
        answer_len = rng.randint(60, 100)
        body = {"model": model, "messages": messages, "conversation_id": name, "max_tokens": answer_len,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
        got = stream_chat(url, body)
        prompt, h = got["prompt"], got["headers"]
        row = {
            "turn": i + 1,
            "prompt": len(prompt),
            "reused": int(h.get("x-kvshuttle-reused-tokens", 0)),
            "decision": h.get("x-kvshuttle-decision"),
            "ttft_ms": round(got["ttft_s"] * 1e3, 1),
        }
        if prev is not None:
            held = prev["prompt"] + prev["ids"]
            row["new"] = len(prompt) - len(held)
            # Where the new prompt stops repeating the previous prompt + answer's ids; the
            # retention covers at most held - 1 (the last sampled token has no KV).
            agree = min(first_diff(prompt, held), len(held) - 1)
            row["drift"] = len(held) - 1 - agree
            row["recomputed"] = len(prompt) - row["reused"]
            # The new tokens plus the retention's missing last token are recomputed anyway.
            row["rounding"] = row["recomputed"] - row["new"] - 1 - row["drift"]
            row["drift_vs_prev_prompt_end"] = first_diff(prompt, held) - len(prev["prompt"])
        rows.append(row)
        prev = {"prompt": prompt, "ids": got["ids"]}
        messages = [*messages, {"role": "assistant", "content": got["text"]},
                    {"role": "user", "content": text(rng.randint(120, 160))}]  # fmt: skip
    return rows


def second_lane(stack: KvshuttleStack, work: Path) -> tuple[Service, Service, str]:
    """A router cutting at the last verified token, and a gateway on it, beside the stack's."""
    router_port, metrics_port, gw_port = free_ports(3)
    router_addr = f"{HOST}:{router_port}"
    router = Service("router-token", "kvshuttle.router.main", stack.router.env | {
        "KVSHUTTLE_ROUTER_SERVER__LISTEN": router_addr,
        "KVSHUTTLE_ROUTER_TELEMETRY__METRICS_LISTEN": f"{HOST}:{metrics_port}",
        "KVSHUTTLE_ROUTER_POLICY__TOKEN_GRANULAR_REUSE": "true"}, work)  # fmt: skip
    gateway = Service("gateway-token", "kvshuttle.gateway.main", stack.gateway.env | {
        "KVSHUTTLE_GATEWAY_LISTEN": f"{HOST}:{gw_port}",
        "KVSHUTTLE_GATEWAY_ROUTER__ADDRESS": router_addr}, work)  # fmt: skip
    router.start()
    gateway.start()
    url = f"http://{HOST}:{gw_port}"
    deadline = time.monotonic() + 60
    while not http_ready(f"{url}/health"):
        router.check()
        gateway.check()
        if time.monotonic() > deadline:
            raise TimeoutError("the second lane did not start")
        time.sleep(0.2)
    return router, gateway, url


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    reuse = [r for r in rows if "new" in r]

    def p50(key: str) -> float:
        return float(statistics.median(r[key] for r in reuse))

    return {
        "reuse_turns": len(reuse),
        **{f"{k}_p50": p50(k) for k in ("prompt", "reused", "recomputed", "new", "drift", "rounding")},
        "recomputed_minus_new_p50": float(statistics.median(r["recomputed"] - r["new"] for r in reuse)),
        "ttft_ms_p50": p50("ttft_ms"),
        "first_turn_ttft_ms_p50": float(statistics.median(r["ttft_ms"] for r in rows if r["turn"] == 1)),
        "within_target": sum(r["recomputed"] <= r["new"] + BS for r in reuse),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--work", default=".run/bench-multiturn")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work / "services", ignore_errors=True)
    model = ensure_model("small")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    rng = random.Random(7)
    text = Text(tok, rng)
    common = text(300)
    profile = tomllib.loads(PROFILE.read_text())["profile"][0]
    models = {
        "m": {"tokenizer": str(model), "history": "retokenize"},
        "m-exact": {"tokenizer": str(model), "served_name": "m", "history": "exact_tokens"},
    }
    pair = VllmPair(model, log_dir=work / "vllm", block_size=BS, prefill_prefix_caching=False)
    block_cut = {"POLICY__TOKEN_GRANULAR_REUSE": "false"}
    extra = {"gateway": {"MODELS": json.dumps(models)}, "router": block_cut}
    jobs: queue.Queue[tuple[str, int]] = queue.Queue()
    for i in range(args.conversations):
        for config in CONFIGS:
            jobs.put((config, i))
    rows: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    started = time.perf_counter()
    with pair, KvshuttleStack(pair, work_dir=work / "services", profile=profile, extra_env=extra) as stack:
        lane = second_lane(stack, work / "services")
        urls = {"block": stack.gateway_url, "token": lane[2]}
        # The same conversation (its texts seeded by its index) in every configuration.
        texts = {(c, i): Text(tok, random.Random(i)) for c in CONFIGS for i in range(args.conversations)}

        def client() -> None:
            while True:
                try:
                    config, i = jobs.get_nowait()
                except queue.Empty:
                    return
                history, cut = config.split("+")
                url = f"{urls[cut]}/v1/chat/completions"
                model_name = "m-exact" if history == "exact" else "m"
                got = conversation(url, model_name, f"c{i}-{config.replace('+', '-')}", common,
                                   texts[(config, i)], random.Random(-i - 1), args.turns)  # fmt: skip
                rows[config].extend(got)
                print(f"{config:>17} conversation {i}: {[r.get('recomputed') for r in got]}", flush=True)

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for service in lane[:2]:
            service.stop()
    results = {c: summary(rows[c]) for c in CONFIGS}
    print(f"\nreuse turns per configuration: {args.conversations} conversations x {args.turns - 1}")
    print(f"{'configuration':>17} {'prompt':>7} {'reused':>7} {'recomp':>7} {'new':>5} {'drift':>6} "
          f"{'round':>6} {'TTFT p50':>9} {'<=new+block':>12}")  # fmt: skip
    for c, s in results.items():
        print(f"{c:>17} {s['prompt_p50']:7.0f} {s['reused_p50']:7.0f} {s['recomputed_p50']:7.0f} "
              f"{s['new_p50']:5.0f} {s['drift_p50']:6.0f} {s['rounding_p50']:6.0f} "
              f"{s['ttft_ms_p50']:7.0f}ms {s['within_target']:>5}/{s['reuse_turns']}")  # fmt: skip
    out = save("multiturn_reuse", {
        "wall_s": round(time.perf_counter() - started, 1),
        "workload": {"common_prefix": 300, "conversation_prefix": 800, "user_turn": [120, 160],
                     "answer": [60, 100], "conversations": args.conversations, "clients": args.clients,
                     "turns": args.turns, "block_size": BS, "prefill_prefix_caching": False,
                     "model": "small"},
        "summary": results, "turns": rows,
        "target": "recomputed per reuse turn <= new tokens + one block (32)"}, args=args)  # fmt: skip
    print(f"saved {out}")


if __name__ == "__main__":
    main()
