"""The registry walkthrough (`make demo-registry`) end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[1] / "deploy" / "registry_demo.py"


def test_demo_runs_and_stops_cleanly(tmp_path: Path) -> None:
    env = dict(os.environ, KVSHUTTLE_DEMO_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, str(DEMO)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "ABORTED (RETENTION_ALREADY_CLAIMED)" in out
    assert "ABORTED (FENCING_GENERATION_STALE)" in out
    assert "NOT_FOUND (RETENTION_NOT_FOUND): retention tenants/demo/conversations/chat-2/retentions/1" in out
    watched = out.split("what a watcher of the tenant saw")[1]
    assert "expired    tenants/demo/conversations/chat-2/retentions/1" in watched
    assert "registry exited with code 0" in out
    assert "Traceback" not in out + done.stderr
