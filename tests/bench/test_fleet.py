"""bench/fleet: the fleet simulator. Virtual time (no wall-clock waits, no sockets or threads), the
engines' KV memory (blocks conserved, a prefix evicted tail first), and short simulated runs of
every policy: the same seed gives byte-identical per-turn records, no policy but the seed's proxy
answers wrong, and the proxy does when a history is not the one its KV holds."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from bench.cluster.workload.agent import AgentLoop, generate
from bench.cluster.workload.model import Request, Session, StopReason
from bench.emulator.core.pool import BlockPool, CacheFull
from bench.emulator.fleet import vtime
from bench.fleet import report
from bench.fleet.replay import Arrival
from bench.fleet.run import POLICIES, RunSpec, run
from deploy.profiles.schema import load_engine_profiles

PROFILE = load_engine_profiles(Path(__file__).parents[2] / "deploy/profiles/qwen3-32b-h200-tp2.toml")[0]


# -- virtual time --------------------------------------------------------------------------------


def test_virtual_time_jumps_to_the_next_timer_without_waiting() -> None:
    async def main() -> tuple[float, list[float]]:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)

        async def at(delay: float) -> float:
            await asyncio.sleep(delay)
            return loop.time()

        times = await asyncio.gather(at(2.0), at(1.0))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(30):
                await asyncio.Event().wait()
        return loop.time(), list(times)

    began = time.monotonic()
    end, times = vtime.run(main())
    assert (end, times) == (3632.0, [3602.0, 3601.0])
    assert time.monotonic() - began < 5  # an hour and a half-minute of timers, not waited for


def test_virtual_time_runs_same_instant_timers_in_the_order_set_and_lands_on_their_time() -> None:
    """Ties in the order set (asyncio's heap orders them by position, so a run's records depended
    on how many other timers were pending), the clock exactly on a timer's time."""

    async def main() -> tuple[list[int], float, float]:
        loop = asyncio.get_running_loop()
        order: list[int] = []
        for i in (3, 1, 4, 0, 2, 5):
            loop.call_at(5.0, order.append, i)
        loop.call_at(4.0, lambda: loop.call_at(5.0, order.append, 9))
        await asyncio.sleep(0.1)
        at = loop.time()
        await asyncio.sleep(6.0)
        return order, at, loop.time()

    order, at, end = vtime.run(main())
    assert order == [3, 1, 4, 0, 2, 5, 9]
    assert (at, end) == (0.1, 6.1)


def test_virtual_time_refuses_threads_and_sockets_and_reports_a_deadlock() -> None:
    async def thread() -> None:
        await asyncio.to_thread(print)

    async def connect() -> None:
        await asyncio.open_connection("127.0.0.1", 1)

    async def stuck() -> None:
        await asyncio.get_running_loop().create_future()

    for main in (thread, connect):
        with pytest.raises(vtime.VirtualTimeError):
            vtime.run(main())
    with pytest.raises(vtime.VirtualTimeError, match="deadlock"):
        vtime.run(stuck())
    # The refusal is the loop's: a real socket still works outside it.
    socket.socket().close()


# -- the engines' KV memory ----------------------------------------------------------------------


def _keys(n: int, base: int = 0) -> list[int]:
    return list(range(base + 1, base + n + 1))


def _conserved(pool: BlockPool[int, int]) -> None:
    free, idle, blocks = len(pool._free), len(pool._idle), len(pool._blocks)
    assert free + blocks == pool.num_blocks
    assert 0 <= idle <= blocks and set(pool._idle) <= set(pool._cached)
    assert sum(b.refs == 0 for b in pool._blocks.values()) == idle


def test_block_pool_conserves_blocks_and_evicts_a_prefix_tail_first() -> None:
    removed: list[int] = []
    pool: BlockPool[int, int] = BlockPool(10, 4, on_removed=removed.extend)
    a = pool.place(_keys(6), _keys(6))
    pool.release(a)
    _conserved(pool)
    assert pool.hits(_keys(6)) == _keys(6)
    held = pool.place(_keys(5, 100), [*_keys(5, 100), -1])  # 5 full blocks and a partial: evicts 2 of a's
    _conserved(pool)
    assert removed == [6, 5]  # the tail of a's prefix, not its head
    assert pool.hits(_keys(6)) == _keys(4)
    pool.hold("h", held, expires_at=10.0)
    assert pool.take_leading("h", 5) == _keys(5, 100)  # read once...
    assert pool.take_leading("h", 5) is None  # ...and gone
    _conserved(pool)
    with pytest.raises(CacheFull):
        pool.place(_keys(11, 200), _keys(11, 200))
    assert pool.used_blocks() == 0


# -- short runs ----------------------------------------------------------------------------------


def _spec(policy: str, sessions: list[Session], *, seed: int = 1) -> RunSpec:
    return RunSpec(
        policy=policy,
        workload="agent",
        rate=1.0,
        seed=seed,
        profile=PROFILE,
        prefill=2,
        decode=2,
        arrivals=[Arrival(float(i), s) for i, s in enumerate(sessions)],
        max_model_len=131_072,
    )


