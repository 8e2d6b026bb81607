"""The one `request.done` line of a request, the same facts on its `turn` span, and the
metrics observed when it ends. The line carries what the lead's benchmark reads, `added_ms`
included: the wall time less the prefill and decode requests."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvshuttle.core.digest import log_digest
from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.gateway.turns.record import Turn

__all__ = ["RequestLog"]

log = structlog.get_logger("kvshuttle.gateway")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


@dataclass(slots=True)
class RequestLog:
    """The fields of the `request.done` line, in its order."""

    endpoint: str
    request_id: str
    client_request_id: str = ""
    model: str = ""
    tenant: str = ""
    conversation: str = ""
    stream: bool = False
    status: int = 0
    outcome: str = "ok"
    error: str = ""
    decision: str = ""
    reason: str = ""
    # A reuse turn run again as a plain recompute: why (Turn.fallback).
    fallback: str = ""
    generation: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    output_tokens: int = 0
    remote_cached_tokens: int | None = None
    stop_strings: bool = False
    tokenize_ms: float | None = None
    plan_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    # Waiting for the conversation's previous commit (in flight when this turn arrived).
    wait_ms: float | None = None
    ttft_ms: float | None = None
    # Decode's time to its first byte (streaming) or to its whole answer.
    decode_ttfb_ms: float | None = None
    # The gateway's share of the client's TTFT: ttft - prefill - decode's first byte.
    ttft_added_ms: float | None = None
    total_ms: float | None = None
    added_ms: float | None = None

    def fields(self) -> dict[str, Any]:
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None and v != ""}

    def add_turn(self, turn: Turn) -> None:
        """What the turn planned and measured, as far as it got."""
        self.decision, self.reason, self.fallback = turn.decision, turn.reason, turn.fallback
        if turn.conversation and not self.conversation:  # found by the router, or started by it
            self.conversation = log_digest(turn.conversation)
        self.generation, self.reused_tokens = turn.generation, turn.reused_tokens
        if turn.outcome:
            self.outcome = turn.outcome
        self.output_tokens = turn.output_tokens
        self.remote_cached_tokens = turn.remote_cached_tokens
        self.wait_ms, self.plan_ms = _ms(turn.wait_s), _ms(turn.plan_s)
        self.prefill_ms, self.decode_ms = _ms(turn.prefill_s), _ms(turn.decode_s)
        self.ttft_ms, self.decode_ttfb_ms = _ms(turn.ttft_s), _ms(turn.decode_ttfb_s)

    def finish(self, start: float, span: trace.Span, metrics: GatewayMetrics) -> None:
        """Log the line (`start`: the request's arrival), set the span's attributes and status,
        and observe the metrics."""
        total_ms = round((time.perf_counter() - start) * 1e3, 3)
        self.total_ms = total_ms
        self.added_ms = added_ms = round(total_ms - (self.prefill_ms or 0.0) - (self.decode_ms or 0.0), 3)
        if self.ttft_ms is not None and self.prefill_ms is not None and self.decode_ttfb_ms is not None:
            self.ttft_added_ms = round(self.ttft_ms - self.prefill_ms - self.decode_ttfb_ms, 3)
        ctx = span.get_span_context()
        log.info("request.done", trace_id=format(ctx.trace_id, "032x"), **self.fields())
        attributes: dict[str, Any] = {
            "http.response.status_code": self.status,
            "kvshuttle.outcome": self.outcome,
            "kvshuttle.endpoint": self.endpoint,
            "kvshuttle.prompt_tokens": self.prompt_tokens,
            "kvshuttle.output_tokens": self.output_tokens,
            "kvshuttle.added.ms": added_ms,
        }
        for name, value in (
            ("kvshuttle.tenant", self.tenant),
            ("kvshuttle.conversation", self.conversation),
            ("kvshuttle.decision", self.decision),
            ("kvshuttle.decision.reason", self.reason),
            ("kvshuttle.fallback", self.fallback),
            ("kvshuttle.turn_index", self.generation or None),
            ("kvshuttle.reused_tokens", self.reused_tokens if self.decision else None),
            ("kvshuttle.remote_cached_tokens", self.remote_cached_tokens),
            ("kvshuttle.commit_wait.ms", self.wait_ms),
            ("kvshuttle.ttft.ms", self.ttft_ms),
            ("kvshuttle.tokenize.ms", self.tokenize_ms),
            ("kvshuttle.prefill.ms", self.prefill_ms),
            ("kvshuttle.decode.ms", self.decode_ms),
        ):
            if value is not None and value != "":
                attributes[name] = value
        span.set_attributes(attributes)
        if self.status >= 500 or self.outcome not in ("ok", "client_disconnected"):
            span.set_status(Status(StatusCode.ERROR, self.error or self.outcome))
        metrics.requests.labels(self.endpoint, str(self.status)).inc()
        if self.decision:
            metrics.added.observe(added_ms / 1e3)
        if self.ttft_ms is not None:
            metrics.ttft.observe(self.ttft_ms / 1e3)
