"""Reproduce vLLM's published bidirectional-KV-transfer benchmark on the emulator: Qwen3-32B on
an H200 pair, 1P1D, prefix caching off on P, sessions growing 2k -> 24k tokens. Published:
TTFT recompute 158 -> 778 ms, with reuse (P reads the previous turn's KV from D) 122 -> 460 ms,
KV transfer 30 -> 130 ms; the target is within 10 % of each.

    python -m bench.reproduce [--sessions 3] [--time-scale 1.0] [--new-tokens 256]
        [--output-tokens 4] [--contexts 2048,4096,...] [--no-socket] [--no-save]

Every measured turn adds `--new-tokens` (256, as the profile's fit assumes) to what D holds from
the turn before: recompute computes the whole context on P, reuse reads context - 256 tokens
from D and computes 256. TTFT is the prefill request's time to its one token, D -> P read
included: the published fit (deploy/profiles/qwen3-32b-h200.toml) is a whole TTFT, its fixed_ms
carrying the P -> D transfer and D's first step, so D's time is not added again.

Two ways, per profile:
* `simulate`: bench/emulator/core/scheduler.py's `simulate` (P's step scheduler under a fake clock)
  plus the link's time for the blocks a read moves; exact, no sockets.
* `socket`: a prefill and a decode stand-in engine (bench/emulator/http/engine.py, profile-timed)
  driven over HTTP as vLLM's toy proxy does: P with `do_remote_decode` (reuse: D's params from
  the turn before), then D with P's params (D reads P's blocks and holds prompt + output - 1).
  Each session fills to context - 256 - output + 1 (D then holds context - 256), then measures
  the turn at `context`. Medians over `--sessions`; the engines' own CPU time per request
  (measured by the same run at time scale 0.001) is subtracted and shown. Also shown, not
  judged: the toy proxy's end-to-end TTFT (P, then D's first streamed token), which with the
  published fit counts D's one-token prefill on top (its fixed_ms again, and the cached-token
  term over the whole context) plus D's read of P's new blocks.

Profiles: qwen3-32b-h200-published.toml (the published fit); the same fit chunked at vLLM's
default 8192 tokens per step (simulate only: what per-step fixed costs do to it); and the
aiconfigurator TP 2 profile, for contrast. Prints one table per profile and way, and saves
bench/results/reproduce-<utc>.json (bench/report.py's header).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import aiohttp
from deploy.profiles.schema import EngineProfile, load_engine_profiles

from bench.emulator.core.link import Link
from bench.emulator.core.scheduler import simulate
from bench.emulator.http.config import in_process_config, with_profile
from bench.emulator.http.engine import StandinEngine
from bench.emulator.http.tokenizer import make_tokenizer
from bench.report import ROOT, save

__all__ = ["PUBLISHED", "Row", "main", "measured", "simulated", "table"]

PROFILES: Final = ROOT / "deploy" / "profiles"
PUBLISHED_PROFILE: Final = PROFILES / "qwen3-32b-h200-published.toml"
TP2_PROFILE: Final = PROFILES / "qwen3-32b-h200-tp2.toml"
CONTEXTS: Final = (2048, 4096, 8192, 12288, 16384, 20480, 24576)
TARGET: Final = 0.10
# What the overhead run's time scale leaves of the modelled times: under a millisecond at 24k.
_OVERHEAD_SCALE: Final = 0.001
_PROMPT_IDS: Final = (10, 1000)  # token ids the stand-in's tokenizer has


@dataclass(frozen=True, slots=True)
class Row:
    """One context length: TTFTs and the reuse turn's D -> P read, in ms."""

    context: int
    recompute_ms: float
    reuse_ms: float
    transfer_ms: float

    @property
    def transfer_share(self) -> float:
        return self.transfer_ms / self.reuse_ms


# The published table (the profile's header and README.md quote only its ends).
PUBLISHED: Final = {
    2048: Row(2048, recompute_ms=158.0, reuse_ms=122.0, transfer_ms=30.0),
    24576: Row(24576, recompute_ms=778.0, reuse_ms=460.0, transfer_ms=130.0),
}


