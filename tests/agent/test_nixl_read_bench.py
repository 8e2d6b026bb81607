"""bench.nixl_read's core on tiny sizes: a holder process and this one READ over NIXL with the
progress thread off, against memcpy, and the figures come out whole."""

from __future__ import annotations

from bench.nixl_read import KIB, Case, read_transports, report, run


def test_the_benchmark_reads_across_processes_and_reports() -> None:
    result = run([Case(64 * KIB, 8, reps=3)], [Case(4 * KIB, 2, reps=5)])
    (row,) = result["bandwidth"]
    assert row["block_bytes"] == 64 * KIB and row["blocks"] == 8
    for figures in (row["read_gbps"], row["memcpy_gbps"]):
        assert 0 < figures["p10"] <= figures["p50"] <= figures["p90"]
    assert row["ratio"] > 0
    (latency,) = result["latency"]
    assert 0 < latency["read_us"]["p50"] <= latency["read_us"]["p99"]
    assert result["read_transports"]  # UCX reported what it chose for the READs
    assert "2 x 4 KiB" in report(result)


def test_read_transports_come_from_the_remote_read_tables_only() -> None:
    log = """
    | h1 intra-node cfg#1                                      |
    | remote memory write by ucp_put* from host memory to host |
    |   0..inf | zero-copy   | cma/memory                       |
    | r1 intra-node cfg#1                                      |
    | remote memory read by ucp_get*(multi) into host memory   |
    | Range  | Description | Config                            |
    |   0..8184 | short      | tcp/lo                           |
    | 8185..inf | zero-copy  | cma/memory                       |
    | a1 intra-node cfg#2                                      |
    |   0..inf | zero-copy   | posix/memory                     |
    """
    assert read_transports(log) == ["tcp/lo", "cma/memory"]
