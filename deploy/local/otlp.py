"""An OTLP/gRPC trace collector in this process, and the trace tree of what it received.

What the local stacks export to when a test, the demo or a benchmark wants the spans of a turn
without running an OpenTelemetry Collector: kvshuttle's services (TELEMETRY__OTLP_ENDPOINT) and
vLLM (`--otlp-traces-endpoint`) both speak OTLP/gRPC to it.

    with receiver_in_thread() as receiver:          # 127.0.0.1, a free port
        receiver.endpoint                            # "http://127.0.0.1:PORT": give it to both
        spans = receiver.wait_for(lambda got: ..., timeout=30)
        print(trace_tree(receiver.trace(trace_id)))

`OtlpReceiver` itself is a grpc.aio server (start/stop on the caller's loop); `receiver_in_thread`
runs one on a loop of its own for synchronous callers. Spans are kept in arrival order, the
oldest dropped past `max_spans`.

Run as a program it is a collector for a look without installing one: it prints each turn's
trace tree once the trace has had no new span for `--settle` seconds.

    python -m deploy.local.otlp [--listen 127.0.0.1:4317]   # then: make demo OTLP_ENDPOINT=http://127.0.0.1:4317
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tpb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

__all__ = ["OTLP_ENDPOINT_ENV", "OtlpReceiver", "Span", "receiver_in_thread", "trace_tree"]

# The local stacks' one setting for tracing: the OTLP/gRPC collector every service and engine
# exports to (`make demo`, deploy/local/launch.py).
OTLP_ENDPOINT_ENV = "KVSHUTTLE_OTLP_ENDPOINT"

_KINDS = {
    SpanProto.SPAN_KIND_INTERNAL: "INTERNAL",
    SpanProto.SPAN_KIND_SERVER: "SERVER",
    SpanProto.SPAN_KIND_CLIENT: "CLIENT",
    SpanProto.SPAN_KIND_PRODUCER: "PRODUCER",
    SpanProto.SPAN_KIND_CONSUMER: "CONSUMER",
}


@dataclass(frozen=True, slots=True)
class Span:
    """One received span; ids as lowercase hex (parent_id "" for a root)."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def spans_of(request: tpb.ExportTraceServiceRequest) -> list[Span]:
    out: list[Span] = []
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        service = str(resource.get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    Span(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        service=service,
                        kind=_KINDS.get(s.kind, "UNSPECIFIED"),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={kv.key: _value(kv.value) for kv in s.attributes},
                    )
                )
    return out


class OtlpReceiver(tpb_grpc.TraceServiceServicer):
    """OTLP/gRPC TraceService on 127.0.0.1 (a free port unless `port`); thread-safe reads."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, max_spans: int = 200_000) -> None:
        self._host, self._port = host, port
        self._spans: deque[Span] = deque(maxlen=max_spans)
        # Trace id -> when its latest span arrived (monotonic), oldest first; as bounded.
        self._arrived: OrderedDict[str, float] = OrderedDict()
        self._max_traces = max_spans
        self._changed = threading.Condition()
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        """What an OTLP/gRPC exporter is given: `http://` (plaintext) host:port."""
        return f"http://{self._host}:{self.port}"

    async def start(self) -> None:
        self._server = grpc.aio.server()
        tpb_grpc.add_TraceServiceServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port(f"{self._host}:{self._port}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None

    async def Export(
        self,
        request: tpb.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext[tpb.ExportTraceServiceRequest, tpb.ExportTraceServiceResponse],
    ) -> tpb.ExportTraceServiceResponse:
        got = spans_of(request)
        now = time.monotonic()
        with self._changed:
            self._spans.extend(got)
            for span in got:
                self._arrived[span.trace_id] = now
                self._arrived.move_to_end(span.trace_id)
            while len(self._arrived) > self._max_traces:
                self._arrived.popitem(last=False)
            self._changed.notify_all()
        return tpb.ExportTraceServiceResponse()

    def settled(self, quiet_s: float) -> list[str]:
        """The traces whose latest span arrived over `quiet_s` seconds ago, oldest first."""
        cutoff = time.monotonic() - quiet_s
        with self._changed:
            return [trace_id for trace_id, at in self._arrived.items() if at <= cutoff]

    def spans(self) -> list[Span]:
        with self._changed:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[Span]:
        """The spans of one trace, in start order."""
        return sorted((s for s in self.spans() if s.trace_id == trace_id), key=lambda s: s.start_ns)

    def wait_for(self, done: Callable[[list[Span]], bool], timeout: float) -> list[Span]:
        """Every span received, once `done` holds for them; TimeoutError (naming what arrived)
        when it does not within `timeout` seconds. Exporters batch: spans come seconds late."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self._spans})
                    raise TimeoutError(
                        f"not received in {timeout:.0f} s; have {len(self._spans)} spans: {names}"
                    )
                self._changed.wait(left)
            return list(self._spans)


