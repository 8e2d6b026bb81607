"""bench/fleet/socket_check.py without the slow socket run: the simulator's replay, fed the socket
bench's plan through `SocketClient`, sends what the socket bench's replay sends, turn by turn
(same prompt tokens, answer caps, next-turn hints and send times, both driven in virtual time
by the same scripted engine); the router policy is the one the socket bench's router starts
with; and the comparison's arithmetic."""

from __future__ import annotations

import asyncio
import hashlib
import zlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import numpy as np
import pytest
from bench.cluster import replay as socket_replay
from bench.cluster.client import Streamed
from bench.cluster.plan import CONVERSATION_TRACE
from bench.cluster.policies import Served as SocketServed
from bench.cluster.policies import Turn as SocketTurn
from bench.cluster.run import ClusterRun
from bench.emulator.fleet import vtime
from bench.emulator.fleet.engine import Completion, Prompt
from bench.emulator.fleet.fleet import Fleet, FleetConfig
from bench.emulator.http.config import engine_profile
from bench.emulator.http.tokenizer import make_tokenizer
from bench.fleet import socket_check
from bench.fleet.replay import Served, SimTurn, replay

from kvshuttle.core.hashing import chain_array
from kvshuttle.router.config import RouterSettings
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.router.verify import extend_params

PROFILE = engine_profile(Path(__file__).parents[2] / "deploy/profiles/qwen3-32b-h200-tp2.toml")
TTFT_S, TOKEN_S = 0.2, 0.01  # the scripted engine's pace

# What a policy was asked: session, turn, send time, prompt (length, digest), answer cap, hint.
Asked = tuple[str, int, float, int, str, int, float | None]


def _answer(session: str, turn: int, n: int) -> list[int]:
    """The scripted engine's answer: the same ids on both benches for the same turn."""
    base = zlib.crc32(f"{session}/{turn}".encode())
    return [1_000 + (base + k * 7_919) % 20_000 for k in range(n)]


async def _stream(n: int) -> list[float]:
    loop = asyncio.get_running_loop()
    first = loop.time() + TTFT_S
    await asyncio.sleep(TTFT_S + TOKEN_S * (n - 1))
    return [first + TOKEN_S * k for k in range(n)]


def _digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()


class _SocketEngine:
    """A bench/cluster policy answering from the script."""

    name = "scripted"

    def __init__(self) -> None:
        self.asked: list[Asked] = []
        self._turns: Counter[str] = Counter()

    async def serve(self, http: aiohttp.ClientSession, turn: SocketTurn) -> SocketServed:
        index = self._turns[turn.conversation]
        self._turns[turn.conversation] += 1
        now = asyncio.get_running_loop().time()
        self.asked.append(
            (
                turn.conversation,
                index,
                now,
                len(turn.prompt),
                _digest(turn.prompt),
                turn.max_tokens,
                turn.think_s,
            )
        )
        ids = _answer(turn.conversation, index, turn.max_tokens)
        return SocketServed(Streamed(ids=ids, token_times=await _stream(len(ids))), "scripted", 0)

    def cpu_s(self) -> float:
        return 0.0

    async def close(self) -> None:
        pass


class _SimEngine:
    """A bench/fleet policy answering from the same script."""

    name = "scripted"

    def __init__(self) -> None:
        self.asked: list[Asked] = []

    async def serve(self, turn: SimTurn) -> Served:
        now = asyncio.get_running_loop().time()
        tokens = turn.prompt.tokens
        self.asked.append(
            (
                turn.conversation,
                turn.index,
                now,
                len(tokens),
                _digest(tokens.tolist()),
                turn.output,
                turn.next_think_s,
            )
        )
        ids = _answer(turn.conversation, turn.index, turn.output)
        times = await _stream(len(ids))
        done = Completion(np.asarray(ids, np.uint32), times, None, False, 0, 0, 0, len(tokens), now)
        return Served(done, "", "decode-0", "scripted")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("standin")
    make_tokenizer(out)
    return out


