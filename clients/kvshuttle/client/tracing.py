"""The client side of a traced call: one CLIENT span per attempt, its context in the metadata.

Made by the client library itself rather than by gRPC client interceptors: grpc.aio runs each
interceptor as an extra task and call layer, which on a busy two-core host cost ~0.2 ms per
call (measured: bench/e2e_vllm.py's added latency), and the instrumentation's own unary
interceptor abandoned cancelled calls (opentelemetry-python-contrib#3271). The span follows
OpenTelemetry's semantic conventions for gRPC as its instrumentation does: named
`/package.Service/Method`, with rpc.system, rpc.service, rpc.method and rpc.grpc.status_code;
a client span is an error for any status but OK.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

__all__ = ["Metadata", "traced_attempt"]

Metadata = tuple[tuple[str, str], ...]


@contextmanager
def traced_attempt(tracer: trace.Tracer | None, method: str) -> Iterator[tuple[trace.Span, Metadata]]:
    """A CLIENT span for one attempt of `method` ("/package.Service/Method") and the metadata
    that carries its context; with `tracer` None, no span and no metadata. The span is not made
    current (a streaming call yields to its consumer while the span is open)."""
    if tracer is None:
        yield trace.INVALID_SPAN, ()
        return
    service, _, name = method.lstrip("/").partition("/")
    span = tracer.start_span(
        method,
        kind=SpanKind.CLIENT,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
    )
    try:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        yield span, tuple(carrier.items())
    except asyncio.CancelledError:
        record_status(span, grpc.StatusCode.CANCELLED)
        raise
    finally:
        span.end()


def record_status(span: trace.Span, code: grpc.StatusCode, details: str | None = None) -> None:
    """The call's status on its span."""
    if not span.is_recording():
        return
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name))
