"""vLLM's per-request span, as the stand-in engine exports it with `--otlp-traces-endpoint`.

vLLM 0.32 (vllm/v1/engine/output_processor.py, `do_tracing`) ends one SERVER span named
`llm_request` per finished request: started at the request's arrival (wall clock), a child of
the `traceparent`/`tracestate` the request carried (a root otherwise), its `gen_ai.*` attributes
the request's timings and token counts. The stand-in sends the same span, with the times it
measured (no `time_in_queue`: it has no queue to tell apart from its prefill), so a stack over
stand-ins shows the trace shape real vLLM gives.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


class RequestSpans:
    """Exports `llm_request` spans to the OTLP/gRPC collector at `endpoint`."""

    def __init__(self, endpoint: str, service_name: str) -> None:
        self._provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("vllm.llm_engine")

    def finished(
        self,
        headers: Mapping[str, str],
        *,
        request_id: str,
        arrival_ns: int,
        first_token_s: float,
        e2e_s: float,
        prompt_tokens: int,
        completion_tokens: int,
        max_tokens: int | None,
    ) -> None:
        """One finished request; the times are seconds from its arrival (`arrival_ns`, wall clock)."""
        carrier = {h: headers[h] for h in ("traceparent", "tracestate") if h in headers}
        context = _PROPAGATOR.extract(carrier) if carrier else None
        attributes: dict[str, str | int | float] = {
            "gen_ai.latency.time_to_first_token": first_token_s,
            "gen_ai.latency.e2e": e2e_s,
            "gen_ai.usage.prompt_tokens": prompt_tokens,
            "gen_ai.usage.completion_tokens": completion_tokens,
            # No queue of its own to tell apart: arrival to first token, its KV read included.
            "gen_ai.latency.time_in_model_prefill": first_token_s,
            "gen_ai.latency.time_in_model_decode": e2e_s - first_token_s,
            "gen_ai.request.id": request_id,
        }
        if max_tokens:
            attributes["gen_ai.request.max_tokens"] = max_tokens
        span = self._tracer.start_span(
            "llm_request", context, SpanKind.SERVER, attributes, start_time=arrival_ns
        )
        span.end(end_time=arrival_ns + int(e2e_s * 1e9))

    def shutdown(self) -> None:
        """Export what is buffered (blocks up to the exporter's timeout)."""
        self._provider.shutdown()
