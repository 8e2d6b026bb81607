"""Authentication of every RPC, and the one authorization decision per call.

Identity, in order:
1. mTLS: the verified client certificate's URI SANs (SPIFFE-style, "spiffe://kvshuttle/router")
   and DNS SANs: the one configured in `AuthSettings.identities`, by name or, for agents, by a
   pattern (kvshuttle.serving.identities); a certificate naming several is refused.
2. A bearer token in the `authorization` metadata ("Bearer <token>"), compared in constant time
   (HMAC digests, every configured token checked) with the tokens of the configured identities.
   A token that matched is remembered (its caller, by the token itself): tokens are read once, at
   start, so the answer cannot change, and only configured tokens are kept, so the memo is as
   bounded as the tokens file. A lookup's time depends on the token's keyed hash, not on how
   much of it matches; unknown tokens still take the HMAC path every time.

The identity's grant (role, tenants, node) makes the Caller; the service's policy says which
permission the RPC needs and which tenant or node it names, and kvshuttle.core.auth.authorize
decides. Health checks and reflection need no identity (probes).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshuttle.core.auth import Caller, Permission, authorize
from kvshuttle.core.errors import PermissionDenied, Unauthenticated
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.serving.identities import Identities
from kvshuttle.serving.settings import AuthSettings

__all__ = ["Authorizer", "MethodPolicy", "Requirement", "load_tokens", "unknown_method"]


@dataclass(frozen=True, slots=True)
class Requirement:
    """What one call needs: a permission, and the tenant or node it acts on (None: none)."""

    permission: Permission
    tenant: str | None = None
    node: str | None = None


# A service's policy: (method name, request message) -> what the call needs. It raises
# PermissionDenied for a method it does not know (fail closed), and InvalidArgument when the
# request is too malformed to say which tenant or node it names.
MethodPolicy = Callable[[str, Any], Requirement]


def load_tokens(settings: AuthSettings) -> dict[str, str]:
    """identity -> token, from `tokens` and `tokens_file` (a JSON object of the same shape)."""
    tokens = {identity: secret.get_secret_value() for identity, secret in settings.tokens.items()}
    if settings.tokens_file is not None:
        loaded = json.loads(Path(settings.tokens_file).read_text())
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()
        ):
            raise ValueError(f"{settings.tokens_file}: must be a JSON object of identity -> token")
        tokens.update(loaded)
    for identity, token in tokens.items():
        if len(token) < 16:
            raise ValueError(f"the token of {identity!r} is shorter than 16 characters")
    return tokens


class Authorizer:
    """Authenticates a call's metadata and peer, then authorizes it by the service's policy."""

    def __init__(self, settings: AuthSettings, policy: MethodPolicy) -> None:
        self._policy = policy
        self._identities = Identities(settings.identities)
        # Tokens are compared as HMACs under a per-process key: equal length, constant time.
        self._key = secrets.token_bytes(32)
        self._tokens: list[tuple[bytes, str]] = [
            (self._digest(token), identity) for identity, token in load_tokens(settings).items()
        ]
        # A token's identity is granted by name: patterns are for certificates alone.
        unknown = sorted({identity for _, identity in self._tokens} - self._identities.names)
        if unknown:
            raise ValueError(f"tokens for identities with no grant of their own: {', '.join(unknown)}")
        # Token -> its caller, once authenticated: an HMAC per call cost several µs of CPU
        # (issue 21, bench/interceptor_cost.py).
        self._known: dict[str, Caller] = {}

    def _digest(self, token: str) -> bytes:
        return hmac.new(self._key, token.encode(), hashlib.sha256).digest()

    def authenticate(
        self, metadata: Iterable[tuple[str, str | bytes]], auth_context: Mapping[str, Iterable[bytes]]
    ) -> Caller:
        """The caller, or Unauthenticated."""
        caller = self._identities.of_certificate(
            [value.decode(errors="replace") for value in auth_context.get("peer_uri", ())],
            [value.decode(errors="replace") for value in auth_context.get("peer_dns", ())],
        )
        if caller is not None:
            return caller
        token = _bearer(metadata)
        if token is not None:
            known = self._known.get(token)
            if known is not None:
                return known
            presented = self._digest(token)
            found: str | None = None
            for digest, identity in self._tokens:  # every one, so the time says nothing
                if hmac.compare_digest(digest, presented):
                    found = identity
            named = None if found is None else self._identities.named(found)
            if named is not None:
                self._known[token] = named
                return named
            raise Unauthenticated("unknown bearer token", reason=ErrorReason.UNAUTHENTICATED)
        if auth_context.get("transport_security_type") and auth_context.get("x509_subject"):
            raise Unauthenticated(
                "the client certificate names no configured identity", reason=ErrorReason.UNAUTHENTICATED
            )
        raise Unauthenticated(
            "an identity is required: a client certificate or an authorization bearer token",
            reason=ErrorReason.UNAUTHENTICATED,
        )

    def authorize(self, caller: Caller, method: str, request: Any) -> None:
        """Raises PermissionDenied unless `caller` may make this call."""
        need = self._policy(method, request)
        authorize(caller, need.permission, tenant=need.tenant, node=need.node)


def _bearer(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    for key, value in metadata:
        if key == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
            raise Unauthenticated(
                "authorization must be 'Bearer <token>'", reason=ErrorReason.UNAUTHENTICATED
            )
    return None


def unknown_method(method: str) -> PermissionDenied:
    """What a policy raises for a method it has no rule for: nobody may call it."""
    return PermissionDenied(
        f"no permission allows {method}", reason=ErrorReason.PERMISSION_MISSING, metadata={"method": method}
    )
