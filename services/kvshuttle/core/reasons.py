"""Every ErrorInfo.reason a kvshuttle service returns, in one table.

A reason is the stable, machine-readable cause of an error (UPPER_SNAKE_CASE); clients branch
on it, so a reason keeps one meaning everywhere. Each service's proto lists the reasons its
RPCs return; `SERVICE_REASONS` is that list as data, and a test holds the protos to it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

__all__ = ["INTERNAL_REASONS", "SERVICE_REASONS", "ErrorReason"]


class ErrorReason(StrEnum):
    # Generic: the default reason of each domain error class (kvshuttle.core.errors).
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # ErrorInfo.metadata["field"] names the field
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    # Identity and authorization (kvshuttle.core.auth): every service.
    UNAUTHENTICATED = "UNAUTHENTICATED"  # no identity the service accepts
    PERMISSION_MISSING = "PERMISSION_MISSING"  # the role lacks it: metadata["permission"]
    TENANT_NOT_IN_SCOPE = "TENANT_NOT_IN_SCOPE"  # metadata["tenant"]
    NODE_NOT_IN_SCOPE = "NODE_NOT_IN_SCOPE"  # an agent acting for another node: metadata["node"]
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"  # a request over the server's limit: metadata["limit"]
    # Nodes.
    NODE_NOT_FOUND = "NODE_NOT_FOUND"  # no live lease of that node: register again
    NODE_INCARNATION_MISMATCH = "NODE_INCARNATION_MISMATCH"  # a newer registration replaced it
    # A retention's model, block size, engine id or side channel (kv_transfer_params'
    # remote_engine_id, remote_host, remote_port) is not its node's as registered.
    NODE_MISMATCH = "NODE_MISMATCH"
    # Retentions and conversations.
    RETENTION_NOT_FOUND = "RETENTION_NOT_FOUND"
    RETENTION_EXPIRED = "RETENTION_EXPIRED"
    RETENTION_ALREADY_CLAIMED = "RETENTION_ALREADY_CLAIMED"  # another reader claimed it
    RETENTION_CLAIMED = "RETENTION_CLAIMED"  # claimed: it cannot be renewed
    CLAIM_MISMATCH = "CLAIM_MISMATCH"  # the claim id given is not the retention's claim
    # A shared claim asked of a retention whose holder frees it at its first read (decode).
    RETENTION_NOT_SHAREABLE = "RETENTION_NOT_SHAREABLE"
    PIN_EXPIRED = "PIN_EXPIRED"  # the engine's own pin on the blocks has passed
    FENCING_GENERATION_STALE = "FENCING_GENERATION_STALE"  # a newer generation was stored
    # A request_id seen before with another request body (AIP-155): metadata["field"] "request_id".
    REQUEST_ID_REUSED = "REQUEST_ID_REUSED"
    CONVERSATION_NOT_FOUND = "CONVERSATION_NOT_FOUND"
    # Capacity and lifecycle.
    CAPACITY_EXCEEDED = "CAPACITY_EXCEEDED"  # a bounded table or tenant quota is full
    WATCH_OVERFLOW = "WATCH_OVERFLOW"  # a watcher fell behind its buffer: watch again
    # A resume token the change feed no longer covers: list again, then watch without one.
    WATCH_RESUME_EXPIRED = "WATCH_RESUME_EXPIRED"
    SHUTTING_DOWN = "SHUTTING_DOWN"  # the server is draining
    # Turns (router).
    TURN_NOT_FOUND = "TURN_NOT_FOUND"  # the handle is malformed or not this router's
    TURN_EXPIRED = "TURN_EXPIRED"
    TURN_FINISHED = "TURN_FINISHED"  # already committed or aborted
    # A commit of the output alone on a replica that does not hold the turn's prompt.
    PROMPT_NOT_HELD = "PROMPT_NOT_HELD"
    NO_PREFILL_NODE = "NO_PREFILL_NODE"
    NO_DECODE_NODE = "NO_DECODE_NODE"
    # A call to another kvshuttle service failed.
    REGISTRY_UNAVAILABLE = "REGISTRY_UNAVAILABLE"
    # The router did not answer the gateway, whose turn ran plain P->D.
    ROUTER_UNAVAILABLE = "ROUTER_UNAVAILABLE"
    # The registry answered a claim with another retention: the plan recomputes (internal).
    REGISTRY_ANSWER_MISMATCH = "REGISTRY_ANSWER_MISMATCH"


# Every service authenticates and authorizes each call and bounds its requests
# (kvshuttle.serving.interceptor).
_AUTH: Final = frozenset(
    {
        ErrorReason.MESSAGE_TOO_LARGE,
        ErrorReason.UNAUTHENTICATED,
        ErrorReason.PERMISSION_MISSING,
        ErrorReason.TENANT_NOT_IN_SCOPE,
        ErrorReason.NODE_NOT_IN_SCOPE,
    }
)

# The reasons each service's RPCs return, as its proto lists them.
SERVICE_REASONS: Final[dict[str, frozenset[ErrorReason]]] = {
    "registry": _AUTH
    | frozenset(
        {
            ErrorReason.INVALID_ARGUMENT,
            ErrorReason.REQUEST_ID_REUSED,
            ErrorReason.NODE_NOT_FOUND,
            ErrorReason.NODE_INCARNATION_MISMATCH,
            ErrorReason.NODE_MISMATCH,
            ErrorReason.RETENTION_NOT_FOUND,
            ErrorReason.RETENTION_EXPIRED,
            ErrorReason.RETENTION_ALREADY_CLAIMED,
            ErrorReason.RETENTION_CLAIMED,
            ErrorReason.CLAIM_MISMATCH,
            ErrorReason.RETENTION_NOT_SHAREABLE,
            ErrorReason.PIN_EXPIRED,
            ErrorReason.FENCING_GENERATION_STALE,
            ErrorReason.CONVERSATION_NOT_FOUND,
            ErrorReason.CAPACITY_EXCEEDED,
            ErrorReason.WATCH_OVERFLOW,
            ErrorReason.WATCH_RESUME_EXPIRED,
            ErrorReason.SHUTTING_DOWN,
            ErrorReason.UNAVAILABLE,  # its store (Redis) did not answer
        }
    ),
    "router": _AUTH
    | frozenset(
        {
            ErrorReason.INVALID_ARGUMENT,
            ErrorReason.REQUEST_ID_REUSED,
            ErrorReason.NODE_MISMATCH,  # decode's params name another engine than the planned node
            ErrorReason.TURN_NOT_FOUND,
            ErrorReason.TURN_EXPIRED,
            ErrorReason.TURN_FINISHED,
            ErrorReason.PROMPT_NOT_HELD,
            ErrorReason.NO_PREFILL_NODE,
            ErrorReason.NO_DECODE_NODE,
            ErrorReason.REGISTRY_UNAVAILABLE,
            ErrorReason.CAPACITY_EXCEEDED,  # the registry's, passed on by CommitTurn
        }
    ),
    "agent": _AUTH
    | frozenset(
        {
            ErrorReason.INVALID_ARGUMENT,
            ErrorReason.REQUEST_ID_REUSED,
            ErrorReason.NODE_MISMATCH,  # the source's engine, or target_node, is not this agent's
            ErrorReason.PIN_EXPIRED,  # the holder's pin ends before a READ could finish
            ErrorReason.CAPACITY_EXCEEDED,  # no room in the pool, even after evicting
            ErrorReason.FAILED_PRECONDITION,
            ErrorReason.UNAVAILABLE,
        }
    ),
}

# Raised and handled inside one service, never returned by an RPC.
INTERNAL_REASONS: Final[frozenset[ErrorReason]] = frozenset({ErrorReason.REGISTRY_ANSWER_MISMATCH})
