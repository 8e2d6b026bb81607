"""Servers with authentication on, and callers of every role, for the authorization tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import SecretStr

from kvshuttle.client.errors import KvshuttleRpcError
from kvshuttle.core.auth import Role
from kvshuttle.serving.settings import AuthSettings, Grant

# identity -> (grant, token). One identity per role; the gateway acts for tenant "acme" only.
IDENTITIES: dict[str, tuple[Grant, str]] = {
    "gateway-acme": (Grant(role=Role.GATEWAY, tenants=["acme"]), "tok-gateway-acme-0123456789"),
    "router": (Grant(role=Role.ROUTER), "tok-router-0123456789abcdef"),
    "agent-d0": (Grant(role=Role.AGENT, node="nodes/d0"), "tok-agent-d0-0123456789ab"),
    "admin": (Grant(role=Role.ADMIN), "tok-admin-0123456789abcdefg"),
    "viewer": (Grant(role=Role.VIEWER), "tok-viewer-0123456789abcdef"),
}
ROLES = tuple(IDENTITIES)


def auth_settings(extra: Mapping[str, tuple[Grant, str]] | None = None) -> AuthSettings:
    identities = {**IDENTITIES, **(extra or {})}
    return AuthSettings(
        identities={name: grant for name, (grant, _) in identities.items()},
        tokens={name: SecretStr(token) for name, (_, token) in identities.items()},
    )


def token(identity: str) -> str:
    return IDENTITIES[identity][1]


def bearer(identity: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token(identity)}"),)


def denial(err: Any) -> tuple[str, str]:
    """(status code name, ErrorInfo reason) of a grpc.aio.AioRpcError."""
    parsed = KvshuttleRpcError.from_rpc_error(err)
    return parsed.code.name, parsed.reason or ""