@contextmanager
def receiver_in_thread(**kwargs: Any) -> Iterator[OtlpReceiver]:
    """An `OtlpReceiver` serving on an event loop of its own thread, for synchronous callers."""
    receiver = OtlpReceiver(**kwargs)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(receiver.start(), loop).result(timeout=10)
        yield receiver
    finally:
        asyncio.run_coroutine_threadsafe(receiver.stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def trace_tree(spans: Sequence[Span], attributes: Iterable[str] = ()) -> str:
    """One trace as an indented tree: name, service, kind, duration, offset from the trace's
    start, and the given attributes where a span has them; children in start order. A span
    whose parent was not received (a caller's, or lost) is shown as a root."""
    if not spans:
        return "(no spans)"
    wanted = tuple(attributes)
    ids = {s.span_id for s in spans}
    children: dict[str, list[Span]] = {}
    roots: list[Span] = []
    for s in sorted(spans, key=lambda s: s.start_ns):
        if s.parent_id and s.parent_id in ids:
            children.setdefault(s.parent_id, []).append(s)
        else:
            roots.append(s)
    t0 = min(s.start_ns for s in spans)
    rows: list[tuple[str, Span]] = []

    def walk(span: Span, prefix: str, last: bool, top: bool) -> None:
        branch = "" if top else ("└─ " if last else "├─ ")
        rows.append((prefix + branch + span.name, span))
        below = children.get(span.span_id, [])
        extend = "" if top else ("   " if last else "│  ")
        for i, child in enumerate(below):
            walk(child, prefix + extend, i == len(below) - 1, False)

    for root in roots:
        walk(root, "", True, True)
    width = max(len(label) for label, _ in rows)
    service_width = max(len(s.service) for _, s in rows)
    lines = [f"trace {spans[0].trace_id}: {len(spans)} spans"]
    for label, s in rows:
        line = (
            f"{label:<{width}}  {s.service:<{service_width}}  {s.kind:<8}"
            f" {s.duration_ms:9.2f} ms  @{(s.start_ns - t0) / 1e6:8.2f} ms"
        )
        if s.parent_id and s.parent_id not in ids:
            line += f"  (parent {s.parent_id} not received)"
        extra = [f"{k}={_short(s.attributes[k])}" for k in wanted if k in s.attributes]
        lines.append(line + ("  " + " ".join(extra) if extra else ""))
    return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m deploy.local.otlp",
        description="An OTLP/gRPC collector that prints each trace's tree once it has settled.",
    )
    ap.add_argument("--listen", default="127.0.0.1:4317", help="host:port (default: %(default)s)")
    ap.add_argument(
        "--settle",
        type=float,
        default=8.0,
        help="seconds without a new span before a trace is printed (exporters send every 5 s)",
    )
    ap.add_argument(
        "--root",
        default="turn",
        help="print only traces with a span of this name (default: the gateway's turns); '' for all",
    )
    ap.add_argument(
        "--attributes",
        default="kvshuttle.decision,kvshuttle.reused_tokens,gen_ai.latency.time_in_queue,"
        "gen_ai.latency.time_to_first_token,gen_ai.latency.time_in_model_prefill",
        help="comma-separated span attributes to show",
    )
    args = ap.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    shown = [a for a in args.attributes.split(",") if a]
    done: OrderedDict[str, None] = OrderedDict()
    with receiver_in_thread(host=host.strip("[]"), port=int(port)) as receiver, _sigterm_interrupts():
        print(f"collecting OTLP/gRPC traces on {receiver.endpoint}; Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(1.0)
                settled = [t for t in receiver.settled(args.settle) if t not in done]
                if not settled:
                    continue
                by_trace: dict[str, list[Span]] = {}
                for span in receiver.spans():
                    by_trace.setdefault(span.trace_id, []).append(span)
                for trace_id in settled:
                    spans = sorted(by_trace.get(trace_id, []), key=lambda s: s.start_ns)
                    # A turn's root span ends last (after a long decode, say): until it came,
                    # the trace is not done. (A caller's `traceparent` makes `turn` a child.)
                    wanted = any(s.name == args.root for s in spans) if args.root else False
                    if not wanted and not any(not s.parent_id for s in spans):
                        continue
                    done[trace_id] = None
                    if len(done) > 100_000:
                        done.popitem(last=False)
                    if wanted or not args.root:
                        print(trace_tree(spans, shown) + "\n", flush=True)
        except KeyboardInterrupt:
            return 0


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops the collector as Ctrl-C does."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    raise SystemExit(main())