@pytest.fixture(scope="module")
def agent_sessions() -> list[Session]:
    """Four agent sessions, at most six turns each (think times and all)."""
    return [replace(s, requests=s.requests[:6]) for s in generate(AgentLoop(), sessions=4, seed=3)]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_short_run_is_deterministic_answers_right_and_conserves_blocks(
    policy: str, agent_sessions: list[Session]
) -> None:
    spec = _spec(policy, agent_sessions)
    first, again = run(spec), run(spec)
    records = [asdict(r) for r in first.result.records]
    assert records
    assert json.dumps(records) == json.dumps([asdict(r) for r in again.result.records])
    assert first.result.itl_s == again.result.itl_s
    assert all(r["ttft_s"] is not None and not r["error"] for r in records)
    assert not any(r["wrong"] for r in records)
    audits = {e: {k: v for k, v in c.items() if k.startswith("audit_")} for e, c in first.engines.items()}
    assert all(set(a.values()) == {0} for a in audits.values()), audits  # no block leaked


def test_the_proxy_answers_wrong_when_the_history_is_not_the_one_its_kv_holds() -> None:
    """A second request that does not extend the first (a compacted context): the proxy hands
    decode's KV of the first to the second's prefill, which reads it unchecked; kvshuttle
    verifies the prefix and recomputes."""
    first = Request(4000, 50, tuple(range(1, 64)), stop_reason=StopReason.TOOL_CALLS, think_time_ms=0.0)
    edited = tuple(range(1, 40)) + tuple(range(1000, 1030))  # the head kept, the rest replaced
    second = Request(4400, 50, edited, think_time_ms=1000.0)
    session = Session("s", 64, (first, second))
    wrong = {p: sum(r.wrong for r in run(_spec(p, [session])).result.records) for p in ("proxy", "kvshuttle")}
    assert wrong == {"proxy": 1, "kvshuttle": 0}


def test_a_fleet_with_more_turns_in_flight_than_its_bound_collapses_there_and_misses(
    agent_sessions: list[Session],
) -> None:
    """Past `collapse_in_flight_per_engine` turns in flight the run stops: the turns in flight are
    cut (misses), no turn is sent after, and the run is not in the SLO however fast the rest was."""
    sessions = [replace(s, session_id=f"{s.session_id}-{k}") for k in range(3) for s in agent_sessions]
    spec = replace(_spec("recompute", sessions), arrivals=[Arrival(0.0, s) for s in sessions])
    whole = run(spec)
    assert whole.result.collapsed_at_s is None
    collapsed = run(replace(spec, collapse_in_flight_per_engine=2))  # 8 turns in flight at 2P+2D
    at = collapsed.result.collapsed_at_s
    assert at is not None
    cut = [r for r in collapsed.result.records if r.error == "cut"]
    assert len(cut) >= 9 and all(r.sent_s <= at for r in collapsed.result.records)
    assert len(collapsed.result.records) < len(whole.result.records)
    row = report.figures(collapsed)
    assert row["collapsed_at_s"] == round(at, 1) and not row["slo_ok"]
    assert row["missed"] >= 9
    # An engine with more requests queued than `collapse_waiting` is a collapse too.
    queued = run(replace(spec, collapse_waiting=1))
    assert queued.result.collapsed_at_s is not None
    assert any(r.error == "cut" for r in queued.result.records)


# -- the summary tools read ----------------------------------------------------------------------


def _row(
    policy: str, rate: float, seed: int, ok: bool, p99: float = 100.0, wrong: int = 0
) -> dict[str, object]:
    return {
        "workload": "agent",
        "policy": policy,
        "rate": rate,
        "seed": seed,
        "slo_ok": ok,
        "wrong": wrong,
        "ttft_later_ms": {"p50": 1.0, "p90": 2.0, "p99": p99},
    }


def test_capacity_is_the_highest_rate_met_with_every_lower_one_and_the_summary_compares_there() -> None:
    rows = [
        _row("llm-d", 1.0, 1, True, 300.0),
        _row("llm-d", 2.0, 1, True, 900.0),
        _row("llm-d", 4.0, 1, False),
        _row("llm-d", 1.0, 2, True),
        _row("llm-d", 2.0, 2, False),
        _row("llm-d", 4.0, 2, True),  # met again past a miss: not capacity
        _row("kvshuttle", 1.0, 1, False, wrong=0),
        _row("kvshuttle", 2.0, 1, False, 5000.0),
        _row("proxy", 1.0, 1, True, wrong=3),
    ]
    summary = report.summary(rows, gpus=4)
    caps = summary["capacity_per_gpu"]["agent"]
    assert caps["llm-d"] == {"median": 0.375, "seeds": [0.5, 0.25]}
    assert caps["kvshuttle"] == {"median": 0.0, "seeds": [0.0]}
    assert report.best_peer_rates(rows, gpus=4) == {"agent": 1.0}  # llm-d's median 1.5/s: 1 is nearest
    assert summary["ttft_p99_later_at_best_peer_capacity_ms"]["agent"]["llm-d"] == 200.0  # median of 300, 100
    assert summary["wrong"]["agent"] == {"llm-d": 0, "kvshuttle": 0, "proxy": 3}
    assert summary["policies"] == ["kvshuttle", "llm-d", "proxy"] and summary["seeds"] == [1, 2]
