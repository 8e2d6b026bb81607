"""A multi-turn chat workload on real vLLM (CPU build, `small` model, one prefill + one decode
engine) through two lanes side by side in one run, interleaved on the same machine:

    kvshuttle   kvshuttle's services with the router's shipped defaults on the pair `make demo`
                runs (block size 32, prefix caching off on prefill, 1 GiB agent pools, the
                cpu-small profile), chats to the gateway with a `conversation_id`
    proxy       the seed's toy proxy (vLLM's toy_proxy_server, bidirectional KV transfer): the
                chat to prefill (`max_tokens` 1, decode's params kept from the conversation's
                previous turn, single use, 450 s TTL, or do_remote_decode), then to decode
                (streamed) with prefill's params; decode's final params kept. No prefix check.

Workload: a ~800-token system message shared by every conversation, a first user message and
user turns of 120-160 tokens, answers of 60-100 (greedy, `ignore_eos`), the answer's text sent
back as the assistant message; `--conversations` x `--turns` per lane, `--clients` threads taking
(lane, conversation) jobs alternately. Every answer is checked against a clean recompute of the
same prompt ids on decode (a fresh cache salt); `wrong` counts the later turns (those that can
read KV) that differ, `first_differ` the first turns that do: they read nothing in either lane, so
a first turn that differs is the CPU build's own numerical noise (a batch computed another way),
the floor under `wrong`. TTFT: the first streamed content token (proxy: from sending the
prefill request).

    python -m bench.chat_vs_proxy [--turns 6] [--conversations 6] [--clients 2]
                                  [--router-env POLICY__EXTEND__ENABLED=true ...]

Prints a table, writes bench/results/chat_vs_proxy-<utc time>.json.
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
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from deploy.local.vllm_venv import ensure_model
from tokenizers import Tokenizer

from bench.cluster.policies import PROXY_TTL_S
from bench.conformance import GATEWAY_TIMINGS, _complete
from bench.multiturn_reuse import Text, stream_chat
from bench.report import save

PROFILE = Path(__file__).resolve().parents[1] / "deploy" / "profiles" / "cpu-small.toml"
LANES = ("kvshuttle", "proxy")
START = {"do_remote_decode": True, "do_remote_prefill": False}  # a first prefill
POOL_BYTES = 1 << 30  # deploy/demo.py's agent pools
Send = Callable[[dict[str, Any], str | None], dict[str, Any]]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=600) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def stream_decode(url: str, body: dict[str, Any], t0: float) -> dict[str, Any]:
    """stream_chat's answer plus the `kv_transfer_params` of decode's finish chunk; TTFT from t0."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    got: dict[str, Any] = {"ttft_s": None, "text": "", "ids": [], "prompt": [], "params": None}
    with urllib.request.urlopen(req, timeout=600) as response:
        got["decode_start_s"] = time.perf_counter() - t0
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            got["prompt"] = event.get("prompt_token_ids") or got["prompt"]
            got["params"] = event.get("kv_transfer_params") or got["params"]
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and got["ttft_s"] is None:
                    got["ttft_s"] = time.perf_counter() - t0
                got["text"] += piece
                got["ids"].extend(choice.get("token_ids") or [])
    return got


