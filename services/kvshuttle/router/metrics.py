"""Prometheus metrics of the router's decisions and of the caches one replica keeps."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvshuttle.router.chains import ChainCache
from kvshuttle.router.hints import RetentionHints
from kvshuttle.router.model import Decision, Reason

_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class CacheCollector(Collector):
    """The replica's prompt-chain cache and retention hints, read at scrape time."""

    def __init__(self, chains: ChainCache, hints: RetentionHints) -> None:
        self._chains = chains
        self._hints = hints

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        lookups = CounterMetricFamily(
            "kvshuttle_router_chain_lookups",
            "Prompt chains computed: hit = a remembered prefix was extended, miss = hashed whole.",
            labels=["outcome"],
        )
        lookups.add_metric(["hit"], self._chains.hits)
        lookups.add_metric(["miss"], self._chains.misses)
        yield lookups
        entries = GaugeMetricFamily(
            "kvshuttle_router_cache_entries", "Entries in the replica's caches.", labels=["cache"]
        )
        size = GaugeMetricFamily(
            "kvshuttle_router_cache_bytes", "Estimated bytes of the replica's caches.", labels=["cache"]
        )
        for name, cache in (("chains", self._chains), ("hints", self._hints)):
            entries.add_metric([name], len(cache))
            size.add_metric([name], cache.nbytes)
        yield entries
        yield size


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._registry = registry
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

    def watch_caches(self, chains: ChainCache, hints: RetentionHints) -> None:
        self._registry.register(CacheCollector(chains, hints))

    def decided(self, decision: Decision, reason: Reason, reused: int, recomputed: int) -> None:
        self.decisions.labels(decision.value, reason.value).inc()
        self.tokens.labels("reused").inc(reused)
        self.tokens.labels("recomputed").inc(recomputed)
