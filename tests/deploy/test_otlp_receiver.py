"""The in-process OTLP receiver (deploy/local/otlp.py) against the SDK's own OTLP/gRPC
exporter: what a service exports arrives whole (ids, parent, service, kind, times, attributes),
and the trace tree shows parent and child, and a span whose parent never arrived as a root."""

from __future__ import annotations

import asyncio

from deploy.local.otlp import OtlpReceiver, trace_tree
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind


async def test_exported_spans_arrive_whole_and_make_a_tree() -> None:
    receiver = OtlpReceiver()
    await receiver.start()
    try:
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "svc-a"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint)))
        tracer = provider.get_tracer("t")
        caller = trace.SpanContext(0xABC, 0x123, is_remote=True, trace_flags=trace.TraceFlags(1))

        def spans() -> tuple[int, int]:  # the exporter blocks: off the receiver's loop
            with (
                tracer.start_as_current_span("root", kind=SpanKind.SERVER) as root,
                tracer.start_as_current_span("child", attributes={"n": 7, "x": 0.5}),
            ):
                pass
            tracer.start_span("late", trace.set_span_in_context(trace.NonRecordingSpan(caller))).end()
            return root.get_span_context().trace_id, root.get_span_context().span_id

        trace_id, root_id = await asyncio.to_thread(spans)
        await asyncio.to_thread(provider.shutdown)
    finally:
        await receiver.stop()

    # Settled (no new span for a while: what `python -m deploy.local.otlp` prints) in arrival order.
    assert receiver.settled(0.0) == [format(trace_id, "032x"), format(0xABC, "032x")]
    assert receiver.settled(3600.0) == []
    got = receiver.trace(format(trace_id, "032x"))
    assert [(s.name, s.service, s.kind) for s in got] == [
        ("root", "svc-a", "SERVER"),
        ("child", "svc-a", "INTERNAL"),
    ]
    root, child = got
    assert (root.parent_id, child.parent_id) == ("", format(root_id, "016x"))
    assert child.attributes == {"n": 7, "x": 0.5}
    assert root.start_ns <= child.start_ns <= child.end_ns <= root.end_ns
    tree = trace_tree(got, ["n"]).splitlines()
    assert tree[0] == f"trace {root.trace_id}: 2 spans"
    assert tree[1].startswith("root ") and "svc-a" in tree[1] and "SERVER" in tree[1]
    assert tree[2].startswith("└─ child ") and tree[2].endswith("n=7")

    (late,) = receiver.trace(format(0xABC, "032x"))
    assert late.parent_id == format(0x123, "016x")
    assert trace_tree([late]).splitlines()[1].endswith(f"(parent {late.parent_id} not received)")