def read_bytes(profile: EngineProfile, tokens: int) -> int:
    """What a READ of `tokens` moves: whole blocks (the stand-in reads block by block)."""
    bs = profile.engine.block_size
    return -(-tokens // bs) * bs * profile.kv_bytes_per_token


def simulated(profile: EngineProfile, contexts: Sequence[int], new_tokens: int) -> list[Row]:
    """Each context's TTFTs from P's scheduler under a fake clock, plus the read's link time."""
    rows = []
    for context in contexts:
        (recompute,) = simulate(profile, [(0.0, context, 0, 1)])
        (reuse,) = simulate(profile, [(0.0, context, context - new_tokens, 1)])
        transfer = profile.link.ms(read_bytes(profile, context - new_tokens))
        rows.append(
            Row(context, recompute.token_times[0] * 1e3, transfer + reuse.token_times[0] * 1e3, transfer)
        )
    return rows


class _TimedLink(Link):
    """P's link, keeping each read's time (profile ms, not scaled)."""

    def __init__(self, profile: EngineProfile, time_scale: float) -> None:
        super().__init__(profile.link, time_scale=time_scale)
        self.reads_ms: list[float] = []

    async def transfer(self, nbytes: int) -> None:
        began = time.perf_counter()
        await super().transfer(nbytes)
        self.reads_ms.append((time.perf_counter() - began) * 1e3 / self.time_scale)


Mode = Literal["recompute", "reuse"]
MODES: Final[tuple[Mode, Mode]] = ("recompute", "reuse")


@dataclass(frozen=True, slots=True)
class Sessions:
    """What each session does: a fill turn and a measured turn at every context length."""

    contexts: Sequence[int]
    new_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        # Each fill turn adds tokens to the turn before's prompt and answer.
        step = self.new_tokens + 2 * self.output_tokens
        if (
            self.new_tokens < 1
            or self.output_tokens < 1
            or any(
                later - earlier < step
                for earlier, later in zip((0, *self.contexts), self.contexts, strict=False)
            )
        ):
            raise ValueError(f"contexts must rise by at least new + 2 x output tokens ({step}) from 0")


@dataclass(frozen=True, slots=True)
class Sample:
    mode: Mode
    context: int
    ttft_ms: float  # wall time / time scale, the engines' CPU time included
    transfer_ms: float
    # P's request and D's first streamed token after it: the toy proxy's TTFT (not the fit's).
    proxy_ttft_ms: float


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
        answer: dict[str, Any] = await response.json()
        return answer


async def _stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, list[int], dict[str, Any]]:
    """A streamed completion: when its first token came (perf_counter), its ids, its params."""
    first_at, ids, params = 0.0, list[int](), dict[str, Any]()
    async with http.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
        async for line in response.content:
            if line.startswith(b"data: {"):
                first_at = first_at or time.perf_counter()
                chunk = json.loads(line[len(b"data: ") :])
                ids += chunk["choices"][0]["token_ids"]
                params = chunk.get("kv_transfer_params") or params
    return first_at, ids, params


async def _session(
    http: aiohttp.ClientSession,
    prefill: StandinEngine,
    decode: StandinEngine,
    link: _TimedLink,
    mode: Mode,
    seed: int,
    work: Sessions,
) -> list[Sample]:
    """One session through every context: a fill turn, then the measured one."""
    rng = random.Random(seed)  # the same prompts in both modes
    model, scale = prefill.config.served_model_name, prefill.config.time_scale
    history: list[int] = []
    held: dict[str, Any] | None = None  # D's params for the next turn's prefill
    samples = []
    for context in work.contexts:
        fill = context - work.new_tokens - work.output_tokens + 1
        for length, measuring in ((fill, False), (context, True)):
            prompt = history + [rng.randrange(*_PROMPT_IDS) for _ in range(length - len(history))]
            params = held if mode == "reuse" and held else {"do_remote_decode": True}
            reads = len(link.reads_ms)
            began = time.perf_counter()
            first = await _post(http, prefill.url, {"model": model, "prompt": prompt, "max_tokens": 1,
                                                    "kv_transfer_params": params})  # fmt: skip
            ttft_ms = (time.perf_counter() - began) * 1e3 / scale
            to_decode = {
                "model": model,
                "prompt": prompt,
                "max_tokens": work.output_tokens,
                "return_token_ids": True,
                "kv_transfer_params": first["kv_transfer_params"],
            }
            first_at, output, held = await _stream(http, decode.url, to_decode)
            history = prompt + output
            if measuring:
                proxy_ms = (first_at - began) * 1e3 / scale
                samples.append(Sample(mode, context, ttft_ms, sum(link.reads_ms[reads:]), proxy_ms))
    return samples


