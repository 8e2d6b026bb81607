"""Parking and prefetch on real vLLM (CPU build, tiny model, prefix caching off on prefill): what
decode holds, which conversations keep their KV, and TTFT with and without prefetch.

Phase 1, decode KV held and conversations kept: `--conversations` conversations of `--turns`
turns (a ~600-token first prompt, 24-token answers, 100 new tokens a turn), each pausing a random
think time in [--think-min, --think-max] s before its next turn, all at once, through the
gateway. Decode's pin is short (`--engine-ttl` s of vLLM's decoder_kv_blocks_ttl; kvshuttle's
lease on it ends `--lease` s after the commit), as a platform team sets it to bound decode memory.
Two stacks on the same engines, one after the other, the second once decode has dropped the
first's blocks (the engine TTL after its last turn; what decode holds is counted above what it
held when each run began):

    fixed    no parking: decode holds every conversation's KV until its lease ends
    parked   the router parks a conversation idle for --park-after s into decode's agent pool

Sampled every 0.5 s: decode's kv_cache_usage (as blocks of its --blocks), the agent pool's
bytes. Per run: decode blocks held (mean, peak, block-seconds), turns after the first that reused
(kept) vs recomputed, and how many idle conversations decode's KV cache could keep at once:
decode blocks / mean blocks one idle conversation holds there.

Phase 2, TTFT with and without prefetch: `--ttft-conversations` conversations, `--ttft-turns`
turns, 3 s think time sent as X-Kvshuttle-Expected-Think-Time; streamed TTFT (client-observed,
to the first chunk) of every turn after the first, with parking only (the next prefill reads
decode's agent) and with prefetch (it reads its own agent's pool), and the moves' measured
transfer time (the agents' READ seconds, from their metrics).

    python -m bench.parking [--conversations 12] [--turns 3]

Prints a table, writes bench/results/parking-<utc time>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from deploy.local.vllm_venv import ensure_model

from bench.report import save
from kvshuttle.agent.v1 import agent_service_pb2 as apb
from kvshuttle.agent.v1 import agent_service_pb2_grpc as apb_grpc

BS = 32
# Prefill dear, moving KV cheap: reuse wins whenever the prefix verifies (as tests/e2e/stacks.py).
PROFILE: dict[str, Any] = {
    "model": "m",
    "kv_bytes_per_token": 1024,
    "min_reuse_tokens": 64,
    "prefill": {"fixed_ms": 5.0, "per_token_ms": 0.2},
    "link": {"bandwidth_gb_s": 2.0, "fixed_ms": 1.0},
}
POOL_BYTES = 256 * 2**20


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[dict[str, Any], Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(req, timeout=300) as response:
        return json.loads(response.read()), response.headers


def streamed_ttft(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[float, list[int], Any]:
    """(seconds to the first chunk, the output ids, the response headers) of a streamed completion."""
    req = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **headers},
    )
    started = time.perf_counter()
    ttft = None
    ids: list[int] = []
    with urllib.request.urlopen(req, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids.extend(choice.get("token_ids") or [])
        return ttft or 0.0, ids, response.headers


def completion(prompt: list[int], conversation: str, max_tokens: int = 24) -> dict[str, Any]:
    return {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "conversation_id": conversation,
    }


def pool_used_bytes(stack: KvshuttleStack, agent: int) -> int:
    with grpc.insecure_channel(stack.agent_addrs[agent]) as channel:
        status = apb_grpc.AgentServiceStub(channel).GetStatus(
            apb.GetStatusRequest(), timeout=5, metadata=stack.admin_metadata
        )
    return int(status.pool.used_bytes)


def read_seconds(stack: KvshuttleStack, agent: int) -> tuple[float, int]:
    """(sum, count) of the agent's NIXL READ seconds, from its Prometheus metrics."""
    port = stack.agent_metrics_ports[agent]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    total, count = 0.0, 0
    for line in text.splitlines():
        if line.startswith("kvshuttle_agent_move_read_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvshuttle_agent_move_read_seconds_count"):
            count += int(float(line.rsplit(" ", 1)[1]))
    return total, count


@dataclass
class Sampler:
    """Decode's KV usage (blocks) and the decode agent's pool bytes, every `interval` s."""

    pair: VllmPair
    stack: KvshuttleStack
    blocks: int
    interval: float = 0.5
    decode_blocks: list[float] = field(default_factory=list)
    pool_bytes: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            self.decode_blocks.append(self.pair.decode.kv_cache_usage() * self.blocks)
            if self.stack.pool_bytes:
                self.pool_bytes.append(pool_used_bytes(self.stack, 1))

    def stop(self) -> None:
        self._stop.set()


