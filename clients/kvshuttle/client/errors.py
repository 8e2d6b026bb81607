"""The one exception every kvshuttle client raises for a failed RPC.

Services send errors as a gRPC status whose trailing `grpc-status-details-bin` holds a
`google.rpc.Status` with a `google.rpc.ErrorInfo` (reason, domain, metadata); INVALID_ARGUMENT
names the offending request field in `metadata["field"]`. `KvshuttleRpcError` unpacks that so
callers branch on `code` and `reason`, never on message text.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping
from typing import Any, Literal, TypeAlias, TypeVar

import grpc
from google.rpc import error_details_pb2, status_pb2

from kvshuttle.core.errors import (
    Aborted,
    FailedPrecondition,
    KvshuttleError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvshuttle.core.reasons import ErrorReason

__all__ = ["STATUS_DETAILS_KEY", "KvshuttleRpcError", "as_domain", "domain_error"]

T = TypeVar("T")

STATUS_DETAILS_KEY = "grpc-status-details-bin"


class KvshuttleRpcError(Exception):
    """A failed RPC: its status code and, when the server sent one, its ErrorInfo.

    Attributes:
        code: the gRPC status code.
        message: the status message (human readable, not meant for branching).
        reason: ErrorInfo.reason (e.g. "RETENTION_NOT_FOUND"); None when the server sent no
            ErrorInfo, as for transport failures (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED).
        domain: ErrorInfo.domain (e.g. "registry.kvshuttle"), or None.
        metadata: ErrorInfo.metadata (empty without ErrorInfo).
        method: the full RPC path (e.g. "/kvshuttle.registry.v1.RegistryService/GetNode"), or "".
        attempts: how many times the call was sent before it failed.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str = "",
        *,
        reason: str | None = None,
        domain: str | None = None,
        metadata: Mapping[str, str] | None = None,
        method: str = "",
        attempts: int = 1,
    ) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.reason = reason
        self.domain = domain
        self.metadata: dict[str, str] = dict(metadata or {})
        self.method = method
        self.attempts = attempts

    @property
    def field(self) -> str | None:
        """The request field an INVALID_ARGUMENT names (ErrorInfo metadata "field")."""
        return self.metadata.get("field")

    @property
    def code_name(self) -> str:
        """The status code's name, e.g. "NOT_FOUND"."""
        return str(self.code.name)

    @classmethod
    def from_rpc_error(
        cls, error: grpc.RpcError, *, method: str = "", attempts: int = 1
    ) -> KvshuttleRpcError:
        """Build from a failed call (grpc.aio.AioRpcError, or a sync grpc.RpcError that is a grpc.Call).

        A malformed status-details trailer is ignored (the code and message still come through).
        """
        code = _call_attr(error, "code", grpc.StatusCode.UNKNOWN)
        message = _call_attr(error, "details", "") or ""
        status = _status_from_trailers(_call_attr(error, "trailing_metadata", None))
        reason: str | None = None
        domain: str | None = None
        metadata: dict[str, str] = {}
        if status is not None:
            message = message or status.message
            info = _error_info(status)
            if info is not None:
                reason = info.reason or None
                domain = info.domain or None
                metadata = dict(info.metadata)
            if "field" not in metadata:
                field = _bad_request_field(status)
                if field:
                    metadata["field"] = field
        return cls(
            code, message, reason=reason, domain=domain, metadata=metadata, method=method, attempts=attempts
        )

    def __str__(self) -> str:
        head = self.code_name
        if self.reason and self.reason != self.code_name:
            head = f"{head} ({self.reason})"
        text = " ".join(self.message.split())  # one line, whatever the server sent
        return f"{head}: {text}" if text else head

    def __repr__(self) -> str:
        return (
            f"KvshuttleRpcError(code={self.code_name}, reason={self.reason!r}, domain={self.domain!r}, "
            f"metadata={self.metadata!r}, message={self.message!r})"
        )


def _call_attr(error: object, name: str, default: Any) -> Any:
    getter = getattr(error, name, None)
    if getter is None:
        return default
    try:
        return getter()
    except Exception:  # a half-built call object; the default is all we can say
        return default


def _status_from_trailers(trailers: Iterable[tuple[str, str | bytes]] | None) -> Any:
    """The google.rpc.Status in the trailing metadata, or None (absent or malformed)."""
    if not trailers:
        return None
    for key, value in trailers:
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except Exception:  # protobuf's DecodeError; a broken trailer is not our caller's problem
                return None
    return None


def _error_info(status: Any) -> Any:
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return info
    return None


def _bad_request_field(status: Any) -> str | None:
    """The first google.rpc.BadRequest field violation, for servers that send that instead."""
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            if detail.Unpack(bad) and bad.field_violations:
                return str(bad.field_violations[0].field)
    return None


_DOMAIN_ERRORS: dict[grpc.StatusCode, type[KvshuttleError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}
# The services a kvshuttle service calls, and the reason it raises when one is out of reach.
Service: TypeAlias = Literal["registry", "router"]
_UNAVAILABLE_REASONS: dict[Service, ErrorReason] = {
    "registry": ErrorReason.REGISTRY_UNAVAILABLE,
    "router": ErrorReason.ROUTER_UNAVAILABLE,
}
_UNREACHABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


class CallRefused(RuntimeError):
    """A service refused a request its caller built (INVALID_ARGUMENT, PERMISSION_DENIED,
    INTERNAL...): a bug or a misconfiguration, not a domain outcome. A service that meets one
    answers its own caller INTERNAL and logs these details."""

    def __init__(self, error: KvshuttleRpcError) -> None:
        super().__init__(f"{error.method.rsplit('/', 1)[-1]} failed: {error!r}")
        self.error = error


def domain_error(error: KvshuttleRpcError, service: Service) -> Exception:
    """What a service raises when its call to another one (`service`, e.g. "registry") failed:
    the domain error of the same code and reason, Unavailable(<SERVICE>_UNAVAILABLE) when the
    other service could not be reached in time, CallRefused for everything else."""
    kind = _DOMAIN_ERRORS.get(error.code)
    if kind is not None:
        return kind(error.message, reason=error.reason or error.code_name, metadata=error.metadata)
    if error.code in _UNREACHABLE:
        return Unavailable(
            f"{service} unavailable ({error.code_name}): {error.message}",
            reason=_UNAVAILABLE_REASONS[service],
        )
    return CallRefused(error)


async def as_domain(call: Awaitable[T], service: Service) -> T:
    """Await a client call; its failure raised as domain_error(error, service)."""
    try:
        return await call
    except KvshuttleRpcError as err:
        raise domain_error(err, service) from err
