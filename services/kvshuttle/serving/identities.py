"""Who an identity is: the grants of `AuthSettings.identities`, named one by one or, for agents,
by a pattern.

A pattern is an identity ending in `{node}` and granted `{"role": "agent", "node":
"nodes/{node}"}`, e.g. `"spiffe://kvshuttle/agent/{node}"`: the client certificate of URI SAN
`spiffe://kvshuttle/agent/decode-0` is then the agent of nodes/decode-0, acting for that node
and its pool node (nodes/decode-0-pool) and no other. The node is the identity's own text after
the prefix, so a pattern can never grant one identity several nodes, nor another identity's:
`{node}` must be a whole node id (letters, digits, `._~:-`; no `/`, no wildcard), and a name
ending in `-pool` is refused (it would be the pool node of another node's agent). Scaling an
engine StatefulSet needs no new grant: each pod's certificate names its pod (cert-manager's
CSI driver, `spiffe://kvshuttle/agent/${POD_NAME}`), and the issuer decides who may ask for it.

Patterns match certificate URI SANs only: a SAN is verified by the CA, while a bearer token's
identity is the name the tokens file gives it, which is already one entry per token (each
token identity needs a grant of its own).

A certificate is one caller: one naming more than one configured identity (two SANs granted
differently, or two agents' names) is refused rather than picked from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvshuttle.core.auth import Caller, Role
from kvshuttle.core.errors import InvalidArgument, Unauthenticated
from kvshuttle.core.names import check_id
from kvshuttle.core.nodes import POOL_NODE_SUFFIX
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.serving.settings import NODE_PLACEHOLDER, PATTERN_NODE, Grant

__all__ = ["Identities", "pattern_node"]


def pattern_node(prefix: str, identity: str) -> str | None:
    """The node `identity` is the agent of under the pattern `prefix{node}`, or None when it
    does not match (or what follows the prefix is no node id of an engine)."""
    if not identity.startswith(prefix):
        return None
    node = identity[len(prefix) :]
    if node.endswith(POOL_NODE_SUFFIX):
        return None
    try:
        check_id(node, "identity")
    except InvalidArgument:
        return None
    return f"nodes/{node}"


@dataclass(frozen=True, slots=True)
class _Pattern:
    prefix: str
    identity: str  # as configured, "...{node}"


class Identities:
    """The configured identities: `named` for a token's identity, `of_certificate` for the SANs
    of a verified client certificate."""

    def __init__(self, identities: Mapping[str, Grant]) -> None:
        self._exact = {
            identity: Caller(identity, grant.role, frozenset(grant.tenants), grant.node)
            for identity, grant in identities.items()
            if NODE_PLACEHOLDER not in identity
        }
        self._patterns = [
            _Pattern(identity.removesuffix(NODE_PLACEHOLDER), identity)
            for identity, grant in identities.items()
            if NODE_PLACEHOLDER in identity and grant.node == PATTERN_NODE
        ]

    @property
    def names(self) -> frozenset[str]:
        """The identities named one by one (which tokens may stand for)."""
        return frozenset(self._exact)

    def named(self, identity: str) -> Caller | None:
        return self._exact.get(identity)

    def of_certificate(self, uris: Sequence[str], dns_names: Sequence[str]) -> Caller | None:
        """The caller a certificate with these SANs is; None when it names no configured
        identity. Raises Unauthenticated when it names several."""
        found: dict[str, Caller] = {}
        for uri in uris:
            caller = self._exact.get(uri) or self._by_pattern(uri)
            if caller is not None:
                found[caller.identity] = caller
        for name in dns_names:
            caller = self._exact.get(name)
            if caller is not None:
                found[caller.identity] = caller
        if len(found) > 1:
            raise Unauthenticated(
                f"the client certificate names several identities ({', '.join(sorted(found))}): "
                "a certificate is one caller",
                reason=ErrorReason.UNAUTHENTICATED,
            )
        return next(iter(found.values()), None)

    def _by_pattern(self, uri: str) -> Caller | None:
        for pattern in self._patterns:
            node = pattern_node(pattern.prefix, uri)
            if node is not None:
                return Caller(uri, Role.AGENT, frozenset(), node)
        return None