def conversation_run(
    stack: KvshuttleStack,
    name: str,
    turns: int,
    think: Callable[[], float],
    seed: int,
    out: list[dict[str, Any]],
) -> None:
    rng = random.Random(seed)
    prompt = tokens(600, rng)
    for t in range(turns):
        body, headers = post(f"{stack.gateway_url}/v1/completions", completion(prompt, name))
        ids = list(body["choices"][0]["token_ids"])
        out.append(
            {
                "conversation": name,
                "turn": t,
                "decision": headers["X-Kvshuttle-Decision"],
                "reason": headers["X-Kvshuttle-Reason"],
                "reused": int(headers["X-Kvshuttle-Reused-Tokens"]),
                "prompt": len(prompt),
            }
        )
        prompt = prompt + ids + tokens(100, rng)
        if t + 1 < turns:
            time.sleep(think())


def phase_held(pair: VllmPair, work: Path, args: argparse.Namespace, parked: bool) -> dict[str, Any]:
    env = {
        "router": {
            "POLICY__DECODER_KV_BLOCKS_TTL_S": str(args.engine_ttl),
            "POLICY__RETENTION_MARGIN_S": str(args.engine_ttl - args.lease),
            "POLICY__PARKING__ENABLED": "true" if parked else "false",
            "POLICY__PARKING__PARK_AFTER_IDLE_S": str(args.park_after),
            "POLICY__PARKING__MAX_IDLE_S": "600",
            "POLICY__PARKING__TICK_S": "0.2",
        }
    }
    label = "parked" if parked else "fixed"
    stack = KvshuttleStack(
        pair, work_dir=work / label, profile=PROFILE, extra_env=env, pool_bytes=POOL_BYTES if parked else 0
    )
    with stack:
        rng = random.Random(7)
        baseline = pair.decode.kv_cache_usage() * args.blocks
        sampler = Sampler(pair, stack, args.blocks)
        threading.Thread(target=sampler.run, daemon=True).start()
        results: list[dict[str, Any]] = []
        threads = [
            threading.Thread(
                target=conversation_run,
                args=(
                    stack,
                    f"{label}-{i}",
                    args.turns,
                    lambda: rng.uniform(args.think_min, args.think_max),
                    i,
                    results,
                ),
            )
            for i in range(args.conversations)
        ]
        started = time.monotonic()
        for thread in threads:
            thread.start()
            time.sleep(0.2)
        for thread in threads:
            thread.join()
        seconds = time.monotonic() - started
        time.sleep(args.park_after + 2)  # the last turns' KV parks (or stays)
        tail = sampler.decode_blocks[-3:]
        sampler.stop()
    later = [r for r in results if r["turn"] > 0]
    kept = sum(1 for r in later if r["decision"] == "reuse")
    held = [max(0.0, b - baseline) for b in sampler.decode_blocks]
    tail = [max(0.0, b - baseline) for b in tail]
    mean_held = statistics.fmean(held) if held else 0.0
    return {
        "config": label,
        "baseline_blocks": round(baseline, 1),
        "seconds": round(seconds, 1),
        "turns": len(results),
        "later_turns": len(later),
        "kept": kept,
        "recomputed": len(later) - kept,
        "reasons": sorted({r["reason"] for r in later}),
        "decode_blocks_mean": round(mean_held, 1),
        "decode_blocks_peak": round(max(held, default=0.0), 1),
        "decode_blocks_after": round(statistics.fmean(tail), 1) if tail else 0.0,
        "block_seconds": round(sum(held) * sampler.interval, 1),
        "pool_bytes_peak": max(sampler.pool_bytes, default=0),
        "samples": len(held),
    }


