"""bench/report.py: every result file starts with the same header."""

from __future__ import annotations

import argparse
import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from bench.report import ROOT, save


def test_a_result_carries_the_header_and_the_figures_unchanged(tmp_path: Path) -> None:
    args = argparse.Namespace(turns=3, dir=tmp_path / "work")
    utc = datetime(2026, 12, 1, 21, 0, 5, tzinfo=UTC)
    out = save("router_bench", {"turns_per_s": 371.0, "rows": [1, 2]}, args=args, directory=tmp_path, utc=utc)

    assert out == tmp_path / "router_bench-20261201T210005Z.json"
    document = json.loads(out.read_text())
    header = document.pop("header")
    assert document == {"turns_per_s": 371.0, "rows": [1, 2]}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert header["bench"] == "router_bench"
    assert header["commit"] == head.stdout.strip()
    assert isinstance(header["dirty"], bool)
    assert header["args"] == {"turns": 3, "dir": str(tmp_path / "work")}  # a Path becomes its str
    assert header["utc"] == "2026-12-01T21:00:05+00:00"
    assert set(header["machine"]) == {"cpus", "python", "platform", "processor"}


def test_a_named_result_saved_again_at_the_same_time_is_one_file(tmp_path: Path) -> None:
    utc = datetime(2026, 12, 1, tzinfo=UTC)
    first = save("load", {"done": 1}, args=None, name="load-memory", directory=tmp_path, utc=utc)
    again = save("load", {"done": 2}, args=None, name="load-memory", directory=tmp_path, utc=utc)
    assert first == again and json.loads(again.read_text())["done"] == 2
    assert json.loads(again.read_text())["header"]["args"] is None
