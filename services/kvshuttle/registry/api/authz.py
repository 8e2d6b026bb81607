"""Which permission each RegistryService RPC needs, and the tenant or node it acts on.

Agents lease and report for their own node only (the node named in the request, or its pool
node); retention calls name their tenant in the resource name (tenants/{tenant}/...), which
bounds a tenant-scoped caller; force-releasing someone else's claim is an admin's alone.
EvictRetention is scoped by the node it evicts from, not by tenant: an agent frees room in its
own pool, whoever's retentions fill it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvshuttle.core.auth import Permission
from kvshuttle.core.names import tenant_of
from kvshuttle.serving.auth import Requirement, unknown_method

__all__ = ["policy"]

_Name = Callable[[Any], str]
_NODE_CALLS: dict[str, tuple[Permission, _Name]] = {
    "RegisterNode": (Permission.NODES_LEASE, lambda r: r.node.name),
    "HeartbeatNode": (Permission.NODES_LEASE, lambda r: r.name),
    "DeregisterNode": (Permission.NODES_LEASE, lambda r: r.name),
    "ReportBlockEvents": (Permission.EVENTS_REPORT, lambda r: r.node),
    "EvictRetention": (Permission.RETENTIONS_EVICT, lambda r: r.node),
}
_TENANT_CALLS: dict[str, tuple[Permission, _Name]] = {
    "PutRetention": (Permission.RETENTIONS_WRITE, lambda r: r.parent),
    "RenewRetention": (Permission.RETENTIONS_WRITE, lambda r: r.name),
    "MoveRetention": (Permission.RETENTIONS_WRITE, lambda r: r.name),
    "GetRetention": (Permission.RETENTIONS_READ, lambda r: r.name),
    "GetConversation": (Permission.RETENTIONS_READ, lambda r: r.name),
    "ListRetentions": (Permission.RETENTIONS_READ, lambda r: r.parent),
    "FindRetention": (Permission.RETENTIONS_READ, lambda r: r.parent),
    "WatchRetentions": (Permission.RETENTIONS_READ, lambda r: r.parent),
    "ClaimRetention": (Permission.RETENTIONS_CLAIM, lambda r: r.name),
}
_PLAIN = {
    "GetNode": Permission.NODES_READ,
    "ListNodes": Permission.NODES_READ,
    "LookupBlocks": Permission.BLOCKS_LOOKUP,
}


def policy(method: str, request: Any) -> Requirement:
    if method in _NODE_CALLS:
        permission, node = _NODE_CALLS[method]
        return Requirement(permission, node=node(request))
    if method in _TENANT_CALLS:
        permission, name = _TENANT_CALLS[method]
        return Requirement(permission, tenant=tenant_of(name(request)))
    if method == "ReleaseRetention":
        permission = Permission.RETENTIONS_FORCE_RELEASE if request.force else Permission.RETENTIONS_CLAIM
        return Requirement(permission, tenant=tenant_of(request.name))
    if method in _PLAIN:
        return Requirement(_PLAIN[method])
    raise unknown_method(method)
