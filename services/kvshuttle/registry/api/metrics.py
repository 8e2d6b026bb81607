"""Prometheus metrics of the registry, read from the domain at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from kvshuttle.registry.service.registry import Registry


class RegistryCollector(Collector):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._registry.stats
        leases = GaugeMetricFamily("kvshuttle_registry_live_leases", "Live leases by kind.", labels=["kind"])
        for kind, count in self._registry.counts_by_kind().items():
            leases.add_metric([kind], count)
        yield leases
        expirations = CounterMetricFamily(
            "kvshuttle_registry_expirations", "Leases that lapsed, by kind.", labels=["kind"]
        )
        for kind in ("node", "retention", "claim"):
            expirations.add_metric([kind], stats.expirations[kind])
        yield expirations
        claims = CounterMetricFamily(
            "kvshuttle_registry_claims",
            "Claim attempts by outcome (GRANTED or the rejection reason).",
            labels=["outcome"],
        )
        for outcome, count in sorted(stats.claims.items()):
            claims.add_metric([outcome], count)
        yield claims
        yield CounterMetricFamily("kvshuttle_registry_retention_puts", "Retentions stored.", value=stats.puts)
        yield CounterMetricFamily(
            "kvshuttle_registry_retentions_replaced",
            "Retentions replaced by a newer generation.",
            value=stats.replaced,
        )
        yield CounterMetricFamily(
            "kvshuttle_registry_retentions_moved",
            "Claimed retentions handed to another node (MoveRetention).",
            value=stats.moves,
        )
        yield CounterMetricFamily(
            "kvshuttle_registry_retentions_evicted",
            "Retentions their holder removed to make room (EvictRetention).",
            value=stats.evictions,
        )
        yield CounterMetricFamily(
            "kvshuttle_registry_event_batches", "KV-event batches applied.", value=stats.event_batches
        )
        yield CounterMetricFamily(
            "kvshuttle_registry_event_gaps", "Event sequence gaps seen.", value=stats.event_gaps
        )
        yield CounterMetricFamily(
            "kvshuttle_registry_engine_restarts",
            "Engine restarts seen in event sequences.",
            value=stats.engine_restarts,
        )
        yield CounterMetricFamily(
            "kvshuttle_registry_watchers_dropped",
            "Watch streams closed because the watcher fell behind.",
            value=stats.watchers_dropped,
        )
        yield CounterMetricFamily(
            "kvshuttle_registry_feed_errors",
            "Changes the change feed could not take (committed, but no watcher hears of them).",
            value=stats.feed_errors,
        )
        index = self._registry.index.stats()
        yield GaugeMetricFamily(
            "kvshuttle_registry_indexed_blocks", "Blocks in the block index.", value=index.total_blocks
        )


def register_metrics(registry: Registry, prometheus: CollectorRegistry) -> None:
    prometheus.register(RegistryCollector(registry))
