"""Digests that name private values in logs and spans (conversation names, turn handles):
the same value always gives the same digest, and the value itself never reaches a log."""

from __future__ import annotations

import hashlib

__all__ = ["log_digest"]


def log_digest(value: str) -> str:
    """16 hex digits of SHA-256 over `value`; every service logs a conversation by this digest,
    so one conversation's lines can be joined across the gateway, router and registry."""
    return hashlib.sha256(value.encode()).hexdigest()[:16]
