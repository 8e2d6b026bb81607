"""What a test needs, as markers (pyproject.toml declares them), and the session header.

`vllm` and `redis` are added from the fixtures a test uses, so a new test that asks for the vLLM
pair or a Redis server is in its tier without being told; modules that start their own servers
mark themselves. Tests that start or restart real vLLM get a longer timeout than the default.
The session's first lines name the binaries the run uses (a Redis-protocol server, kubectl,
the vLLM venv).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from deploy.kubernetes.check import KubectlMissing, kubectl
from deploy.local.redis import RedisNotInstalled, redis_server_binary, redis_version
from deploy.local.vllm_venv import vllm_venv

# Fixtures that start (or build with) the real vLLM: the session's pair and its model.
VLLM_FIXTURES = frozenset({"vllm_pair", "vllm_model"})
# Fixtures that start a Redis-protocol server.
REDIS_FIXTURES = frozenset({"redis_server", "redis_client", "redis_installed"})
# A test on real vLLM may start the shared pair (about a minute here) or restart it.
VLLM_TIMEOUT_S = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & VLLM_FIXTURES:
            item.add_marker(pytest.mark.vllm)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if used & REDIS_FIXTURES or params.get("store_kind") == "redis":
            item.add_marker(pytest.mark.redis)
        if item.get_closest_marker("vllm") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(VLLM_TIMEOUT_S))


def pytest_sessionstart(session: pytest.Session) -> None:
    """The header's lines, written at every verbosity (`-q` hides pytest's own header)."""
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        for line in session_header():
            terminal.write_line(line)


def session_header() -> list[str]:
    try:
        binary = redis_server_binary()
        redis = f"{binary} ({redis_version(binary)})"
    except RedisNotInstalled as exc:
        redis = f"none: {exc}"
    try:
        kube = kubectl()
    except KubectlMissing:
        kube = "none"
    venv = vllm_venv()
    vllm = str(venv) if (venv / "bin" / "python").exists() else f"none ({venv}: make vllm)"
    return [
        f"kvshuttle: python {sys.version.split()[0]} at {Path(sys.executable).parent}",
        f"kvshuttle: redis server {redis}",
        f"kvshuttle: kubectl {kube}",
        f"kvshuttle: vLLM venv {vllm}",
    ]
