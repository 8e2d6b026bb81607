"""vLLM start-up as a person sees it: milestones read from a real vLLM 0.32 log, the fd limit."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest
from deploy.local import vllm_venv
from deploy.local.milestones import MilestoneReader
from deploy.local.processes import free_ports
from deploy.local.vllm_engine import EngineSpec, VllmEngine, raise_fd_limit

# The start-up part of a real `make demo` prefill log (small model; vLLM's route list left out).
STARTUP_LOG = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32.0-cpu-startup.log"
EXPECTED = [
    ("engine_core", "engine core starting (vLLM 0.32.0)"),
    ("weights", "weights loaded (0.21 GiB, 1.00 s)"),
    ("kv_cache", "KV cache sized (65,536 tokens = 2,048 blocks of 32, 1.0 GiB)"),
    ("nixl", "NIXL connector ready (UCX)"),
]


def startup_lines() -> list[str]:
    return STARTUP_LOG.read_text().splitlines()


def test_a_real_start_log_gives_each_milestone_once_in_order() -> None:
    reader = MilestoneReader(block_size=32)
    seen = [m for i, line in enumerate(startup_lines()) for m in reader.feed(line, float(i))]
    assert [(m.key, m.text) for m in seen] == EXPECTED
    assert [m.elapsed_s for m in seen] == sorted(m.elapsed_s for m in seen)
    assert [m for line in startup_lines() for m in reader.feed(line, 99.0)] == []  # once each


def test_warnings_are_not_milestones() -> None:
    lines = startup_lines()
    noisy = [line for line in lines if "WARNING" in line or "Warning" in line]
    assert any("ulimit -n" in line for line in noisy)  # what alarmed new users
    reader = MilestoneReader(block_size=32)
    assert [m for line in noisy for m in reader.feed(line, 1.0)] == []


def test_weights_of_a_tiny_model() -> None:
    reader = MilestoneReader()
    size, took = (  # from a real start of the tiny test model
        "(Worker pid=16372) INFO 12-01 11:33:22 [weight_utils.py:1108] Filesystem type for checkpoints: "
        "EXT4. Checkpoint size: 0.00 GiB. Available RAM: 20.33 GiB.",
        "(Worker pid=16372) INFO 12-01 11:33:22 [default_loader.py:501] Loading weights took 0.02 seconds",
    )
    assert reader.feed(size, 1.0) == []
    [milestone] = reader.feed(took, 2.0)
    assert milestone.text == "weights loaded (< 0.01 GiB, 0.02 s)"


def test_kv_cache_without_a_block_size_or_the_cpu_size_line() -> None:
    line = next(line for line in startup_lines() if "KV cache size:" in line)
    [milestone] = MilestoneReader().feed(line, 3.0)
    assert milestone.text == "KV cache sized (65,536 tokens)"


def test_process_start_and_readiness_are_reported_once() -> None:
    reader = MilestoneReader()
    [started] = reader.started(41, "/logs/prefill-1.log")
    assert started.text == "process started (pid 41; full log /logs/prefill-1.log)"
    assert started.elapsed_s == 0.0
    [ready] = reader.ready("http://127.0.0.1:8000", 42.5)
    assert (ready.text, ready.elapsed_s) == ("ready (HTTP up at http://127.0.0.1:8000)", 42.5)
    assert reader.started(41, "x") == reader.ready("y", 50.0) == []


FAKE_VLLM = """#!{python}
# Stands in for vLLM's API server: writes a real start-up log, then answers /health.
import http.server, sys, time
text = open({log!r}).read()
cut = text.index("Loading weights took") + len("Loading weights took 1.")
sys.stdout.write(text[:cut]); sys.stdout.flush()
time.sleep(0.5)  # a line split across two reads of the log
sys.stdout.write(text[cut:]); sys.stdout.flush()

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_an_engine_reports_its_milestones_while_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_VLLM.format(python=sys.executable, log=str(STARTUP_LOG)))
    python.chmod(0o755)
    monkeypatch.setenv(vllm_venv.VENV_ENV, str(tmp_path / "venv"))
    http, side, events, replay = free_ports(4)
    spec = EngineSpec("prefill", "prefill", tmp_path, http, side, events, replay)
    engine = VllmEngine(spec, tmp_path / "logs")
    reported: list[tuple[str, float, str]] = []
    engine.start()
    pid = engine.pid
    try:
        took = engine.wait_ready(timeout=30, progress=lambda *args: reported.append(args), interval=0.05)
    finally:
        engine.stop()
    assert [name for name, _, _ in reported] == ["prefill"] * 6
    texts = [text for _, _, text in reported]
    assert texts[0] == f"process started (pid {pid}; full log {engine.log_path})"
    assert texts[1:5] == [text for _, text in EXPECTED]
    assert texts[5] == f"ready (HTTP up at {engine.url})"
    assert reported[5][1] == took
    assert engine.take_milestones() == []


class FakeLimits:
    def __init__(self, soft: int, hard: int, *, may_raise_hard: bool) -> None:
        self.limits = (soft, hard)
        self.may_raise_hard = may_raise_hard

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        if limits[1] > self.limits[1] and not self.may_raise_hard:
            raise ValueError("not allowed to raise maximum limit")
        self.limits = limits


@pytest.mark.parametrize(
    ("soft", "hard", "may_raise_hard", "after"),
    [
        (1024, resource.RLIM_INFINITY, False, (1024, resource.RLIM_INFINITY)),  # vLLM raises it
        (1024, 1048576, False, (1024, 1048576)),  # likewise
        (1024, 20000, True, (65535, 65535)),  # CAP_SYS_RESOURCE: vLLM's target
        (1024, 20000, False, (20000, 20000)),  # the most vLLM would not take
        (20000, 20000, False, (20000, 20000)),
    ],
)
def test_fd_limit(
    monkeypatch: pytest.MonkeyPatch, soft: int, hard: int, may_raise_hard: bool, after: tuple[int, int]
) -> None:
    fake = FakeLimits(soft, hard, may_raise_hard=may_raise_hard)
    monkeypatch.setattr(resource, "getrlimit", fake.getrlimit)
    monkeypatch.setattr(resource, "setrlimit", fake.setrlimit)
    assert raise_fd_limit() == after[0]
    assert fake.limits == after
