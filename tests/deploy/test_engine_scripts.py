"""The engine pods' entry points (deploy/kubernetes/base/*.sh), run with /bin/sh as the pods run
them, with stand-ins for vLLM and the agent: a fresh engine id per vLLM start, put into the
kv_transfer_config and the shared file; the agent registers that id and is stopped (to be
restarted by the kubelet) when vLLM starts again with another; SIGTERM reaches the agent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BASE = Path(__file__).resolve().parents[2] / "deploy/kubernetes/base"
KV_CONFIG = '{"kv_connector": "NixlConnector", "engine_id": "@ENGINE_ID@"}'


def stand_in(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


def run_vllm_start(tmp: Path) -> tuple[str, list[str]]:
    """Start vllm-start.sh once; (the id file's content, the argv the engine got)."""
    engine = stand_in(tmp / "python3", "import json, sys; print(json.dumps(sys.argv[1:]))")
    env = {
        "PATH": os.environ["PATH"],
        "POD_NAME": "kvshuttle-vllm-decode-0",
        "KVSHUTTLE_ENGINE_ID_FILE": str(tmp / "engine-id"),
        "KV_TRANSFER_CONFIG": KV_CONFIG,
        "ENGINE_PYTHON": str(engine),
    }
    done = subprocess.run(
        ["/bin/sh", str(BASE / "vllm-start.sh"), "--port=8000"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return (tmp / "engine-id").read_text().strip(), json.loads(done.stdout)


def test_vllm_starts_with_a_fresh_engine_id_each_time(tmp_path: Path) -> None:
    first, argv = run_vllm_start(tmp_path)
    assert argv[:3] == ["-m", "vllm.entrypoints.openai.api_server", "--port=8000"]
    assert argv[3] == "--kv-transfer-config"
    assert json.loads(argv[4]) == {"kv_connector": "NixlConnector", "engine_id": first}
    assert first.startswith("kvshuttle-vllm-decode-0-") and len(first) == len("kvshuttle-vllm-decode-0-") + 8
    second, _ = run_vllm_start(tmp_path)
    assert second != first
    assert not (tmp_path / "engine-id.tmp").exists()


def start_agent(tmp: Path) -> subprocess.Popen[str]:
    agent = stand_in(
        tmp / "agent",
        "import os, signal, sys, time\n"
        "out = open(os.environ['OUT'], 'a')\n"
        "out.write('started ' + os.environ['KVSHUTTLE_AGENT_NODE__ENGINE_ID'] + '\\n'); out.flush()\n"
        "signal.signal(signal.SIGTERM, lambda *_: (out.write('drained\\n'), out.flush(), sys.exit(0)))\n"
        "time.sleep(60)\n",
    )
    env = {
        "PATH": os.environ["PATH"],
        "KVSHUTTLE_ENGINE_ID_FILE": str(tmp / "engine-id"),
        "AGENT_COMMAND": str(agent),
        "ENGINE_ID_POLL_S": "0.1",
        "OUT": str(tmp / "agent.log"),
    }
    return subprocess.Popen(
        ["/bin/sh", str(BASE / "agent-start.sh")], env=env, text=True, stderr=subprocess.PIPE
    )


def wait_for_log(tmp: Path, lines: list[str]) -> None:
    deadline = time.monotonic() + 20
    log = tmp / "agent.log"
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().splitlines() == lines:
            return
        time.sleep(0.05)
    raise AssertionError(f"agent log {log.read_text() if log.exists() else None!r}, want {lines}")


def test_the_agent_registers_the_engine_id_and_stops_when_it_changes(tmp_path: Path) -> None:
    proc = start_agent(tmp_path)
    try:
        time.sleep(0.3)
        assert proc.poll() is None and not (tmp_path / "agent.log").exists()  # waits for vLLM
        (tmp_path / "engine-id").write_text("decode-0-aaaaaaaa\n")
        wait_for_log(tmp_path, ["started decode-0-aaaaaaaa"])
        (tmp_path / "engine-id").write_text("decode-0-bbbbbbbb\n")  # vLLM started again
        assert proc.wait(timeout=20) == 0
        wait_for_log(tmp_path, ["started decode-0-aaaaaaaa", "drained"])
        assert proc.stderr is not None and "agent.engine_id_changed" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_reaches_the_agent(tmp_path: Path) -> None:
    (tmp_path / "engine-id").write_text("prefill-0-cccccccc\n")
    proc = start_agent(tmp_path)
    try:
        wait_for_log(tmp_path, ["started prefill-0-cccccccc"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        wait_for_log(tmp_path, ["started prefill-0-cccccccc", "drained"])
    finally:
        proc.kill()
        proc.wait()
