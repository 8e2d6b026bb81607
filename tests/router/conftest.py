"""The router domain tests' cluster: an in-process registry with one prefill and one decode node
(tests/router/domain_cluster.py); a module that needs another defines its own `cluster`."""

from __future__ import annotations

import pytest
from tests.router.domain_cluster import Cluster

from kvshuttle.core.nodes import NodeRole


@pytest.fixture
async def cluster() -> Cluster:
    c = Cluster()
    await c.add_node("nodes/p0", NodeRole.PREFILL)
    await c.add_node("nodes/d0", NodeRole.DECODE)
    return c
