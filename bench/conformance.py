"""Conformance of the emulator (bench/emulator/http, profile-timed by deploy/profiles/cpu-small.toml) to
real vLLM (CPU build): the same scripted conversations through kvshuttle's stack on each pair.

    python -m bench.conformance [--size small] [--scale 4] [--no-save]

Per turn it prints TTFT through the gateway (first streamed token) on real vLLM and on the
emulator, their ratio, and kvshuttle's decision on each; saves
bench/results/conformance-<utc>.json (bench/report.py's header), with the gateway's own timings
of each turn (its `request.done` line: PlanTurn, prefill, decode's first byte). The target is a
ratio within 25 %. cpu-small is fitted to the `small` model, so the real pair runs it here. Each
pair first serves one plain request of unrelated tokens (`warm_up`, not counted): a vLLM
engine's first request is slower than any after it, and cpu-small's fit saw none.

What the two must agree on exactly (not timed) is tests/e2e/test_conformance.py's, on the test
session's tiny-model pair, with the same script (`CONVERSATIONS`) and the helpers below: the
`kv_transfer_params` shapes (`exchange_params`, `shape`), the KV-event sequence each engine
publishes (`EventTap`, `event_sequence`), kvshuttle's decision and reason per turn, and each
answer against its own engine's clean recompute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
import tomllib
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import zmq
from deploy.local.engine_pair import Engine, EnginePair
from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from deploy.local.vllm_venv import ensure_model

from bench.emulator.http.launcher import StandinPair
from bench.report import ROOT, save
from kvshuttle.core.kv_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored
from kvshuttle.vllm.kv_events import KvEventDecoder

__all__ = [
    "CONVERSATIONS",
    "CPU_SMALL",
    "MAX_TOKENS",
    "EventTap",
    "Step",
    "Turn",
    "event_sequence",
    "event_tap",
    "exchange_params",
    "run_script",
    "shape",
]

CPU_SMALL: Final = ROOT / "deploy" / "profiles" / "cpu-small.toml"
MAX_TOKENS: Final = 24
TARGET: Final = 0.25  # |emulated / real - 1| per turn
WARMUP_TOKENS: Final = 512
# The gateway's request.done fields kept per turn (ms).
GATEWAY_TIMINGS: Final = ("wait_ms", "plan_ms", "prefill_ms", "decode_ttfb_ms", "ttft_ms", "ttft_added_ms")


@dataclass(frozen=True)
class Step:
    """One user turn: `new` fresh tokens (from `seed`) after the history; `edit_at`: the history's
    token there is changed first (a client rewrote a span mid-history)."""

    new: int
    seed: int
    edit_at: int | None = None


# Reuse of a whole history, twice; an edited history (only the verified prefix reused); and a
# history too short to be worth reading back (kvshuttle recomputes it).
CONVERSATIONS: Final[Mapping[str, tuple[Step, ...]]] = {
    "growing": (Step(600, 1), Step(100, 2), Step(80, 3)),
    "edited": (Step(700, 4), Step(80, 5, edit_at=300)),
    "short": (Step(30, 6), Step(20, 7)),
}


@dataclass
class Turn:
    conversation: str
    index: int
    prompt: list[int]
    answer: list[int]
    ttft_ms: float
    decision: str
    reason: str
    reused_tokens: int
    prefill_cached_tokens: int
    # Filled in after the run: the answer equals a clean recompute of the prompt on the same engines.
    answer_ok: bool | None = field(default=None)
    # Filled in after the run: the gateway's timings of the turn (GATEWAY_TIMINGS), in ms.
    gateway: dict[str, float] | None = field(default=None)

    def decisions(self) -> tuple[str, str, int, int]:
        return self.decision, self.reason, self.reused_tokens, self.prefill_cached_tokens


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def _stream(url: str, body: dict[str, Any]) -> tuple[float, list[int], dict[str, str]]:
    """POST a streamed completion: (seconds to the first token, output ids, lower-cased headers)."""
    req = urllib.request.Request(
        url, data=json.dumps(body | {"stream": True}).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    out: list[int] = []
    with urllib.request.urlopen(req, timeout=300) as response:
        headers = {k.lower(): v for k, v in response.headers.items()}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :]).get("choices", []):
                if choice.get("token_ids"):
                    first = first if first is not None else time.perf_counter() - start
                    out.extend(choice["token_ids"])
    return first or 0.0, out, headers


def run_script(stack: KvshuttleStack, *, scale: int = 1) -> list[Turn]:
    """`CONVERSATIONS` through the stack's gateway, turn by turn round robin, greedy, token
    counts times `scale`; each turn's prompt is its history (prompts and answers) plus the new tokens."""
    history: dict[str, list[int]] = {name: [] for name in CONVERSATIONS}
    ids = {name: f"conf-{name}-{uuid.uuid4().hex[:8]}" for name in CONVERSATIONS}
    turns: list[Turn] = []
    for index in range(max(len(steps) for steps in CONVERSATIONS.values())):
        for name, steps in CONVERSATIONS.items():
            if index >= len(steps):
                continue
            step, past = steps[index], history[name]
            if step.edit_at is not None:
                at = step.edit_at * scale
                past[at] = (past[at] + 1) % 2000 + 10
            prompt = past + _tokens(step.new * scale, step.seed)
            ttft, answer, headers = _stream(
                f"{stack.gateway_url}/v1/completions",
                {"model": stack.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                 "ignore_eos": True, "return_token_ids": True, "conversation_id": ids[name]},
            )  # fmt: skip
            turns.append(
                Turn(name, index, prompt, answer, round(ttft * 1e3, 1),
                     headers.get("x-kvshuttle-decision", ""), headers.get("x-kvshuttle-reason", ""),
                     int(headers.get("x-kvshuttle-reused-tokens", 0)),
                     int(headers.get("x-kvshuttle-prefill-cached-tokens", 0)))
            )  # fmt: skip
            history[name] = prompt + answer
    return turns


