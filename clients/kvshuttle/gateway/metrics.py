"""Prometheus metrics of the gateway, one observation per finished request."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

# The gateway's own time is a millisecond or two; TTFT spans milliseconds to seconds.
_ADDED_BUCKETS = (0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)


class GatewayMetrics:
    """kvshuttle_gateway_requests_total{endpoint,status}, kvshuttle_gateway_added_seconds,
    kvshuttle_gateway_ttft_seconds, kvshuttle_gateway_turns_total{decision,reason},
    kvshuttle_gateway_reused_tokens_total, kvshuttle_gateway_commits_total{outcome},
    kvshuttle_gateway_commits_resent_total, kvshuttle_gateway_reuse_fallbacks_total{why},
    and with conversation affinity over router replicas kvshuttle_gateway_router_picks_total{replica} and
    kvshuttle_gateway_router_failovers_total{replica} (the replicas are the configured
    addresses, so the labels are bounded)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = Counter(
            "kvshuttle_gateway_requests",
            "Finished requests by endpoint and outcome (HTTP status, or client_disconnected).",
            ["endpoint", "status"],
            registry=registry,
        )
        self.added = Histogram(
            "kvshuttle_gateway_added_seconds",
            "The gateway's own time per request: wall time less the prefill and decode requests.",
            buckets=_ADDED_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "kvshuttle_gateway_ttft_seconds",
            "Time from the request's arrival to its first output written to the client.",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.turns = Counter(
            "kvshuttle_gateway_turns",
            "Planned turns by the router's decision and reason.",
            ["decision", "reason"],
            registry=registry,
        )
        self.reused_tokens = Counter(
            "kvshuttle_gateway_reused_tokens",
            "Prompt tokens planned to be read from retained KV instead of recomputed.",
            registry=registry,
        )
        self.commits = Counter(
            "kvshuttle_gateway_commits",
            "Background CommitTurn calls by outcome: stored, nothing_retained or failed.",
            ["outcome"],
            registry=registry,
        )
        self.commits_resent = Counter(
            "kvshuttle_gateway_commits_resent",
            "CommitTurn calls sent again with the whole sequence: the router replica that "
            "answered did not hold the turn's prompt (PROMPT_NOT_HELD).",
            registry=registry,
        )
        self.reuse_fallbacks = Counter(
            "kvshuttle_gateway_reuse_fallbacks",
            "Reuse turns whose prefill was run again as a plain recompute, by why: "
            "reuse_prefill_timeout or reuse_prefill_failed.",
            ["why"],
            registry=registry,
        )
        self.router_picks = Counter(
            "kvshuttle_gateway_router_picks",
            "Router calls by the replica that answered them (conversation affinity).",
            ["replica"],
            registry=registry,
        )
        self.router_failovers = Counter(
            "kvshuttle_gateway_router_failovers",
            "Router calls moved on to the next-ranked replica because this one did not answer.",
            ["replica"],
            registry=registry,
        )
