"""Digests that name private values in logs and spans (conversation names, turn handles):
the same value always gives the same digest, and the value itself never reaches a log."""

from __future__ import annotations

import hashlib
import re

__all__ = ["log_digest", "log_name"]

# `tenants/{tenant}/conversations/{conversation}` and whatever follows it (`/retentions/{g}`).
_CONVERSATION_NAME = re.compile(r"(tenants/[^/]{1,256})/conversations/([^/]+)(.*)", re.DOTALL)
_TENANT_NAME = re.compile(r"tenants/[^/]{1,256}")


def log_digest(value: str) -> str:
    """16 hex digits of SHA-256 over `value`; every service logs a conversation by this digest,
    so one conversation's lines can be joined across the gateway, router and registry."""
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def log_name(name: str) -> str:
    """A resource name as a log line or span may show it: the conversation id of a
    `tenants/{t}/conversations/{c}[/retentions/{g}]` name replaced by `log_digest` of the
    conversation's name (the digest the gateway logs as `conversation`, so lines still join),
    e.g. `tenants/acme/conversations/3f2a9c0d1e4b5a6f/retentions/4`. "" stays "", a tenant name
    stays as it is, and a name of any other shape is logged only as its digest."""
    if not name or _TENANT_NAME.fullmatch(name):
        return name
    match = _CONVERSATION_NAME.fullmatch(name)
    if match is None:
        return log_digest(name)
    tenant, conversation, rest = match.groups()
    return f"{tenant}/conversations/{log_digest(f'{tenant}/conversations/{conversation}')}{rest[:100]}"
