"""The vLLM container's entry point (deploy/kubernetes/base/vllm-start.sh), run with /bin/sh as
the pods run it, with a stand-in for vLLM: a fresh engine id per start, put into the
kv_transfer_config and the file the agent beside it follows (kvshuttle.agent.engine_id)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvshuttle.agent.engine_id import read_engine_id

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


def test_the_agent_reads_the_id_vllm_start_writes(tmp_path: Path) -> None:
    # The agent (NODE__ENGINE_ID_FILE) follows this file: what the script writes is an id it takes.
    first, _ = run_vllm_start(tmp_path)
    assert read_engine_id(tmp_path / "engine-id") == first
