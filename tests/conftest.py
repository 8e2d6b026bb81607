"""Shared fixtures: a real registry gRPC server on 127.0.0.1 port 0, on a fake clock; the
session's real vLLM pair (tests/support/vllm_session.py), one for the e2e and the chaos tests alike;
the markers a test's fixtures imply and the session's header lines (tests/support/markers.py);
on a timeout, every asyncio task's awaits (tests/support/task_dump.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from tests.support.markers import pytest_collection_modifyitems, pytest_sessionstart
from tests.support.registry_env import RegistryEnv, start_registry
from tests.support.task_dump import pytest_timeout_set_timer
from tests.support.vllm_session import vllm_model, vllm_pair

# Session fixtures and hooks defined elsewhere, offered to every test directory from here.
__all__ = [
    "pytest_collection_modifyitems",
    "pytest_sessionstart",
    "pytest_timeout_set_timer",
    "vllm_model",
    "vllm_pair",
]


@pytest.fixture
async def registry_env() -> AsyncIterator[RegistryEnv]:
    env = await start_registry()
    yield env
    await env.channel.close()
    env.registry.close()
    await env.server.stop()
