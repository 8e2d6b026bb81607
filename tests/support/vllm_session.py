"""The real vLLM pair (CPU build, tiny model), started once per pytest session (offered by
tests/conftest.py, so the e2e and the chaos tests share one).

`vllm_pair` yields a started `deploy.local.launch.VllmPair` (prefill on core 0, decode on core 1;
`pair.describe()` has every endpoint). It skips, saying why, when the vLLM venv is missing (run
`make vllm` / deploy/vllm/install.sh). Starting takes ~80-100 s on two cores. Tests that use it
carry the `vllm` marker (`pytest -m "not vllm"` leaves them out). Logs go to a pytest temp dir,
and a failed start reports the tail of each log.

Set KVSHUTTLE_VLLM_LOG_DIR to keep the logs somewhere else.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy.local.launch import VllmPair
from deploy.local.vllm_venv import VllmNotInstalled, ensure_model, vllm_python

E2E_BLOCKS = 1024


def _progress(name: str, elapsed: float, milestone: str) -> None:
    print(f"[vllm pair {elapsed:4.0f} s] {name}: {milestone}", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def vllm_model() -> Path:
    """The tiny test model (built once, cached under .run/models)."""
    try:
        vllm_python()
    except VllmNotInstalled as exc:
        if os.environ.get("KVSHUTTLE_REQUIRE_VLLM"):
            pytest.fail(f"KVSHUTTLE_REQUIRE_VLLM is set: {exc}")
        pytest.skip(str(exc))
    return ensure_model("tiny")


@pytest.fixture(scope="session")
def vllm_pair(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmPair]:
    """A started prefill/decode pair, shared by the whole session; stopped at its end."""
    configured = os.environ.get("KVSHUTTLE_VLLM_LOG_DIR")
    log_dir = Path(configured) if configured else tmp_path_factory.mktemp("vllm-logs")
    # Prefix caching off on prefill, as in vLLM's published benchmark: otherwise prefill's own
    # cache holds each turn's prompt and a reuse turn reads only decode's answer from decode.
    # 1024 blocks of 32 tokens per engine: room for every test's turns (decode pins retained
    # blocks for its TTL), small enough that a few long prompts make decode evict (BlockRemoved).
    pair = VllmPair(
        vllm_model,
        log_dir=log_dir,
        block_size=32,
        progress=_progress,
        prefill_prefix_caching=False,
        # The tool parser serves the single-server chat references of tool-calling turns.
        extra_args=(
            "--num-gpu-blocks-override",
            str(E2E_BLOCKS),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ),
    )
    pair.start()  # stops both itself when the start fails
    try:
        yield pair
    finally:
        pair.stop()
