"""RetentionHints: bounded by bytes, least recently used first out, one per conversation."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from prometheus_client import CollectorRegistry

from kvshuttle.router.chains import ChainCache
from kvshuttle.router.hints import RetentionHints
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.model import RetentionInfo
from kvshuttle.router.turn_memory import TurnMemory


def retention(conversation: str, generation: int, blocks: int) -> RetentionInfo:
    return RetentionInfo(
        name=f"{conversation}/retentions/{generation}",
        node="nodes/d0",
        generation=generation,
        model="m",
        block_size=16,
        num_tokens=blocks * 16,
        block_hashes=np.arange(blocks, dtype=np.uint64),
        kv_transfer_params={"remote_block_ids": [list(range(blocks))]},
        expire_at=100.0,
        claimed=False,
    )


def test_a_conversation_keeps_only_its_latest_hint() -> None:
    hints = RetentionHints(1 << 20)
    hints.put("c1", retention("c1", 1, 10))
    size = hints.nbytes
    hints.put("c1", retention("c1", 2, 10))
    assert len(hints) == 1 and hints.nbytes == size
    got = hints.get("c1")
    assert got is not None and got.generation == 2
    hints.forget("c1")
    hints.forget("c1")  # forgetting twice is harmless
    assert hints.get("c1") is None and hints.nbytes == 0


def test_the_bound_evicts_the_least_recently_used() -> None:
    probe = RetentionHints(1 << 20)
    probe.put("a", retention("a", 1, 100))
    per_entry = probe.nbytes
    assert 100 * 8 + 100 * 8 < per_entry < 10_000  # hashes, block ids and the fixed part
    hints = RetentionHints(3 * per_entry)
    for name in "abc":
        hints.put(name, retention(name, 1, 100))
    assert hints.get("a") is not None  # now the most recently used
    hints.put("d", retention("d", 1, 100))
    assert hints.get("b") is None  # the least recently used went
    assert all(hints.get(name) is not None for name in "acd")
    assert hints.nbytes == 3 * per_entry
    # One retention larger than the whole bound is not kept (and evicts nothing).
    hints.put("huge", retention("huge", 1, 10_000))
    assert hints.get("huge") is None and len(hints) == 3


def test_the_caches_are_exported_as_metrics() -> None:
    registry = CollectorRegistry()
    chains, hints = ChainCache(1 << 20), RetentionHints(1 << 20)
    memory = TurnMemory(remembered_turns=10, hint_bytes=1 << 20)
    RouterMetrics(registry).watch_caches(chains, hints, memory.prompts)
    memory.hold_prompt("t1", np.arange(100, dtype=np.uint32))
    tokens = np.arange(64, dtype=np.uint32)
    chains.chain("c1", tokens, 16)  # hashed whole
    chains.chain("c1", np.arange(80, dtype=np.uint32), 16)  # extends the remembered prefix
    hints.put("c1", retention("c1", 1, 10))

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("kvshuttle_router_chain_lookups_total", outcome="hit") == 1
    assert sample("kvshuttle_router_chain_lookups_total", outcome="miss") == 1
    assert sample("kvshuttle_router_cache_entries", cache="chains") == 1
    assert sample("kvshuttle_router_cache_entries", cache="hints") == 1
    assert sample("kvshuttle_router_cache_bytes", cache="hints") == hints.nbytes > 0
    assert sample("kvshuttle_router_cache_bytes", cache="chains") == chains.nbytes > 0
    assert sample("kvshuttle_router_cache_entries", cache="prompts") == 1
    assert sample("kvshuttle_router_cache_bytes", cache="prompts") == memory.prompts.nbytes >= 400


def test_the_bound_counts_a_retentions_known_tokens() -> None:
    hints = RetentionHints(1 << 20)
    hints.put("c1", retention("c1", 1, 100))
    plain = hints.nbytes
    known = np.arange(2048, dtype=np.uint32)
    hints.put("c1", replace(retention("c1", 1, 100), known_from_block=36, known_tokens=known))
    assert hints.nbytes == plain + known.nbytes
    # Enough of them and the retention is not kept at all.
    small = RetentionHints(plain + 1024)
    small.put("c1", replace(retention("c1", 1, 100), known_tokens=np.arange(512, dtype=np.uint32)))
    assert small.get("c1") is None and small.nbytes == 0