def _run(model_dir: Path, seed: int) -> ClusterRun:
    args = socket_check.parse([])
    return ClusterRun(
        model_dir=model_dir, profile=PROFILE, prefill=args.prefill, decode=args.decode, time_scale=1.0,
        max_model_len=args.max_model_len, max_output=args.max_output, max_turns=args.max_turns,
        edit_fraction=0.0, seed=seed, horizon_s=args.horizon,
    )  # fmt: skip


@pytest.mark.parametrize("workload", sorted(socket_check.LOADS))
def test_the_simulator_is_fed_the_socket_bench_plan_turn_by_turn(
    workload: str, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if workload == "mooncake" and not CONVERSATION_TRACE.exists():
        pytest.skip(f"no Mooncake trace at {CONVERSATION_TRACE}")
    run = _run(model_dir, seed=1)
    rate, window = socket_check.LOADS[workload]
    plan = socket_check.socket_plan(workload, rate, window, run.seed, socket_check.parse([]).gap_divisor)
    token_map = socket_check.socket_token_map(model_dir, run.seed)
    horizon = cast(float, run.horizon_s)
    # The socket bench's replay on its clock, which here is the virtual loop's.
    monkeypatch.setattr(
        socket_replay, "time", SimpleNamespace(monotonic=lambda: asyncio.get_running_loop().time())
    )
    config = socket_replay.ReplayConfig(
        token_map=token_map, vocab_size=token_map.vocab_size, time_scale=1.0,
        max_model_len=run.max_model_len, max_output=run.max_output, max_turns=run.max_turns,
        edit_fraction=0.0, seed=run.seed, horizon_s=horizon,
    )  # fmt: skip
    socket_engine, sim_engine = _SocketEngine(), _SimEngine()
    vtime.run(
        socket_replay.Replay(socket_engine, config, lambda prompt, n: []).run(
            cast(aiohttp.ClientSession, None), plan
        )
    )
    sessions = {a.session.session_id: a.session for a in plan}
    client = socket_check.SocketClient(
        sim_engine, sessions, max_output=run.max_output, max_turns=run.max_turns
    )
    vtime.run(
        replay(
            client,
            socket_check.fleet_arrivals(plan, run.max_turns),
            token_map,
            block_size=PROFILE.engine.block_size,
            max_model_len=run.max_model_len,
            send_until_s=horizon,
            end_s=horizon + socket_check.SOCKET_DRAIN_S,
        )
    )
    socket_turns, sim_turns = sorted(socket_engine.asked), sorted(sim_engine.asked)
    assert [t[:2] for t in sim_turns] == [t[:2] for t in socket_turns]
    for (*key, sent, length, digest, cap, hint), (*_, sent2, length2, digest2, cap2, hint2) in zip(
        socket_turns, sim_turns, strict=True
    ):
        assert (length2, digest2, cap2) == (length, digest, cap), key
        assert sent2 == pytest.approx(sent, abs=1e-6), key
        assert hint2 == hint, key
    later = [t for t in socket_turns if t[1] > 0]
    assert len(later) >= 10  # histories go on: prompts carry the scripted answers
    assert any(max(r.output_tokens for r in sessions[s].requests) > run.max_output for s, *_ in socket_turns)
    if workload == "agent":
        assert any(t[-1] is not None for t in socket_turns)  # think-time hints, sent alike
    else:
        assert all(t[-1] is None for t in socket_turns)  # a recorded trace's offsets: no hint


def test_the_router_policy_is_the_one_the_socket_bench_router_starts_with(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = socket_check.socket_router_env(_run(model_dir, seed=1))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    policy = socket_check.router_policy_of(env)
    assert policy == RouterSettings().policy  # as the router reads its environment
    assert policy.extend.enabled and policy.parking.enabled and policy.parking.prefetch_enabled
    assert policy != RouterPolicy()


def _turn(
    session: str, index: int, ttft_ms: float | None, decision: str, prompt: int, reused: int
) -> socket_check.Turn:
    ttft = None if ttft_ms is None else ttft_ms / 1e3
    return socket_check.Turn(session, index, float(index), prompt, decision, decision, reused, ttft)


def test_the_comparison_arithmetic() -> None:
    socket = [
        _turn("a", 0, 100, "p2d", 1_000, 0),
        _turn("a", 1, 200, "local", 2_000, 992),  # 992: the previous prompt's full blocks
        _turn("a", 2, 300, "local", 3_000, 1_500),  # less than turn 1's 1,984 in full blocks
        _turn("a", 3, 400, "local", 4_000, 2_992),
    ]
    sim = [
        _turn("a", 0, 110, "p2d", 1_000, 0),
        _turn("a", 1, 220, "local", 2_000, 992),
        _turn("a", 2, 330, "p2d", 3_000, 0),  # decided otherwise
        _turn("a", 3, 440, "local", 4_000, 2_992),
        _turn("a", 4, None, "local", 5_000, 0),  # cut: not served
    ]
    a, b = socket_check.figures(socket, 16), socket_check.figures(sim, 16)
    # The socket bench's quantile: the value at round(q (n - 1)).
    assert a["ttft_ms"] == {"p50": 300.0, "p90": 400.0, "later_p50": 300.0, "later_p90": 400.0}
    assert b["ttft_ms"] == {"p50": 330.0, "p90": 440.0, "later_p50": 330.0, "later_p90": 440.0}
    assert (a["turns"], a["served"], b["turns"], b["served"]) == (4, 4, 5, 4)
    assert a["history_hit_share"] == round(2 / 3, 3)
    assert b["history_hit_share"] == round(2 / 3, 3)
    assert a["reuse_ratio"] == round(5_484 / 10_000, 3)
    c = socket_check.compare(a, b)
    assert c["ttft_ms"]["p50"] == {"socket": 300.0, "sim": 330.0, "rel": 0.1, "within": True}
    assert c["decisions"]["local"] == {"socket": 0.75, "sim": 0.5, "diff": -0.25, "within": False}
    assert c["decisions"]["p2d"]["diff"] == 0.25
    assert (c["ttft_within"], c["decisions_within"]) == (True, False)
    assert not socket_check.compare(a, b, ttft_tolerance=0.05)["ttft_within"]
    p = socket_check.paired(socket, sim, 16)
    assert (p["matched"], p["same_decision"], p["same_work"]) == (4, 3, 3)
    assert p["same_work_ms"] == {"p10": -40.0, "p50": -20.0, "p90": -10.0}
    # Same work: -10 ms at 1k prompt tokens, -20 at 2k, -40 at 4k: -10 ms per 1k, nothing fixed.
    assert p["same_work_fit"] == {"fixed_ms": 0.0, "per_1k_prompt_tokens_ms": -10.0}
    assert socket_check.line_fit([(1.0, 3.0), (2.0, 5.0), (3.0, 7.0)]) == pytest.approx((1.0, 2.0))
    assert socket_check.line_fit([(1.0, 3.0), (1.0, 5.0)]) is None


def test_a_simulated_decode_keeps_what_it_decoded_for_an_extend_as_the_stand_in_does() -> None:
    """The socket check's first finding: the stand-in's decode keeps a request's KV for the next
    turn when it came with any params (kvshuttle's extend on the holder sends some, nothing to
    read); the simulated decode kept it only after reading prefill's, so every turn after an
    extend found no retention."""

    async def main() -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        fleet = Fleet(FleetConfig(PROFILE, prefill=1, decode=1, block_size=16, retain_decode=True))
        fleet.start()
        decode = fleet.decodes[0]
        tokens = np.arange(1_000, 1_200, dtype=np.uint32)
        keys = chain_array(tokens, 16)
        prompt = Prompt(tokens, keys, 7, keys.tolist())
        extended = await decode.complete(prompt, 8, extend_params())
        plain = await decode.complete(prompt, 8)
        await fleet.stop()
        return extended.params, plain.params

    extended, plain = vtime.run(main())
    assert extended is not None and extended["do_remote_decode"]
    assert extended["remote_num_tokens"] == 200 + 8 - 1
    assert plain is None  # no params: cached, not held
