"""Prometheus metrics of the router's decisions."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from kvshuttle.router.model import Decision, Reason

_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.decisions = Counter(
            "kvshuttle_router_decisions",
            "Planned turns by decision and reason.",
            ["decision", "reason"],
            registry=registry,
        )
        self.tokens = Counter(
            "kvshuttle_router_tokens",
            "Prompt tokens planned for reuse or recompute.",
            ["kind"],
            registry=registry,
        )
        self.plan_seconds = Histogram(
            "kvshuttle_router_plan_seconds",
            "PlanTurn latency, registry calls included.",
            buckets=_BUCKETS,
            registry=registry,
        )
        self.own_seconds = Histogram(
            "kvshuttle_router_own_seconds",
            "Router CPU time per call (this thread), registry waits excluded.",
            ["rpc"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.commits = Counter(
            "kvshuttle_router_commits", "CommitTurn outcomes.", ["outcome"], registry=registry
        )

    def decided(self, decision: Decision, reason: Reason, reused: int, recomputed: int) -> None:
        self.decisions.labels(decision.value, reason.value).inc()
        self.tokens.labels("reused").inc(reused)
        self.tokens.labels("recomputed").inc(recomputed)