# -- KV events -------------------------------------------------------------------------------


class EventTap:
    """A ZMQ SUB on each engine's KV events, as kvshuttle's agent subscribes; `drain()` the
    decoded events each engine published since the tap opened."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        self._zmq = zmq.Context()
        self._subs: dict[str, zmq.Socket[bytes]] = {}
        for engine in engines:
            sub = self._zmq.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(engine.events_endpoint)
            self._subs[engine.name] = sub
        time.sleep(0.5)  # a SUB receives only once its subscription reached the publisher

    def drain(self, quiet_s: float = 1.5) -> dict[str, list[BlockEvent]]:
        """Every engine's events until none came for `quiet_s` (the last turn's may trail it)."""
        decoder = KvEventDecoder()
        got: dict[str, list[BlockEvent]] = {name: [] for name in self._subs}
        poller = zmq.Poller()
        for sub in self._subs.values():
            poller.register(sub, zmq.POLLIN)
        by_socket = {sub: name for name, sub in self._subs.items()}
        while ready := dict(poller.poll(int(quiet_s * 1e3))):
            for sub in ready:
                batch = decoder.decode_message(sub.recv_multipart())
                if batch is not None:
                    got[by_socket[sub]].extend(batch.events)
        return got

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close(0)
        self._zmq.term()


@contextmanager
def event_tap(pair: EnginePair) -> Iterator[EventTap]:
    tap = EventTap(pair.engines)
    try:
        yield tap
    finally:
        tap.close()


def event_sequence(events: Sequence[BlockEvent]) -> list[tuple[Any, ...]]:
    """The events as kvshuttle's index reads them, without hash values: each block is named by
    its order of first storing. BlockStored: (blocks, tokens, parent's name or None, salted);
    BlockRemoved: the names of the script's blocks it removes (blocks cached before the script,
    by earlier users of the engine, are left out: they say nothing of the script)."""
    names: dict[int, int] = {}
    out: list[tuple[Any, ...]] = []
    for event in events:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            linked = None if parent is None else names.get(parent, "before the script")
            for h in event.block_hashes:
                names.setdefault(h, len(names))
            blocks, tokens = len(event.block_hashes), len(event.token_ids)
            out.append(("BlockStored", blocks, tokens, linked, bool(event.cache_salt_sha256)))
        elif isinstance(event, BlockRemoved):
            known = tuple(names[h] for h in event.block_hashes if h in names)
            if known:
                out.append(("BlockRemoved", known))
        elif isinstance(event, AllBlocksCleared):
            out.append(("AllBlocksCleared",))
    return out


# -- kv_transfer_params ----------------------------------------------------------------------


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def exchange_params(pair: EnginePair, model: str = "m") -> dict[str, dict[str, Any]]:
    """Two turns straight to the engines, as vLLM's toy proxy sends them (P with
    `do_remote_decode`, then D with P's params; turn 2 gives P decode's params): the
    `kv_transfer_params` each answered."""
    prefill, decode = (next(e for e in pair.engines if e.spec.role == r) for r in ("prefill", "decode"))
    first = _tokens(300, 11)
    greedy = {"model": model, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    to_decode = {"do_remote_decode": True, "do_remote_prefill": False}
    p1 = _complete(prefill.url, greedy | {"prompt": first, "max_tokens": 1, "kv_transfer_params": to_decode})
    d1 = _complete(decode.url, greedy | {"prompt": first, "max_tokens": MAX_TOKENS,
                                         "kv_transfer_params": p1["kv_transfer_params"]})  # fmt: skip
    second = first + d1["choices"][0]["token_ids"] + _tokens(100, 12)
    p2 = _complete(prefill.url, greedy | {"prompt": second, "max_tokens": 1,
                                          "kv_transfer_params": d1["kv_transfer_params"]})  # fmt: skip
    d2 = _complete(decode.url, greedy | {"prompt": second, "max_tokens": MAX_TOKENS,
                                         "kv_transfer_params": p2["kv_transfer_params"]})  # fmt: skip
    answers = {"prefill": p1, "decode": d1, "prefill_reading_decode": p2, "decode_after_reuse": d2}
    return {name: answer["kv_transfer_params"] for name, answer in answers.items()}


def shape(value: Any) -> Any:
    """`value` without its values: a map's keys (sorted) with their values' shapes, a list's
    items' shapes (so its length), any other value's type name."""
    if isinstance(value, dict):
        return {key: shape(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


# -- the TTFT comparison ---------------------------------------------------------------------


def warm_up(stack: KvshuttleStack) -> float:
    """One plain P->D request (no conversation: nothing retained) of tokens the script never
    sends, through the gateway: both engines, the NIXL read between them and the services
    serve their first request here. Its TTFT in ms."""
    ttft, _, _ = _stream(
        f"{stack.gateway_url}/v1/completions",
        {"model": stack.model, "prompt": _tokens(WARMUP_TOKENS, 0), "max_tokens": MAX_TOKENS,
         "temperature": 0, "ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    return round(ttft * 1e3, 1)


def gateway_timings(log: Path, turns: Sequence[Turn]) -> None:
    """Each turn's `gateway` from the gateway's request.done lines: those of a conversation (the
    warm-up has none), in the script's order; the line logs the conversation's digest, so each
    is checked on its prompt's length and decision instead."""
    done = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    script = [d for d in done if d.get("event") == "request.done" and d.get("conversation")]
    if len(script) != len(turns):
        raise RuntimeError(f"{log}: {len(script)} request.done lines of conversations for {len(turns)} turns")
    for t, d in zip(turns, script, strict=True):
        logged = d.get("prompt_tokens"), d.get("decision"), d.get("reason")
        if logged != (len(t.prompt), t.decision, t.reason):
            raise RuntimeError(f"{log}: {d} is not the line of {t.conversation}/{t.index}")
        t.gateway = {key: d[key] for key in GATEWAY_TIMINGS if d.get(key) is not None}


