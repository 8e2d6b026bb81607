"""The domain errors both stores (kvshuttle.registry.store.memory, kvshuttle.registry.store.redis) raise
for the stateful rules of the store contract (kvshuttle.registry.store.contract), so the two answer
each refusal with the same status, reason, message and metadata."""

from __future__ import annotations

from kvshuttle.core.errors import Aborted, FailedPrecondition, NotFound, ResourceExhausted
from kvshuttle.core.reasons import ErrorReason


def node_not_found(name: str) -> NotFound:
    return NotFound(
        f"node {name} is not registered (or its lease lapsed)",
        reason=ErrorReason.NODE_NOT_FOUND,
        metadata={"node": name},
    )


def incarnation_mismatch(name: str, have: str, wanted: int) -> FailedPrecondition:
    return FailedPrecondition(
        f"node {name} is at incarnation {have}, not {wanted}",
        reason=ErrorReason.NODE_INCARNATION_MISMATCH,
        metadata={"node": name, "incarnation": have},
    )


def node_not_registered(name: str) -> FailedPrecondition:
    """A put onto a node the registry does not know (a precondition of the put, not its target)."""
    return FailedPrecondition(
        f"node {name} is not registered",
        reason=ErrorReason.NODE_NOT_FOUND,
        metadata={"node": name},
    )


def too_many(limit: str, message: str) -> ResourceExhausted:
    """A capacity bound of StoreLimits (`limit`: its field) reached."""
    return ResourceExhausted(message, reason=ErrorReason.CAPACITY_EXCEEDED, metadata={"limit": limit})


def retention_not_found(name: str) -> NotFound:
    return NotFound(
        f"retention {name} not found",
        reason=ErrorReason.RETENTION_NOT_FOUND,
        metadata={"retention": name},
    )


def conversation_not_found(name: str) -> NotFound:
    return NotFound(
        f"conversation {name} has no retention and no fencing generation",
        reason=ErrorReason.CONVERSATION_NOT_FOUND,
        metadata={"conversation": name},
    )


def generation_stale(generation: int, fence: str, conversation: str) -> Aborted:
    return Aborted(
        f"generation {generation} is not newer than {fence} for {conversation}",
        reason=ErrorReason.FENCING_GENERATION_STALE,
        metadata={"fence_generation": fence},
    )


def pin_expired() -> FailedPrecondition:
    return FailedPrecondition(
        "pin_expire_time has already passed: the blocks are gone", reason=ErrorReason.PIN_EXPIRED
    )


def retention_claimed(name: str) -> FailedPrecondition:
    """A renew of a claimed retention."""
    return FailedPrecondition(
        f"retention {name} is claimed; a claim is never renewed",
        reason=ErrorReason.RETENTION_CLAIMED,
        metadata={"retention": name},
    )


def already_claimed(name: str) -> Aborted:
    return Aborted(
        f"retention {name} is already claimed",
        reason=ErrorReason.RETENTION_ALREADY_CLAIMED,
        metadata={"retention": name},
    )


def not_shareable(name: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"retention {name} is not held by a pool node: its holder frees it at its first read",
        reason=ErrorReason.RETENTION_NOT_SHAREABLE,
        metadata={"retention": name, "field": "shared"},
    )


def retention_expired(name: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"retention {name} expired",
        reason=ErrorReason.RETENTION_EXPIRED,
        metadata={"retention": name},
    )


def request_ended(name: str, op: str, request_id: str) -> NotFound:
    """A repeat of a claim or move (`op`) whose retention is gone: the first answer has ended."""
    return NotFound(
        f"retention {name} is gone: the {op} request {request_id} made has ended",
        reason=ErrorReason.RETENTION_NOT_FOUND,
        metadata={"retention": name},
    )
