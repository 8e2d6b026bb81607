"""bench/reproduce: the published bidirectional-transfer table on the emulator. Simulated, the
published fit reproduces the 24k point within 10 % and misses the 2k one by its own fit's error;
over sockets, a tiny 1P1D session reads D's KV on its reuse turn and not on its recompute one."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.emulator.http.tokenizer import make_tokenizer
from bench.reproduce import (
    PUBLISHED,
    PUBLISHED_PROFILE,
    TARGET,
    Sessions,
    measured,
    read_bytes,
    simulated,
    verdict,
)
from deploy.profiles.schema import load_engine_profiles

(PROFILE,) = load_engine_profiles(PUBLISHED_PROFILE)


def test_the_published_fit_reproduces_24k_within_10_percent_and_misses_2k_by_its_own_error() -> None:
    rows = {row.context: row for row in simulated(PROFILE, [2048, 24576], 256)}
    for context, row in rows.items():
        # Unchunked, the emulator is the router's cost model exactly: any miss is the fit's.
        transfer = PROFILE.link.ms(read_bytes(PROFILE, context - 256))
        assert row.transfer_ms == pytest.approx(transfer)
        assert row.recompute_ms == pytest.approx(PROFILE.prefill.ms(context, 0))
        assert row.reuse_ms == pytest.approx(transfer + PROFILE.prefill.ms(256, context - 256))
    far, pub = rows[24576], PUBLISHED[24576]
    assert far.recompute_ms == pytest.approx(pub.recompute_ms, rel=TARGET)
    assert far.reuse_ms == pytest.approx(pub.reuse_ms, rel=TARGET)
    assert far.transfer_ms == pytest.approx(pub.transfer_ms, rel=TARGET)
    assert verdict(far) == "PASS"
    # The fit (three coefficients, least squares over four TTFTs) is 16 ms off at 2k: recompute
    # 10.4 % low, reuse 12.5 % high. A refit, not the emulator, would close it.
    near, pub = rows[2048], PUBLISHED[2048]
    assert near.recompute_ms == pytest.approx(pub.recompute_ms * (1 - 0.104), rel=0.005)
    assert near.reuse_ms == pytest.approx(pub.reuse_ms * (1 + 0.125), rel=0.005)
    assert near.transfer_ms == pytest.approx(pub.transfer_ms, rel=TARGET)
    assert verdict(near) == "MISS"


async def test_a_tiny_socket_session_reuses_on_its_reuse_turn(tmp_path: Path) -> None:
    model_dir = make_tokenizer(tmp_path / "model")
    rows, raw = await measured(PROFILE, model_dir, Sessions([1024], 256, 4), sessions=1, time_scale=0.02)
    (row,) = rows
    # The corrected TTFTs subtract a second run's engine CPU time, scaled up 50 times here: on a
    # loaded machine they can be anything, so only what sleeps bound is asserted (no timing).
    assert row.context == 1024
    (figures,) = raw["per_context"]
    read_ms = PROFILE.link.ms(read_bytes(PROFILE, 768))
    assert figures["ttft_ms_uncorrected"]["reuse"] >= 0.98 * read_ms  # the read is on its path
    # One measured turn per mode (after its fill turn); only reuse read D's 768 tokens.
    by_mode = {s["mode"]: s for s in raw["samples"]}
    assert len(raw["samples"]) == 2
    assert by_mode["recompute"]["transfer_ms"] == 0
    assert by_mode["reuse"]["transfer_ms"] >= 0.98 * PROFILE.link.ms(read_bytes(PROFILE, 768))
    # The toy proxy's TTFT waits for D's first token after P's.
    assert all(s["proxy_ttft_ms"] > s["ttft_ms"] for s in raw["samples"])
