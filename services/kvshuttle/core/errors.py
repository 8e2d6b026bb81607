"""Domain errors. One server interceptor maps them to gRPC status codes with a
google.rpc.ErrorInfo; the domain code never sees grpc."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from kvshuttle.core.reasons import ErrorReason


class ErrorCode(StrEnum):
    """The gRPC status a domain error becomes (names match grpc.StatusCode)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"


class KvshuttleError(Exception):
    """Base of every error a service raises on purpose.

    `reason` is the stable, UPPER_SNAKE_CASE machine-readable cause that travels as
    ErrorInfo.reason: one of kvshuttle.core.reasons.ErrorReason when a service raises it (a
    plain string only when re-raising another service's reason as it came); `metadata`
    travels as ErrorInfo.metadata.
    """

    code: ErrorCode = ErrorCode.FAILED_PRECONDITION
    default_reason: ErrorReason = ErrorReason.FAILED_PRECONDITION

    def __init__(
        self,
        message: str,
        *,
        reason: ErrorReason | str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata: dict[str, str] = dict(metadata or {})


class InvalidArgument(KvshuttleError):
    """A request field is malformed or out of bounds; `field` names it (dotted path)."""

    code = ErrorCode.INVALID_ARGUMENT
    default_reason = ErrorReason.INVALID_ARGUMENT

    def __init__(self, field: str, message: str, *, reason: ErrorReason | None = None) -> None:
        super().__init__(f"{field}: {message}", reason=reason, metadata={"field": field})
        self.field = field


class NotFound(KvshuttleError):
    code = ErrorCode.NOT_FOUND
    default_reason = ErrorReason.NOT_FOUND


class FailedPrecondition(KvshuttleError):
    code = ErrorCode.FAILED_PRECONDITION
    default_reason = ErrorReason.FAILED_PRECONDITION


class Aborted(KvshuttleError):
    """A concurrency conflict: a lost claim race, a stale fencing generation."""

    code = ErrorCode.ABORTED
    default_reason = ErrorReason.ABORTED


class ResourceExhausted(KvshuttleError):
    code = ErrorCode.RESOURCE_EXHAUSTED
    default_reason = ErrorReason.RESOURCE_EXHAUSTED


class Unavailable(KvshuttleError):
    code = ErrorCode.UNAVAILABLE
    default_reason = ErrorReason.UNAVAILABLE


class Unauthenticated(KvshuttleError):
    """The caller presented no identity the service accepts (no token, an unknown token, no
    verified client certificate, or one whose identity is not configured)."""

    code = ErrorCode.UNAUTHENTICATED
    default_reason = ErrorReason.UNAUTHENTICATED


class PermissionDenied(KvshuttleError):
    """The caller is known but may not do this: its role lacks the permission (metadata
    "permission"), or the tenant or node named is outside its scope."""

    code = ErrorCode.PERMISSION_DENIED
    default_reason = ErrorReason.PERMISSION_MISSING
