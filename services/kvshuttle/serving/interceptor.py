"""The one server interceptor: the server span, domain errors to gRPC statuses, one canonical
log line and the metrics of every RPC.

Servicers raise kvshuttle.core.errors and never touch status codes. Each RPC, of any of the four
kinds, ends with exactly one `rpc.done` event carrying method, code, ms (and reason for a domain
error), the ids bound at its start, and whatever the servicer bound with
structlog.contextvars.bind_contextvars during the call. An unexpected exception is logged with
its traceback in that same line, at error level, and reaches the client only as INTERNAL
"internal error".

Handlers must be async: coroutines, or async generators for streamed responses (a coroutine
that streams with context.write, like grpc's health Watch, works too).

The span continues the caller's trace (W3C trace context in the metadata, through the global
propagator, as OpenTelemetry's gRPC instrumentation does), is named `/package.Service/Method`,
carries rpc.system, rpc.service, rpc.method and rpc.grpc.status_code, and is an error only for
the codes the semantic conventions call server errors. It is made here rather than by a second
interceptor: on a host whose cores are busy every wrapper layer costs a cold hop more (measured
in bench/e2e_vllm.py), and one layer per call is enough. Services in `probes` (health checks,
reflection) get the line and the metrics without a span: probes would flood the traces.

Each RPC starts by clearing structlog's contextvars: fields meant for every line of the process
belong on the logger (structlog.get_logger().bind(...)), not in contextvars.

With an Authorizer (kvshuttle.serving.auth), every call but those of the `probes` services
(health, reflection) is authenticated and authorized before the servicer runs; the caller's
identity goes into the call's line, and a refusal is UNAUTHENTICATED or PERMISSION_DENIED with
its ErrorInfo, counted in kvshuttle_auth_denied_total. Requests are parsed here rather than by
grpc: bytes that do not parse are INVALID_ARGUMENT (field "request") and a message over
`max_request_bytes` is RESOURCE_EXHAUSTED (MESSAGE_TOO_LARGE), both with ErrorInfo and a line.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Never

import grpc
import grpc.aio
import structlog
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter
from structlog.typing import FilteringBoundLogger

from kvshuttle.core.errors import InvalidArgument, KvshuttleError, ResourceExhausted
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.serving.auth import Authorizer
from kvshuttle.serving.metrics import RpcMetrics

# All the client learns of an unexpected exception; the details are in the log and the span.
INTERNAL_MESSAGE = "internal error"

# Codes that mean a bug or lost data here, not a caller's mistake: logged at error level.
_SERVER_FAULTS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})
# Codes that make a server span an error (OpenTelemetry's semantic conventions for gRPC).
_SPAN_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
# Refusals of an identity: counted in kvshuttle_auth_denied_total.
_AUTH_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
# The trace context headers the propagator reads; the rest of the metadata is not copied.
_TRACE_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})

if TYPE_CHECKING:  # generic in the stubs only
    _Context = grpc.aio.ServicerContext[Any, Any]
    _Handler = grpc.RpcMethodHandler[Any, Any]

# (request_streaming, response_streaming) -> the handler's behavior attribute and its factory.
_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., _Handler]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


@dataclass(frozen=True, slots=True)
class _Unparsed:
    """A request grpc received but that could not become the RPC's message."""

    size: int
    too_large: bool


def _parsing(
    deserializer: Callable[[bytes], Any] | None, max_bytes: int, received: Counter
) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        received.inc(len(data))
        if len(data) > max_bytes:
            return _Unparsed(len(data), too_large=True)
        try:
            return deserializer(data) if deserializer is not None else data
        except Exception:  # DecodeError and friends: the caller's bytes, not our bug
            return _Unparsed(len(data), too_large=False)

    return parse


def _counting_in(deserializer: Callable[[bytes], Any], received: Counter) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        received.inc(len(data))
        return deserializer(data)

    return parse


def _counting(serializer: Callable[[Any], bytes], sent: Counter) -> Callable[[Any], bytes]:
    def serialize(message: Any) -> bytes:
        data = serializer(message)
        sent.inc(len(data))
        return data

    return serialize


@dataclass(frozen=True, slots=True)
class _Method:
    """What every call of one method shares, worked out once when it is first called."""

    service: str
    method: str
    span_name: str
    # None for a probe: no span, no identity.
    span_attributes: dict[str, str] | None


@dataclass(frozen=True, slots=True)
class _Call:
    service: str
    method: str
    started: float
    span: trace.Span
    metadata: tuple[tuple[str, str | bytes], ...]


class RpcInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler of the server it is installed on. `domain` becomes ErrorInfo.domain
    (e.g. "registry.kvshuttle"); spans come from `tracer_provider` (the global one when None)."""

    def __init__(
        self,
        domain: str,
        metrics: RpcMetrics,
        logger: FilteringBoundLogger | None = None,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        probes: frozenset[str] = frozenset(),
        authorizer: Authorizer | None = None,
        max_request_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self._domain = domain
        self._authorizer = authorizer
        self._max_request_bytes = max_request_bytes
        self._metrics = metrics
        self._logger: FilteringBoundLogger = logger or structlog.get_logger("kvshuttle.rpc")
        # The logger assembled from structlog's configuration, and that configuration: a lazy
        # logger assembles itself (a new logger and file writer) at every line otherwise.
        self._bound: tuple[tuple[Any, ...], FilteringBoundLogger] | None = None
        self._tracer = trace.get_tracer("kvshuttle.rpc", tracer_provider=tracer_provider)
        # Health checks and reflection: logged and counted, never traced, no identity needed.
        self._probes = probes
        # Method -> (the server's handler, its wrapper): wrapped once, not on every call.
        self._wrapped: dict[str, tuple[_Handler, _Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED
            return None
        full_method = handler_call_details.method
        known = self._wrapped.get(full_method)
        if known is not None and known[0] is handler:
            return known[1]
        # "/kvshuttle.registry.v1.RegistryService/ClaimRetention"
        service, _, method = full_method.lstrip("/").partition("/")
        attribute, factory = _KINDS[handler.request_streaming, handler.response_streaming]
        behavior: Callable[..., Any] = getattr(handler, attribute)
        # grpc.aio picks how to drive a handler by its kind, so the wrapper must be of the same kind.
        wrap = self._wrap_generator if inspect.isasyncgenfunction(behavior) else self._wrap_coroutine
        received, sent = self._metrics.byte_counters(service, method)
        request_deserializer = handler.request_deserializer
        if not handler.request_streaming:
            request_deserializer = _parsing(request_deserializer, self._max_request_bytes, received)
        elif request_deserializer is not None:
            request_deserializer = _counting_in(request_deserializer, received)
        response_serializer = handler.response_serializer
        if response_serializer is not None:
            response_serializer = _counting(response_serializer, sent)
        wrapped = factory(
            wrap(behavior, self._method(service, method)),
            request_deserializer=request_deserializer,
            response_serializer=response_serializer,
        )
        self._wrapped[full_method] = (handler, wrapped)
        return wrapped

    def _method(self, service: str, method: str) -> _Method:
        traced = service not in self._probes
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        return _Method(service, method, f"/{service}/{method}", attributes if traced else None)

    def _wrap_coroutine(
        self, behavior: Callable[..., Any], method: _Method
    ) -> Callable[[Any, _Context], Awaitable[Any]]:
        async def handle(request: Any, context: _Context) -> Any:
            call = self._begin(method, request, context)
            with trace.use_span(
                call.span, end_on_exit=True, record_exception=False, set_status_on_exception=False
            ):
                try:
                    self._admit(call, request, context)
                    response = await behavior(request, context)
                except BaseException as exc:
                    await self._fail(call, exc, context)
                    raise
                self._done(call, context.code() or grpc.StatusCode.OK)
                return response

        return handle

    def _wrap_generator(
        self, behavior: Callable[..., AsyncIterator[Any]], method: _Method
    ) -> Callable[[Any, _Context], AsyncIterator[Any]]:
        async def handle(request: Any, context: _Context) -> AsyncIterator[Any]:
            call = self._begin(method, request, context)
            with trace.use_span(
                call.span, end_on_exit=True, record_exception=False, set_status_on_exception=False
            ):
                try:
                    self._admit(call, request, context)
                    async for response in behavior(request, context):
                        yield response
                except BaseException as exc:
                    await self._fail(call, exc, context)
                    raise
                self._done(call, context.code() or grpc.StatusCode.OK)

        return handle

    def _begin(self, method: _Method, request: Any, context: _Context) -> _Call:
        """Start the clock and the span, and give the call's log lines their ids (the task may
        carry stale ones)."""
        started = time.perf_counter()
        structlog.contextvars.clear_contextvars()
        # Read once: grpc builds a new tuple at every invocation_metadata().
        metadata = tuple(context.invocation_metadata() or ())
        ids: dict[str, str] = {
            "rpc_service": method.service,
            "rpc_method": method.method,
            "peer": context.peer(),
        }
        span: trace.Span = trace.INVALID_SPAN
        if method.span_attributes is not None:
            carrier = {k: v for k, v in metadata if k in _TRACE_HEADERS}
            span = self._tracer.start_span(
                method.span_name,
                context=propagate.extract(carrier) if carrier else None,
                kind=SpanKind.SERVER,
                attributes=method.span_attributes,
            )
            ctx = span.get_span_context()
            ids["trace_id"] = trace.format_trace_id(ctx.trace_id)
            ids["span_id"] = trace.format_span_id(ctx.span_id)
        # A streamed request is an iterator: it has no request_id.
        request_id = getattr(request, "request_id", None)
        if isinstance(request_id, str) and request_id:
            ids["request_id"] = request_id
        structlog.contextvars.bind_contextvars(**ids)
        return _Call(method.service, method.method, started, span, metadata)

    def _admit(self, call: _Call, request: Any, context: _Context) -> None:
        """Raise unless the request parsed and its caller may make it."""
        if isinstance(request, _Unparsed):
            if request.too_large:
                raise ResourceExhausted(
                    f"request of {request.size} bytes; at most {self._max_request_bytes}",
                    reason=ErrorReason.MESSAGE_TOO_LARGE,
                    metadata={"limit": str(self._max_request_bytes)},
                )
            raise InvalidArgument("request", f"{request.size} bytes that are not a {call.method} request")
        if self._authorizer is None or call.service in self._probes:
            return
        caller = self._authorizer.authenticate(call.metadata, context.auth_context())
        structlog.contextvars.bind_contextvars(caller=caller.identity)
        self._authorizer.authorize(caller, call.method, request)

    async def _fail(self, call: _Call, exc: BaseException, context: _Context) -> None:
        """Log and count a call that raised. A domain error or an unexpected exception becomes
        the call's status here (context.abort raises AbortError); otherwise this returns and the
        caller re-raises `exc` untouched."""
        if isinstance(exc, KvshuttleError):
            code = grpc.StatusCode[exc.code.value]
            self._done(call, code, reason=exc.reason)
            await self._abort(context, code, exc)
        elif isinstance(exc, grpc.aio.AbortError):  # the handler aborted: its status stands
            self._done(call, context.code(), details=context.details())
        elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
            # The client went away, its deadline passed, or the server's grace ran out.
            remaining = context.time_remaining()  # None without a deadline, despite the stubs
            late = remaining is not None and remaining <= 0
            self._done(call, grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED)
        elif isinstance(exc, NotImplementedError):
            # What generated servicer base classes raise for an RPC the service does not offer.
            self._done(call, grpc.StatusCode.UNIMPLEMENTED)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{call.method} is not implemented")
        elif isinstance(exc, Exception):
            self._done(call, grpc.StatusCode.INTERNAL, exc_info=exc)
            call.span.record_exception(exc)
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
        else:  # SystemExit, KeyboardInterrupt: the process is going down; still say so once
            self._done(call, grpc.StatusCode.UNKNOWN, exc_info=exc)

    async def _abort(self, context: _Context, code: grpc.StatusCode, err: KvshuttleError) -> Never:
        info = any_pb2.Any()
        info.Pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=self._domain, metadata=err.metadata))
        status = rpc_status.to_status(
            status_pb2.Status(code=code.value[0], message=err.message, details=[info])
        )
        await context.abort(status.code, status.details, status.trailing_metadata)

    def _done(self, call: _Call, code: grpc.StatusCode, **fields: Any) -> None:
        """The canonical line, the metrics and the span's status of one finished call."""
        seconds = time.perf_counter() - call.started
        if call.span.is_recording():
            call.span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code in _SPAN_ERRORS:
                details = fields.get("details") or fields.get("reason") or ""
                call.span.set_status(
                    Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name)
                )
        self._metrics.observe(call.service, call.method, code.name, seconds, str(fields.get("reason") or ""))
        if code in _AUTH_CODES:
            self._metrics.denied(call.service, call.method, str(fields.get("reason") or code.name))
        logger = self._assembled()
        log = logger.error if code in _SERVER_FAULTS else logger.info
        present = {key: value for key, value in fields.items() if value}
        log("rpc.done", method=call.method, code=code.name, ms=round(seconds * 1000, 2), **present)

    def _assembled(self) -> FilteringBoundLogger:
        """The logger, assembled again only once structlog is configured anew (configure_logging
        again, structlog.testing.capture_logs): lines still go where the configuration says."""
        config = tuple(structlog.get_config().values())
        bound = self._bound
        if (
            bound is None
            or len(bound[0]) != len(config)
            or any(a is not b for a, b in zip(bound[0], config, strict=True))
        ):
            bound = self._bound = (config, self._logger.bind())
        return bound[1]
