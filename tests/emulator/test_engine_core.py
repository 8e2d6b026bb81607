"""The engine core (bench/emulator/core/engine.py) that both emulator surfaces drive: two cores
reading each other directly (the fleet simulator's transport), flat-timed, in one event loop.
vLLM's rules: a decode reads whatever its prefill computed; a prefill reads a decode's retained
blocks only when addressed and above `kv_recompute_threshold`, and the holder is freed either way;
what is held, and for how long, follows the params, not the engine's role; the host tier serves
its leading run and P2P reads take from a peer's."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from bench.emulator.core.engine import CoreConfig, EngineCore, KvLoadFailed

BS = 4


class Direct:
    """Reads straight from the holder the params name."""

    def __init__(self) -> None:
        self.cores: dict[str, EngineCore[int, int]] = {}

    async def read(self, params: Mapping[str, Any], skip_blocks: int, upto_blocks: int) -> list[int] | None:
        holder = self.cores.get(str(params.get("remote_engine_id")))
        ids = params["remote_block_ids"][0][skip_blocks:upto_blocks]
        got = holder.take(str(params["remote_request_id"]), ids) if holder else None
        return got

    async def read_host(self, params: Mapping[str, Any], keys: Sequence[int]) -> list[int]:
        holder = self.cores.get(str(params["p2p_source_engine"]))
        return holder.host.hits(keys) if holder else []


def core(direct: Direct, name: str, role: str, **kw: Any) -> EngineCore[int, int]:
    config = CoreConfig(name, role, BS, 64, kv_recompute_threshold=8, prefill_us_per_token=0.0,  # type: ignore[arg-type]
                        decode_ms_per_token=0.0, read_us_per_block=0.0, **kw)  # fmt: skip
    direct.cores[name] = made = EngineCore(config, direct)
    return made


def keys(n: int) -> list[int]:
    return list(range(1, n + 1))


async def serve(
    engine: EngineCore[int, int], n_keys: int, prompt: int, total: int, params: dict[str, Any]
) -> tuple[int, dict[str, Any] | None]:
    """One request: what it found, then its sequence kept (content = key: computed right)."""
    ks = keys(n_keys)
    found = await engine.find(ks[: prompt // BS], prompt, params)
    blocks = -(-total // BS)
    contents = found.contents[: found.tokens // BS] + ks[found.tokens // BS : blocks]
    contents += [-1] * (blocks - len(contents))
    return found.tokens, engine.keep(ks[: total // BS], contents, prompt, total, params)


async def test_a_turn_goes_p_to_d_and_back_by_vllms_rules() -> None:
    direct = Direct()
    p, d = core(direct, "p", "prefill"), core(direct, "d", "decode")
    found, to_d = await serve(p, 10, 20, 20, {"do_remote_decode": True})
    assert found == 0 and to_d is not None and to_d["do_remote_prefill"] and to_d["remote_num_tokens"] == 20
    found, back = await serve(d, 10, 20, 30, to_d)  # decode reads all its prefill computed
    assert found == 20 and p.pool.holdings() == 0  # read once: prefill's holding freed
    assert back is not None and back["do_remote_decode"] and back["remote_num_tokens"] == 30
    p.pool.clear()
    # The next turn's prefill: 30 retained tokens, 7 of them a partial block: read, partial included.
    found, _ = await serve(p, 10, 34, 34, back | {"do_remote_decode": True})
    assert found == 30 and d.pool.holdings() == 0 and p.counters.reads == 1


async def test_a_prefill_declines_reads_below_the_threshold_and_the_holder_is_freed_anyway() -> None:
    direct = Direct()
    p, d = core(direct, "p", "prefill"), core(direct, "d", "decode")
    _, to_d = await serve(p, 10, 20, 20, {"do_remote_decode": True})
    assert to_d is not None
    _, back = await serve(d, 10, 20, 24, to_d)
    assert back is not None
    found, _ = await serve(p, 10, 24, 24, back | {"do_remote_decode": True})  # 20 cached: 4 more < 8
    assert found == 20 and p.counters.reads_declined == 1 and d.pool.holdings() == 0
    _, again = await serve(d, 10, 20, 24, to_d | {"remote_request_id": "gone"})  # a read that fails
    assert again is not None and d.pool.holdings() == 1
    p.pool.clear()
    unaddressed = {k: v for k, v in again.items() if k != "remote_port"}
    assert (await serve(p, 10, 24, 24, unaddressed))[0] == 0  # vLLM neither reads nor notifies
    assert p.counters.reads == 0 and d.pool.holdings() == 1


async def test_holding_follows_the_params_not_the_role() -> None:
    direct = Direct()
    d = core(direct, "d", "decode")
    _, extended = await serve(d, 10, 20, 28, {"do_remote_decode": False, "do_remote_prefill": False})
    assert extended is not None and extended["do_remote_decode"]  # kvshuttle's extend retains
    assert (await serve(d, 10, 20, 28, {}))[1] is None  # no params: nothing held
    no_bidi = core(direct, "d2", "decode", retain_decode=False)
    assert (await serve(no_bidi, 10, 20, 28, {"do_remote_prefill": False}))[1] is None


async def test_a_failed_read_recomputes_or_fails_the_request_under_policy_fail() -> None:
    direct = Direct()
    gone = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "gone",
            "remote_block_ids": [[0, 1]], "remote_num_tokens": 8}  # fmt: skip
    core(direct, "p", "prefill")
    recomputes = core(direct, "d", "decode")
    found = await recomputes.find(keys(2), 8, gone)
    assert found.read_failed and found.tokens == 0 and recomputes.counters.read_failures == 1
    fails = core(direct, "f", "decode", kv_load_failure_policy="fail")
    with pytest.raises(KvLoadFailed):
        await fails.find(keys(2), 8, gone)


async def test_the_host_tier_serves_its_leading_run_and_peers_read_it_p2p() -> None:
    direct = Direct()
    a = core(direct, "a", "decode", host_blocks=4)
    b = core(direct, "b", "prefill")
    _, _ = await serve(a, 6, 24, 24, {})
    assert a.offload(keys(6), keys(6)) == [6, 5, 4, 3, 2, 1]  # stored head last: over capacity...
    assert a.host.leading(keys(6)) == 4 and len(a.host) == 4  # ...the tail goes, the head stays
    assert a.offload(keys(4), keys(4)) == []  # there already: touched
    a.pool.clear()
    found = await a.find(keys(6), 24, {})
    assert found.host_tokens == 16 and found.tokens == 16
    p2p = await b.find(keys(6), 24, {"p2p_source_engine": "a", "p2p_source_tokens": 24})
    assert p2p.read_tokens == 16 and p2p.contents == keys(4)


async def test_holdings_expire_on_a_timer() -> None:
    direct = Direct()
    d = core(direct, "d", "decode", kv_blocks_ttl=0.05)
    _, held = await serve(d, 10, 20, 24, {"do_remote_prefill": False})
    assert held is not None and d.pool.holdings() == 1
    await asyncio.sleep(0.2)
    assert d.pool.holdings() == 0 and d.counters.holdings_expired == 1