def _run_on(
    pair: EnginePair,
    work: Path,
    profile: Mapping[str, Any],
    scale: int,
    reference: Callable[[list[int]], list[int]],
) -> tuple[float, list[Turn]]:
    """The warm-up's TTFT (ms) and the script's turns."""
    with KvshuttleStack(pair, work_dir=work, profile=profile) as stack:
        warm_ms = warm_up(stack)
        turns = run_script(stack, scale=scale)
    gateway_timings(work / "gateway.log", turns)  # the stack stopped: every line is written
    for t in turns:
        t.answer_ok = t.answer == reference(t.prompt)
    return warm_ms, turns


def _reference(pair: VllmPair) -> Callable[[list[int]], list[int]]:
    """A clean recompute on real decode (a fresh cache salt: no cache hit)."""

    def recompute(prompt: list[int]) -> list[int]:
        body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "cache_salt": uuid.uuid4().hex}  # fmt: skip
        ids: list[int] = _complete(pair.decode.url, body)["choices"][0]["token_ids"]
        return ids

    return recompute


def table(real: Sequence[Turn], emulated: Sequence[Turn]) -> tuple[str, list[dict[str, Any]]]:
    rows = []
    lines = [
        f"{'turn':<12} {'prompt':>6} {'decision (reason)':<28} {'real ms':>8} {'emul ms':>8} {'ratio':>6}"
    ]
    for r, e in zip(real, emulated, strict=True):
        ratio = e.ttft_ms / r.ttft_ms if r.ttft_ms else float("inf")
        same = r.decisions() == e.decisions()
        rows.append({"conversation": r.conversation, "turn": r.index, "prompt_tokens": len(r.prompt),
                     "real": asdict(r) | {"prompt": None, "answer": None},
                     "emulated": asdict(e) | {"prompt": None, "answer": None},
                     "ttft_ratio": round(ratio, 3), "within_target": abs(ratio - 1) <= TARGET,
                     "same_decision": same})  # fmt: skip
        decision = f"{r.decision} ({r.reason})" + ("" if same else f" vs {e.decision} ({e.reason})")
        lines.append(f"{r.conversation}/{r.index:<{11 - len(r.conversation)}} {len(r.prompt):>6} "
                     f"{decision:<28} {r.ttft_ms:>8.0f} {e.ttft_ms:>8.0f} {ratio:>6.2f}")  # fmt: skip
    return "\n".join(lines), rows


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.conformance", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("--size", default="small", help="the test model both pairs load (cpu-small's: small)")
    ap.add_argument("--scale", type=int, default=4, help="the script's token counts times this")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    model = ensure_model(args.size)
    load_before = os.getloadavg()
    profile = tomllib.loads(CPU_SMALL.read_text())["profile"][0]
    with tempfile.TemporaryDirectory(prefix="conformance-") as tmp:
        work = Path(tmp)
        # As the fit's runs: prefix caching off on P (vLLM's published benchmark), 1 GiB of KV.
        with VllmPair(model, log_dir=work / "vllm", prefill_prefix_caching=False) as real_pair:
            real_warm, real = _run_on(real_pair, work / "real", profile, args.scale, _reference(real_pair))
        with StandinPair(model, log_dir=work / "standin", profile=CPU_SMALL,
                         prefill_prefix_caching=False) as emulated_pair:  # fmt: skip
            emulated_warm, emulated = _run_on(
                emulated_pair, work / "emulated", profile, args.scale,
                lambda prompt: emulated_pair.expected(prompt, MAX_TOKENS))  # fmt: skip
    text, rows = table(real, emulated)
    print(text)
    within = sum(row["within_target"] for row in rows)
    wrong = sum(not t.answer_ok for t in (*real, *emulated))
    print(f"TTFT within {TARGET:.0%}: {within}/{len(rows)} turns; wrong answers: {wrong}")
    print(
        f"warm-up request ({WARMUP_TOKENS} tokens, not counted): real {real_warm:.0f} ms, "
        f"emulated {emulated_warm:.0f} ms"
    )
    if not args.no_save:
        # Real vLLM's TTFTs stretch with whatever else runs on its cores; the emulator's hardly.
        figures = {"profile": str(CPU_SMALL.relative_to(ROOT)), "target": TARGET,
                   "load_average_before": load_before, "load_average_after": os.getloadavg(),
                   "warmup": {"prompt_tokens": WARMUP_TOKENS, "real_ttft_ms": real_warm,
                              "emulated_ttft_ms": emulated_warm},
                   "turns": rows}  # fmt: skip
        print(f"saved {save('conformance', figures, args=args)}")


if __name__ == "__main__":
    main()
