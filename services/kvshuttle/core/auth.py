"""Who may do what: roles, the permissions each role holds, and the caller of the RPC in flight.

Every kvshuttle service authenticates its caller (kvshuttle.serving.auth: an mTLS peer identity
or a bearer token) into a `Caller`, then makes one decision per call: `authorize(caller,
permission, tenant=..., node=...)`. Each service's policy says which permission an RPC needs
and which tenant or node it touches (registry/api/authz.py, router/grpc/authz.py, agent/authz.py).

Scopes: a gateway acts only for the tenants it is bound to; an agent only for its own node and
that node's pool node (kvshuttle.core.nodes.pool_node_name: the agent's block pool, leased as
a node of its own); the router, admins and viewers for every tenant. A refusal changes
nothing: it happens before the servicer runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvshuttle.core.errors import PermissionDenied
from kvshuttle.core.nodes import POOL_NODE_SUFFIX
from kvshuttle.core.reasons import ErrorReason

__all__ = ["ALL_TENANTS", "ROLE_PERMISSIONS", "Caller", "Permission", "Role", "authorize"]

# A gateway grant for every tenant (a single gateway in front of all of them).
ALL_TENANTS = "*"


class Role(StrEnum):
    GATEWAY = "gateway"
    ROUTER = "router"
    AGENT = "agent"
    ADMIN = "admin"
    VIEWER = "viewer"


class Permission(StrEnum):
    # Registry.
    NODES_LEASE = "nodes.lease"  # RegisterNode, HeartbeatNode, DeregisterNode (an agent: its own)
    NODES_READ = "nodes.read"  # GetNode, ListNodes
    EVENTS_REPORT = "events.report"  # ReportBlockEvents (an agent: its own node)
    BLOCKS_LOOKUP = "blocks.lookup"  # LookupBlocks
    RETENTIONS_READ = "retentions.read"  # GetRetention, GetConversation, ListRetentions, Watch
    RETENTIONS_WRITE = "retentions.write"  # PutRetention, RenewRetention, MoveRetention
    RETENTIONS_CLAIM = "retentions.claim"  # ClaimRetention, ReleaseRetention with its claim id
    RETENTIONS_FORCE_RELEASE = "retentions.force_release"  # ReleaseRetention(force=true)
    RETENTIONS_EVICT = "retentions.evict"  # EvictRetention (an agent: from its own pool node)
    # Router.
    TURNS = "turns"  # PlanTurn, CommitTurn, AbortTurn
    # Agent.
    AGENT_STATUS = "agent.status"  # GetStatus
    AGENT_TRANSFER = "agent.transfer"  # PullBlocks, ParkRetention, Prefetch


ROLE_PERMISSIONS: dict[Role, frozenset[Permission]] = {
    Role.GATEWAY: frozenset({Permission.TURNS}),
    Role.ROUTER: frozenset(
        {
            Permission.NODES_READ,
            Permission.BLOCKS_LOOKUP,
            Permission.RETENTIONS_READ,
            Permission.RETENTIONS_WRITE,
            Permission.RETENTIONS_CLAIM,
            Permission.RETENTIONS_EVICT,
            Permission.AGENT_STATUS,
            Permission.AGENT_TRANSFER,
        }
    ),
    Role.AGENT: frozenset({Permission.NODES_LEASE, Permission.EVENTS_REPORT, Permission.RETENTIONS_EVICT}),
    Role.ADMIN: frozenset(Permission),
    Role.VIEWER: frozenset(
        {Permission.NODES_READ, Permission.BLOCKS_LOOKUP, Permission.RETENTIONS_READ, Permission.AGENT_STATUS}
    ),
}


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller and what its identity is configured to be.

    `identity`: the mTLS URI or DNS SAN (e.g. "spiffe://kvshuttle/router") or the token's
    identity; never a secret, so it may be logged. `tenants`: the tenants a gateway may act for
    (ALL_TENANTS for all). `node`: the node an agent may act for ("nodes/{node}"), and with it
    that node's pool node ("nodes/{node}-pool").
    """

    identity: str
    role: Role
    tenants: frozenset[str] = frozenset()
    node: str | None = None

    def serves_tenant(self, tenant: str) -> bool:
        if self.role is Role.GATEWAY:
            return ALL_TENANTS in self.tenants or tenant in self.tenants
        return self.role is not Role.AGENT  # router, admin, viewer: every tenant

    def acts_for_node(self, node: str) -> bool:
        """Whether the caller may act for `node`: an agent for its own node and its pool node,
        every other role for every node."""
        if self.role is not Role.AGENT:
            return True
        return self.node is not None and node in (self.node, self.node + POOL_NODE_SUFFIX)


def authorize(
    caller: Caller, permission: Permission, *, tenant: str | None = None, node: str | None = None
) -> None:
    """Raises PermissionDenied (PERMISSION_MISSING, TENANT_NOT_IN_SCOPE or NODE_NOT_IN_SCOPE)
    unless `caller` may use `permission` on `tenant` / `node` (None: the call names none)."""
    if permission not in ROLE_PERMISSIONS[caller.role]:
        raise PermissionDenied(
            f"{caller.role} {caller.identity!r} lacks {permission}",
            reason=ErrorReason.PERMISSION_MISSING,
            metadata={"permission": str(permission), "role": str(caller.role)},
        )
    if tenant is not None and not caller.serves_tenant(tenant):
        raise PermissionDenied(
            f"{caller.identity!r} does not act for tenant {tenant!r}",
            reason=ErrorReason.TENANT_NOT_IN_SCOPE,
            metadata={"tenant": tenant},
        )
    if node is not None and not caller.acts_for_node(node):
        raise PermissionDenied(
            f"{caller.identity!r} acts for {caller.node}, not {node}",
            reason=ErrorReason.NODE_NOT_IN_SCOPE,
            metadata={"node": node},
        )
