"""The deploy tests' fixtures."""

from __future__ import annotations

import pytest
from tests.support.redis_server import redis_binary


@pytest.fixture
def redis_installed() -> None:
    """Skips the test without a Redis-protocol server (deploy/local/redis.py resolves it); fails
    instead where KVSHUTTLE_REQUIRE_REDIS is set, as in CI."""
    redis_binary()