class ToyProxy:
    """vLLM's toy proxy for bidirectional KV transfer, straight to the engines."""

    def __init__(self, pair: VllmPair) -> None:
        self.pair = pair
        self.kept: dict[str, tuple[dict[str, Any], float]] = {}

    def __call__(self, body: dict[str, Any], conversation: str | None) -> dict[str, Any]:
        kept = self.kept.pop(conversation, None) if conversation else None  # single use
        params = kept[0] if kept is not None and kept[1] > time.monotonic() else None
        t0 = time.perf_counter()
        to_prefill = {"max_tokens": 1, "stream": False, "kv_transfer_params": params or START}
        p = post(f"{self.pair.prefill.url}/v1/chat/completions", body | to_prefill)
        prefill_s = time.perf_counter() - t0
        to_decode = {"stream": True, "kv_transfer_params": p["kv_transfer_params"]}
        got = stream_decode(f"{self.pair.decode.url}/v1/chat/completions", body | to_decode, t0)
        if conversation and got["params"] is not None:
            self.kept[conversation] = (got["params"], time.monotonic() + PROXY_TTL_S)
        got["headers"] = {"x-kvshuttle-decision": "read" if params else "recompute"}
        got["prefill_ms"] = round(prefill_s * 1e3, 1)
        got["found"] = ((p.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        return got


def chat_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip


def conversation(
    send: Send, name: str, system: str, text: Text, rng: random.Random, turns: int
) -> list[dict[str, Any]]:
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": text(rng.randint(120, 160))},
    ]
    rows: list[dict[str, Any]] = []
    for i in range(turns):
        got = send(chat_body(messages, rng.randint(60, 100)), name)
        rows.append({
            "conversation": name, "turn": i + 1, "prompt_tokens": len(got["prompt"]),
            "decision": got["headers"].get("x-kvshuttle-decision"),
            "reused": got["headers"].get("x-kvshuttle-reused-tokens", got.get("found")),
            "ttft_ms": round(got["ttft_s"] * 1e3, 1), "prefill_ms": got.get("prefill_ms"),
            "decode_start_ms": round(got["decode_start_s"] * 1e3, 1) if "decode_start_s" in got else None,
            "prompt": got["prompt"], "answer": got["ids"]})  # fmt: skip
        messages = [*messages, {"role": "assistant", "content": got["text"]},
                    {"role": "user", "content": text(rng.randint(120, 160))}]  # fmt: skip
    return rows


def recompute(pair: VllmPair, row: dict[str, Any]) -> bool:
    """The answer equals a clean recompute of the same prompt ids on decode (fresh cache salt)."""
    body = {"model": "m", "prompt": row["prompt"], "max_tokens": len(row["answer"]), "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "cache_salt": uuid.uuid4().hex}  # fmt: skip
    ids: list[int] = _complete(pair.decode.url, body)["choices"][0]["token_ids"]
    return bool(ids == row["answer"])


def pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 1)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r["ttft_ms"] for r in rows if r["turn"] > 1]
    first = [r["ttft_ms"] for r in rows if r["turn"] == 1]
    decisions: dict[str, int] = {}
    for r in rows:
        decisions[str(r["decision"])] = decisions.get(str(r["decision"]), 0) + 1
    out = {"turns": len(rows), "later_turns": len(later),
           "wrong": sum(not r["ok"] for r in rows if r["turn"] > 1),
           "first_differ": sum(not r["ok"] for r in rows if r["turn"] == 1),
           "later_ttft_ms_p50": pct(later, 50), "later_ttft_ms_p90": pct(later, 90),
           "first_ttft_ms_p50": pct(first, 50), "first_ttft_ms_p90": pct(first, 90),
           "decisions": decisions}  # fmt: skip
    if rows and rows[0]["prefill_ms"] is not None:
        out["later_prefill_ms_p50"] = pct([r["prefill_ms"] for r in rows if r["turn"] > 1], 50)
    return out


def gateway_timings(log: Path) -> dict[str, dict[str, Any]]:
    """The gateway's own per-stage timings (request.done lines of conversations), p50 per decision."""
    done = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    done = [d for d in done if d.get("event") == "request.done" and d.get("conversation")]
    out: dict[str, dict[str, Any]] = {}
    for decision in sorted({str(d.get("decision")) for d in done}):
        of = [d for d in done if str(d.get("decision")) == decision]
        out[decision] = {"n": len(of)} | {
            k: pct([float(d[k]) for d in of if d.get(k) is not None], 50) for k in GATEWAY_TIMINGS
        }
    return out