async def _pair_run(
    profile: EngineProfile, model_dir: Path, work: Sessions, *, sessions: int, time_scale: float
) -> list[Sample]:
    """Sessions one after another on a fresh 1P1D pair, prefix caching off on P."""
    longest = max(work.contexts) + work.output_tokens
    common: dict[str, Any] = {"time_scale": time_scale, "max_model_len": longest,
                              "served_model_name": profile.model, "kv_blocks_ttl": 60.0}  # fmt: skip
    link = _TimedLink(profile, time_scale)
    no_prefix_caching = in_process_config("prefill", "repro-p", model_dir, prefix_caching=False, **common)
    prefill = StandinEngine(with_profile(no_prefix_caching, profile), link=link)
    decode = StandinEngine(with_profile(in_process_config("decode", "repro-d", model_dir, **common), profile))
    await prefill.start()
    await decode.start()
    try:
        async with aiohttp.ClientSession() as http:
            samples = []
            for seed in range(sessions):
                for mode in MODES:
                    samples += await _session(http, prefill, decode, link, mode, seed, work)
            return samples
    finally:
        await prefill.stop()
        await decode.stop()


async def measured(
    profile: EngineProfile, model_dir: Path, work: Sessions, *, sessions: int, time_scale: float
) -> tuple[list[Row], dict[str, Any]]:
    """Medians over sessions, the engines' own time (an overhead run) subtracted; the rows and
    the raw figures."""
    timed = await _pair_run(profile, model_dir, work, sessions=sessions, time_scale=time_scale)
    overhead = await _pair_run(profile, model_dir, work, sessions=sessions, time_scale=_OVERHEAD_SCALE)

    def median(
        samples: list[Sample], mode: Mode, context: int, scale: float = 1.0, key: str = "ttft_ms"
    ) -> float:
        values: list[float] = [
            getattr(s, key) * scale for s in samples if (s.mode, s.context) == (mode, context)
        ]
        return statistics.median(values)

    rows, raw = [], []
    for c in work.contexts:
        # The overhead run's TTFT, back in real ms, is the engines' CPU time (its modelled part
        # is under a millisecond); the timed run's wall time less that, scaled, is the model's.
        own = {m: median(overhead, m, c, _OVERHEAD_SCALE) for m in MODES}
        ttft = {m: median(timed, m, c) - own[m] / time_scale for m in MODES}
        transfer = statistics.median(s.transfer_ms for s in timed if (s.mode, s.context) == ("reuse", c))
        rows.append(Row(c, ttft["recompute"], ttft["reuse"], transfer))
        proxy_own = {m: median(overhead, m, c, _OVERHEAD_SCALE, "proxy_ttft_ms") for m in MODES}
        proxy = {m: median(timed, m, c, key="proxy_ttft_ms") - proxy_own[m] / time_scale for m in MODES}
        uncorrected = {m: median(timed, m, c) for m in MODES}
        raw.append({"context": c, "ttft_ms_uncorrected": uncorrected, "engine_cpu_ms": own,
                    "proxy_ttft_ms": proxy, "proxy_engine_cpu_ms": proxy_own})  # fmt: skip
    return rows, {"time_scale": time_scale, "sessions": sessions, "per_context": raw,
                  "samples": [dataclasses.asdict(s) for s in timed]}  # fmt: skip


_JUDGED: Final = ("recompute_ms", "reuse_ms", "transfer_ms")


def _error(got: float, published: float) -> float:
    return got / published - 1


def row_figures(row: Row) -> dict[str, Any]:
    """A row as JSON, with the published point, errors and verdict where there is one."""
    figures: dict[str, Any] = {**dataclasses.asdict(row), "transfer_share": row.transfer_share}
    pub = PUBLISHED.get(row.context)
    if pub is not None:
        errors = {k: _error(getattr(row, k), getattr(pub, k)) for k in _JUDGED}
        figures |= {"published": {**dataclasses.asdict(pub), "transfer_share": pub.transfer_share},
                    "error": errors, "verdict": verdict(row)}  # fmt: skip
    return figures


