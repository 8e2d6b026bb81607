"""Prometheus metrics of the sidecar (beside the gateway code's kvshuttle_gateway_* metrics of
the turns it runs)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter

__all__ = ["SidecarMetrics"]


class SidecarMetrics:
    """kvshuttle_sidecar_requests_total{mode}, kvshuttle_sidecar_plain_total{why},
    kvshuttle_sidecar_ssrf_refused_total{target} and kvshuttle_sidecar_prefill_failures_total.
    Every label's values are a fixed set (the app's constants)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = Counter(
            "kvshuttle_sidecar_requests",
            "Completion requests by the headers they came with: kvshuttle (a planned turn), llmd "
            "(x-prefiller-host-port alone: plain P->D) or local (neither: this pod's decode alone).",
            ["mode"],
            registry=registry,
        )
        self.plain = Counter(
            "kvshuttle_sidecar_plain",
            "Requests with kvshuttle's headers served plain instead, by why (unplanned, "
            "bad_plan, turn_mismatch, stale_plan, prefiller_mismatch, prefill_refused, kv_source_refused, "
            "prompt_mismatch, turn_failed).",
            ["why"],
            registry=registry,
        )
        self.ssrf_refused = Counter(
            "kvshuttle_sidecar_ssrf_refused",
            "Targets refused by the SSRF guard (not a live registered node), by target: prefill "
            "or kv_source.",
            ["target"],
            registry=registry,
        )
        self.prefill_failures = Counter(
            "kvshuttle_sidecar_prefill_failures",
            "Plain P->D prefills that failed (5xx, timeout, no connection): decode computed the prompt.",
            registry=registry,
        )