def table(results: dict[str, dict[str, Any]], gateway: dict[str, dict[str, Any]]) -> None:
    print(f"{'lane':>9} {'later p50':>10} {'later p90':>10} {'first p50':>10} {'first p90':>10} "
          f"{'wrong':>7} {'1st differ':>10}  decisions")  # fmt: skip
    for lane, s in results.items():
        print(f"{lane:>9} {s['later_ttft_ms_p50']:8.0f}ms {s['later_ttft_ms_p90']:8.0f}ms "
              f"{s['first_ttft_ms_p50']:8.0f}ms {s['first_ttft_ms_p90']:8.0f}ms "
              f"{s['wrong']:>3}/{s['later_turns']:<3} {s['first_differ']:>10}  {s['decisions']}")  # fmt: skip
    for decision, timings in gateway.items():
        print(f"  gateway {decision}: {timings}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--router-env", action="append", default=[], metavar="KEY=VALUE",
                    help="a kvshuttle router setting, KVSHUTTLE_ROUTER_ left off (repeatable)")  # fmt: skip
    ap.add_argument("--work", default=".run/bench-chat-vs-proxy")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    router_env = dict(kv.split("=", 1) for kv in args.router_env)
    work = Path(args.work)
    shutil.rmtree(work / "services", ignore_errors=True)
    model = ensure_model("small")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    system = Text(tok, random.Random(7))(800)
    profile = tomllib.loads(PROFILE.read_text())["profile"][0]
    pair = VllmPair(model, log_dir=work / "vllm", block_size=32, prefill_prefix_caching=False)
    jobs: queue.Queue[tuple[str, int]] = queue.Queue()
    for i in range(args.conversations):
        for lane in LANES:
            jobs.put((lane, i))
    rows: dict[str, list[dict[str, Any]]] = {lane: [] for lane in LANES}
    started = time.perf_counter()
    with pair, KvshuttleStack(pair, work_dir=work / "services", profile=profile, pool_bytes=POOL_BYTES,
                              extra_env={"router": router_env}) as stack:  # fmt: skip
        proxy = ToyProxy(pair)
        url = f"{stack.gateway_url}/v1/chat/completions"

        def kvshuttle(body: dict[str, Any], name: str | None) -> dict[str, Any]:
            return stream_chat(url, body | ({"conversation_id": name} if name else {}))

        send: dict[str, Send] = {"kvshuttle": kvshuttle, "proxy": proxy}
        warm = Text(tok, random.Random(99))
        for lane in LANES:  # unmeasured: each path's first request is slower than any after it
            send[lane](chat_body([{"role": "user", "content": warm(500)}], 16), None)

        def client() -> None:
            while True:
                try:
                    lane, i = jobs.get_nowait()
                except queue.Empty:
                    return
                # The same texts (seeded by the conversation's index) in both lanes.
                name, text = f"{lane}-c{i}-{uuid.uuid4().hex[:6]}", Text(tok, random.Random(i))
                got = conversation(send[lane], name, system, text, random.Random(-i - 1), args.turns)
                rows[lane].extend(got)
                print(f"{lane:>9} conversation {i}: TTFT ms {[r['ttft_ms'] for r in got]} "
                      f"{[r['decision'] for r in got]}", flush=True)  # fmt: skip

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lanes_s = time.perf_counter() - started
        every = [r for lane in LANES for r in rows[lane]]
        with ThreadPoolExecutor(args.clients) as pool:
            for r, ok in zip(every, pool.map(lambda r: recompute(pair, r), every), strict=True):
                r["ok"] = ok
    gateway = gateway_timings(work / "services" / "gateway.log")
    results = {lane: summary(rows[lane]) for lane in LANES}
    k, p = results["kvshuttle"]["later_ttft_ms_p50"], results["proxy"]["later_ttft_ms_p50"]
    ratio = round(k / p, 3) if k and p else None
    print(f"\n{args.conversations} conversations x {args.turns} turns per lane, {args.clients} clients"
          f"{', router ' + str(router_env) if router_env else ''}")  # fmt: skip
    table(results, gateway)
    print(f"kvshuttle / proxy later-turn TTFT p50: {ratio} (target <= 0.8)")
    for r in every:
        del r["prompt"], r["answer"]
    out = save("chat_vs_proxy", {
        "wall_s": round(time.perf_counter() - started, 1), "lanes_s": round(lanes_s, 1),
        "workload": {"shared_system_prefix": 800, "first_user": [120, 160], "user_turn": [120, 160],
                     "answer": [60, 100], "conversations": args.conversations, "clients": args.clients,
                     "turns": args.turns, "block_size": 32, "prefill_prefix_caching": False,
                     "pool_bytes": POOL_BYTES, "model": "small"},
        "router_env": router_env, "summary": results, "ratio_later_ttft_p50": ratio,
        "target": "kvshuttle later-turn TTFT p50 / proxy's <= 0.8",
        "gateway_timings_p50": gateway, "turns": rows}, args=args)  # fmt: skip
    print(f"saved {out}")


if __name__ == "__main__":
    main()
