"""An agent's scope covers its node's pool node and nothing else (kvshuttle.core.auth)."""

from __future__ import annotations

import pytest

from kvshuttle.core.auth import Caller, Permission, Role, authorize
from kvshuttle.core.errors import PermissionDenied


def test_an_agent_acts_for_its_node_and_its_pool_node_only() -> None:
    agent = Caller("spiffe://kvshuttle/agent/x", Role.AGENT, node="nodes/x")
    for node in ("nodes/x", "nodes/x-pool"):
        authorize(agent, Permission.NODES_LEASE, node=node)
        authorize(agent, Permission.RETENTIONS_EVICT, node=node)
    for node in ("nodes/y-pool", "nodes/x-poolx", "nodes/x-pool-pool", "nodes/xx-pool"):
        with pytest.raises(PermissionDenied) as err:
            authorize(agent, Permission.RETENTIONS_EVICT, node=node)
        assert err.value.reason == "NODE_NOT_IN_SCOPE"
    unbound = Caller("agent-without-node", Role.AGENT)
    with pytest.raises(PermissionDenied):
        authorize(unbound, Permission.NODES_LEASE, node="nodes/x-pool")


def test_who_may_evict() -> None:
    authorize(Caller("router", Role.ROUTER), Permission.RETENTIONS_EVICT, node="nodes/x-pool")
    authorize(Caller("admin", Role.ADMIN), Permission.RETENTIONS_EVICT, node="nodes/x-pool")
    for role in (Role.GATEWAY, Role.VIEWER):
        with pytest.raises(PermissionDenied) as err:
            authorize(Caller(str(role), role, tenants=frozenset({"*"})), Permission.RETENTIONS_EVICT)
        assert err.value.reason == "PERMISSION_MISSING"
