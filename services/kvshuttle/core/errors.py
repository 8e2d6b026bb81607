"""Domain errors. One server interceptor maps them to gRPC status codes with a
google.rpc.ErrorInfo; the domain code never sees grpc."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class ErrorCode(StrEnum):
    """The gRPC status a domain error becomes (names match grpc.StatusCode)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    PERMISSION_DENIED = "PERMISSION_DENIED"


class KvshuttleError(Exception):
    """Base of every error a service raises on purpose.

    `reason` is the stable, UPPER_SNAKE_CASE machine-readable cause that travels as
    ErrorInfo.reason; `metadata` travels as ErrorInfo.metadata.
    """

    code: ErrorCode = ErrorCode.FAILED_PRECONDITION
    default_reason: str = "FAILED_PRECONDITION"

    def __init__(
        self, message: str, *, reason: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata: dict[str, str] = dict(metadata or {})


class InvalidArgument(KvshuttleError):
    """A request field is malformed or out of bounds; `field` names it (dotted path)."""

    code = ErrorCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", metadata={"field": field})
        self.field = field


class NotFound(KvshuttleError):
    code = ErrorCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class AlreadyExists(KvshuttleError):
    code = ErrorCode.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class FailedPrecondition(KvshuttleError):
    code = ErrorCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class Aborted(KvshuttleError):
    """A concurrency conflict: a lost claim race, a stale fencing generation."""

    code = ErrorCode.ABORTED
    default_reason = "ABORTED"


class ResourceExhausted(KvshuttleError):
    code = ErrorCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class Unavailable(KvshuttleError):
    code = ErrorCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class PermissionDenied(KvshuttleError):
    code = ErrorCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"
