"""Prometheus metrics of the endpoint picker, one observation per request it picks for."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

# Tokenizing and one PlanTurn: a millisecond or two, tens under load.
_PICK_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class EppMetrics:
    """kvshuttle_epp_requests_total{outcome,status}, kvshuttle_epp_pick_seconds,
    kvshuttle_epp_picks_total{decision,reason}, kvshuttle_epp_served_total{match},
    kvshuttle_epp_picks_in_flight, and over router replicas kvshuttle_epp_router_picks_total{replica}
    and kvshuttle_epp_router_failovers_total{replica} (the configured addresses: bounded labels),
    and kvshuttle_epp_commits_resent_total."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = Counter(
            "kvshuttle_epp_requests",
            "Requests by outcome (planned, fallback, plain, refused, cancelled) and the HTTP status "
            "the picker answered with (200 when it picked; the ImmediateResponse's status otherwise).",
            ["outcome", "status"],
            registry=registry,
        )
        self.pick = Histogram(
            "kvshuttle_epp_pick_seconds",
            "From the end of the request body to the pick sent: parsing, tokenizing, PlanTurn.",
            buckets=_PICK_BUCKETS,
            registry=registry,
        )
        self.picks = Counter(
            "kvshuttle_epp_picks",
            "Picks by the plan's decision and reason (router_unavailable, no_decode_node, ... for "
            "picks made without a plan).",
            ["decision", "reason"],
            registry=registry,
        )
        self.served = Counter(
            "kvshuttle_epp_served",
            "Responses by whether the endpoint the data plane reports as served is the one picked "
            "(picked, other, unreported).",
            ["match"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "kvshuttle_epp_picks_in_flight",
            "Requests being planned now (bounded by max_concurrent_picks).",
            registry=registry,
        )
        self.router_picks = Counter(
            "kvshuttle_epp_router_picks",
            "Router calls by the replica that answered them (conversation affinity).",
            ["replica"],
            registry=registry,
        )
        self.commits_resent = Counter(
            "kvshuttle_epp_commits_resent",
            "CommitTurn calls sent again with the whole sequence: the router replica that "
            "answered did not hold the turn's prompt (PROMPT_NOT_HELD).",
            registry=registry,
        )
        self.router_failovers = Counter(
            "kvshuttle_epp_router_failovers",
            "Router calls moved on to the next-ranked replica because this one did not answer.",
            ["replica"],
            registry=registry,
        )