def phase_ttft(pair: VllmPair, work: Path, args: argparse.Namespace, prefetch: bool) -> dict[str, Any]:
    env = {
        "router": {
            "POLICY__DECODER_KV_BLOCKS_TTL_S": str(args.engine_ttl),
            "POLICY__RETENTION_MARGIN_S": str(args.engine_ttl - args.lease),
            "POLICY__PARKING__ENABLED": "true",
            "POLICY__PARKING__PARK_AFTER_IDLE_S": "1",
            "POLICY__PARKING__TICK_S": "0.2",
            "POLICY__PARKING__PREFETCH_ENABLED": "true" if prefetch else "false",
        }
    }
    label = "prefetch" if prefetch else "parked"
    ttfts: list[float] = []
    holders: list[str] = []
    stack = KvshuttleStack(
        pair, work_dir=work / f"ttft-{label}", profile=PROFILE, extra_env=env, pool_bytes=POOL_BYTES
    )
    with stack:
        for c in range(args.ttft_conversations):
            rng = random.Random(100 + c)
            prompt = tokens(1500, rng)
            name = f"ttft-{label}-{c}"
            for t in range(args.ttft_turns):
                ttft, ids, headers = streamed_ttft(
                    f"{stack.gateway_url}/v1/completions",
                    completion(prompt, name),
                    {"X-Kvshuttle-Expected-Think-Time": "3"},
                )
                if t > 0:
                    ttfts.append(ttft)
                    holders.append(headers["X-Kvshuttle-Decision"])
                prompt = prompt + ids + tokens(100, rng)
                time.sleep(3)
        moved = [read_seconds(stack, a) for a in (0, 1)]
    total, count = sum(m[0] for m in moved), sum(m[1] for m in moved)
    return {
        "config": label,
        "turns": len(ttfts),
        "reused": holders.count("reuse"),
        "ttft_ms_median": round(statistics.median(ttfts) * 1e3, 1),
        "ttft_ms_mean": round(statistics.fmean(ttfts) * 1e3, 1),
        "read_ms_mean": round(total / count * 1e3, 3) if count else None,
        "reads": count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--think-min", type=float, default=3.0)
    parser.add_argument("--think-max", type=float, default=20.0)
    parser.add_argument("--lease", type=float, default=12.0)
    parser.add_argument("--engine-ttl", type=int, default=30)
    parser.add_argument("--park-after", type=float, default=2.0)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--ttft-conversations", type=int, default=4)
    parser.add_argument("--ttft-turns", type=int, default=4)
    args = parser.parse_args()
    started = datetime.now(UTC)
    work = Path(".run") / f"bench-parking-{started.strftime('%Y%m%dT%H%M%SZ')}"
    pair = VllmPair(
        ensure_model("tiny"),
        log_dir=work / "vllm",
        block_size=BS,
        prefill_prefix_caching=False,
        decoder_kv_blocks_ttl=args.engine_ttl,
        extra_args=("--num-gpu-blocks-override", str(args.blocks)),
    )
    with pair:
        held = []
        for parked in (False, True):
            held.append(phase_held(pair, work, args, parked))
            time.sleep(args.engine_ttl + 5)  # decode drops the run's pinned blocks
        ttft = [phase_ttft(pair, work, args, prefetch) for prefetch in (False, True)]
    fixed = held[0]
    per_conversation = {
        r["config"]: (r["decode_blocks_mean"] / args.conversations) if r["decode_blocks_mean"] else 0.0
        for r in held
    }
    keepable = {
        name: (round(args.blocks / blocks) if blocks > 0.01 else None)
        for name, blocks in per_conversation.items()
    }
    heads = ("kept", "recomp", "blocks mean", "peak", "block-s", "pool MiB")
    print(f"{'config':8} " + " ".join(f"{h:>{max(6, len(h))}}" for h in heads))
    for r in held:
        print(
            f"{r['config']:8} {r['kept']:>6} {r['recomputed']:>6} {r['decode_blocks_mean']:>11} "
            f"{r['decode_blocks_peak']:>6} {r['block_seconds']:>8} {r['pool_bytes_peak'] / 2**20:>8.1f}"
        )
    print(f"idle conversations decode's {args.blocks} blocks keep at once: {keepable}")
    for r in ttft:
        print(f"{r['config']:8} TTFT median {r['ttft_ms_median']} ms mean {r['ttft_ms_mean']} ms "
              f"reused {r['reused']}/{r['turns']}, READ {r['read_ms_mean']} ms x {r['reads']}")  # fmt: skip
    figures = {
        "held": held,
        "idle_conversations_keepable": keepable,
        "ttft": ttft,
        "fixed_vs_parked_block_seconds": (
            round(held[1]["block_seconds"] / fixed["block_seconds"], 3) if fixed["block_seconds"] else None
        ),
    }
    path = save("parking", figures, args=args, utc=started)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
