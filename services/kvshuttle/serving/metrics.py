"""Prometheus metrics every gRPC service exports, one sample per finished RPC."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

# .labels() takes a lock and builds a key on every call (issue 21: ~1.6 % of a registry's
# samples); the children of a (service, method, code) are looked up once. Bounded: only
# methods the server registered get here, and grpc has 17 codes.
_MAX_CACHED = 4096

# Control-plane RPCs take well under a millisecond in memory and a few with Redis; the default
# buckets (5 ms .. 10 s) would put nearly all of them in the first one.
_DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class RpcMetrics:
    """kvshuttle_rpc_total{service,method,code}, kvshuttle_rpc_duration_seconds{service,method},
    kvshuttle_rpc_rejections_total{service,method,reason},
    kvshuttle_auth_denied_total{service,method,reason}, and the serialized bytes of requests and
    responses, kvshuttle_rpc_request_bytes_total{service,method} and
    kvshuttle_rpc_response_bytes_total{service,method} (what each call carries on the wire,
    before gRPC's framing).

    Registers its collectors on `registry`: the process default in production, a fresh
    CollectorRegistry in tests (a registry refuses the same metric name twice).
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._total = Counter(
            "kvshuttle_rpc",
            "Finished RPCs by gRPC service, method and status code.",
            ["service", "method", "code"],
            registry=registry,
        )
        self._duration = Histogram(
            "kvshuttle_rpc_duration_seconds",
            "Time from the call reaching the service to its last response or error.",
            ["service", "method"],
            buckets=_DURATION_BUCKETS,
            registry=registry,
        )

        self._rejections = Counter(
            "kvshuttle_rpc_rejections",
            "RPCs refused with a domain error, by its ErrorInfo reason (e.g. RETENTION_EXPIRED).",
            ["service", "method", "reason"],
            registry=registry,
        )

        self._denied = Counter(
            "kvshuttle_auth_denied",
            "RPCs refused for their caller (UNAUTHENTICATED, PERMISSION_DENIED), by reason.",
            ["service", "method", "reason"],
            registry=registry,
        )

        self._request_bytes = Counter(
            "kvshuttle_rpc_request_bytes",
            "Serialized request bytes received, by gRPC service and method.",
            ["service", "method"],
            registry=registry,
        )
        self._response_bytes = Counter(
            "kvshuttle_rpc_response_bytes",
            "Serialized response bytes sent, by gRPC service and method.",
            ["service", "method"],
            registry=registry,
        )
        self._finished: dict[tuple[str, str, str], tuple[Counter, Histogram]] = {}

    def byte_counters(self, service: str, method: str) -> tuple[Counter, Counter]:
        """The request and response byte counters of one method, looked up once per method
        rather than on every call."""
        return (
            self._request_bytes.labels(service=service, method=method),
            self._response_bytes.labels(service=service, method=method),
        )

    def denied(self, service: str, method: str, reason: str) -> None:
        self._denied.labels(service=service, method=method, reason=reason).inc()

    def observe(self, service: str, method: str, code: str, seconds: float, reason: str = "") -> None:
        """Record one finished RPC; `code` is a grpc.StatusCode name such as "NOT_FOUND", `reason`
        the domain error's reason when the service refused it."""
        key = (service, method, code)
        children = self._finished.get(key)
        if children is None:
            children = (
                self._total.labels(service=service, method=method, code=code),
                self._duration.labels(service=service, method=method),
            )
            if len(self._finished) < _MAX_CACHED:
                self._finished[key] = children
        children[0].inc()
        children[1].observe(seconds)
        if reason:
            self._rejections.labels(service=service, method=method, reason=reason).inc()