def verdict(row: Row) -> str | None:
    """PASS when TTFT recompute, TTFT reuse and transfer are each within 10 % of the published
    point; None where the published table has none."""
    pub = PUBLISHED.get(row.context)
    if pub is None:
        return None
    ok = all(abs(_error(getattr(row, k), getattr(pub, k))) <= TARGET for k in _JUDGED)
    return "PASS" if ok else "MISS"


def table(title: str, rows: Sequence[Row]) -> str:
    def cell(row: Row, key: str) -> str:
        got, pub = getattr(row, key), PUBLISHED.get(row.context)
        if pub is None:
            return f"{got:7.1f}"
        return f"{got:7.1f} ({getattr(pub, key):.0f}, {_error(got, getattr(pub, key)):+.1%})"

    lines = [title, f"{'context':>7}  {'TTFT recompute ms':<26}{'TTFT reuse ms':<26}{'transfer ms':<26}"
             f"{'share':<14}10 %"]  # fmt: skip
    for row in rows:
        pub = PUBLISHED.get(row.context)
        share = f"{row.transfer_share:.0%}" + (f" ({pub.transfer_share:.0%})" if pub else "")
        cells = "".join(f"{cell(row, k):<26}" for k in _JUDGED)
        lines.append(f"{row.context:>7}  {cells}{share:<14}{verdict(row) or '-'}")
    return "\n".join(lines)


def proxy_table(per_context: Sequence[dict[str, Any]]) -> str:
    """The toy proxy's TTFT (P, then D's first token), which the published fit's TTFT already
    covers: D's read of P's KV and D's one-token prefill (its fixed_ms again) come on top."""
    lines = ["  end to end (P + D's first token; not the fit's TTFT): context  recompute  reuse ms"]
    for c in per_context:
        proxy = c["proxy_ttft_ms"]
        lines.append(f"{'':>56}{c['context']:>7}  {proxy['recompute']:9.1f}  {proxy['reuse']:8.1f}")
    return "\n".join(lines)


def chunked(profile: EngineProfile, tokens: int) -> EngineProfile:
    engine = dataclasses.replace(profile.engine, max_num_batched_tokens=tokens)
    return dataclasses.replace(profile, engine=engine)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    (published,) = load_engine_profiles(PUBLISHED_PROFILE)
    (tp2,) = load_engine_profiles(TP2_PROFILE)
    work = Sessions(args.contexts, args.new_tokens, args.output_tokens)
    profiles = [
        ("published fit", PUBLISHED_PROFILE.name, published, True),
        ("published fit, chunked", f"{PUBLISHED_PROFILE.name} @8192", chunked(published, 8192), False),
        ("aiconfigurator TP 2", TP2_PROFILE.name, tp2, True),
    ]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tokenizer(Path(tmp) / "model")
        for label, name, profile, socket in profiles:
            rows = simulated(profile, work.contexts, work.new_tokens)
            print(table(f"\n{label} ({name}), simulate:", rows), flush=True)
            figures = [row_figures(r) for r in rows]
            results.append({"profile": name, "label": label, "way": "simulate", "rows": figures})
            if socket and not args.no_socket:
                scale = args.time_scale
                rows, raw = await measured(profile, model_dir, work, sessions=args.sessions, time_scale=scale)
                cpu = max(max(c["engine_cpu_ms"].values()) for c in raw["per_context"])
                title = (f"\n{label} ({name}), socket: {args.sessions} sessions, time scale {scale}, "
                         f"engine CPU time subtracted (up to {cpu:.0f} ms real):")  # fmt: skip
                print(table(title, rows), flush=True)
                print(proxy_table(raw["per_context"]), flush=True)
                results.append({"profile": name, "label": label, "way": "socket",
                                "rows": [row_figures(r) for r in rows], "socket": raw})  # fmt: skip
    return {"target": TARGET, "new_tokens": args.new_tokens, "tables": results}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.reproduce", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=4)
    ap.add_argument("--contexts", type=lambda s: [int(c) for c in s.split(",")], default=list(CONTEXTS))
    ap.add_argument("--no-socket", action="store_true", help="simulate only")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    figures = asyncio.run(_run(args))
    if not args.no_save:
        print(f"\nsaved {save('reproduce', figures, args=args)}")


if __name__ == "__main__":
    main()
