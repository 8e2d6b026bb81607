"""Per-tenant vLLM cache salts: tenants never share KV, in vLLM or in kvshuttle.

vLLM salts its prefix cache with a request's `cache_salt`: the salt is folded into the hash of
the prompt's first block, and every later block chains from that one, so blocks cached under one
salt never serve a request under another (vLLM's defence against prefix-cache timing probes).
The gateway sends prefill and decode the same salt on every turn, derived per tenant:

    salt = base64url(HMAC-SHA256(key, "kvshuttle/cache-salt/v1" NUL tenant NUL client salt))

43 characters (256 bits, as vLLM recommends; within its 128-character bound and free of the
characters it refuses), so two tenants never hit each other's cached blocks and nobody without
the key can compute a tenant's salt. A client's own `cache_salt` (checked as vLLM checks it)
partitions its tenant's cache further, per end user say; it never replaces the tenant's part.

kvshuttle gets only the salt's SHA-256 (`PlanTurnRequest.cache_salt_sha256`): the router chains
the prompt from a root derived from it, and the retention its commit stores chains from the same
root, so a retention verifies only for the same tenant and salt.

The key (`KVSHUTTLE_GATEWAY_CACHE_SALT_KEY`) must be the same on every gateway replica. Unset,
each process draws a random one and warns: tenants stay isolated, but a conversation's KV is
reused only while its turns reach the same gateway process (another replica, or a restart,
salts differently: vLLM's cache misses and the router answers PREFIX_MISMATCH).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

import structlog

from kvshuttle.core.hashing import cache_salt_digest

__all__ = ["MAX_CLIENT_SALT_LENGTH", "CacheSalts", "client_salt_problem"]

log = structlog.get_logger("kvshuttle.gateway")

_DOMAIN = b"kvshuttle/cache-salt/v1\x00"
# vLLM's own bounds on `cache_salt` (vllm.entrypoints.generate.base.protocol, 0.32).
MAX_CLIENT_SALT_LENGTH = 128
_FORBIDDEN = frozenset("@/\\\x00")


def client_salt_problem(value: object) -> str | None:
    """Why vLLM would refuse `value` as a `cache_salt`, or None when it would take it."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if len(value) > MAX_CLIENT_SALT_LENGTH or not _FORBIDDEN.isdisjoint(value):
        return f"must be at most {MAX_CLIENT_SALT_LENGTH} characters without '@', '/', '\\' or NUL"
    return None


class CacheSalts:
    """The cache salts of one gateway: one HMAC key, one salt per (tenant, client salt)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the cache salt key needs at least 16 bytes")
        self._key = key

    @classmethod
    def from_key(cls, key: bytes | None) -> CacheSalts:
        """Salts under `key`, or under a random per-process key (with a warning) when None."""
        if key is None:
            log.warning(
                "gateway.ephemeral_cache_salt_key",
                detail="no cache_salt_key set: tenants' cache salts use a random per-process key; "
                "set KVSHUTTLE_GATEWAY_CACHE_SALT_KEY, the same on every replica, or KV is reused "
                "only within this process",
            )
            key = secrets.token_bytes(32)
        return cls(key)

    def salt(self, tenant: str, client_salt: str | None = None) -> str:
        """The `cache_salt` both engines get for a request of `tenant` (and the client's own
        salt, when it sent one)."""
        message = b"%s%s\x00%s" % (_DOMAIN, tenant.encode(), (client_salt or "").encode())
        mac = hmac.new(self._key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    @staticmethod
    def digest(salt: str) -> bytes:
        """What the router gets instead of the salt (`PlanTurnRequest.cache_salt_sha256`)."""
        return cache_salt_digest(salt)
