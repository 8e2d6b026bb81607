"""Prometheus metrics of the router's decisions and of the caches one replica keeps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvshuttle.router.chains import ChainCache
from kvshuttle.router.hints import RetentionHints
from kvshuttle.router.model import Decision, Reason

_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# A move: claim, one agent READ of a whole retention, the registry's move.
_MOVE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...

    def __len__(self) -> int: ...


class CacheCollector(Collector):
    """The replica's prompt-chain cache, retention hints and (given) the prompts it holds for
    the turns it planned, read at scrape time."""

    def __init__(self, chains: ChainCache, hints: RetentionHints, prompts: _Sized | None = None) -> None:
        self._chains = chains
        self._hints = hints
        self._prompts = prompts

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
        caches: list[tuple[str, _Sized]] = [("chains", self._chains), ("hints", self._hints)]
        if self._prompts is not None:
            caches.append(("prompts", self._prompts))
        for name, cache in caches:
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
        self.turn_ends = Counter(
            "kvshuttle_router_turn_ends",
            "Committed turns by how the answer ended (CommitTurn's turn_end): tool_call, stop, "
            "length, unspecified.",
            ["end"],
            registry=registry,
        )
        self.conversations_found = Counter(
            "kvshuttle_router_conversations_found",
            "Plans of requests that named only their tenant, by how their conversation was "
            "settled: continued = a retention's whole chain is a prefix of the prompt (the turn "
            "continues its conversation), forked = such a retention another turn had claimed (a "
            "sibling of a fork: the turn starts a conversation forked from it), new = none is.",
            ["outcome"],
            registry=registry,
        )
        self.retention_hints = Counter(
            "kvshuttle_router_retention_hints",
            "Plans of a conversation by this replica's retention hint: hit = its claim confirmed "
            "it (no registry read), refused = not confirmed (planned again on the registry's "
            "word), miss = this replica stored none for the conversation (its last commit was "
            "elsewhere, or none yet).",
            ["outcome"],
            registry=registry,
        )

        self.plan_holders = Counter(
            "kvshuttle_router_plan_holders",
            "Reuse plans by the role of the node prefill reads from (pool: an agent's pool).",
            ["role"],
            registry=registry,
        )
        self.released = Counter(
            "kvshuttle_router_retentions_released",
            "Retentions a recomputing plan superseded and had prefill release unread (its "
            "holder notified, its blocks freed at once rather than at the engine's TTL).",
            registry=registry,
        )
        self.holders_not_serving = Counter(
            "kvshuttle_router_pool_holders_not_serving",
            "Plans that would have read from an agent's pool whose agent did not answer "
            "(planned as recomputes, NODE_DOWN).",
            registry=registry,
        )
        self.claims_given_back = Counter(
            "kvshuttle_router_claims_given_back",
            "Claims a plan gave back unread because its caller had stopped waiting (the RPC's "
            "deadline passed, or it was cancelled): the retention stays for the next turn.",
            registry=registry,
        )
        self.moves = Counter(
            "kvshuttle_router_moves",
            "Shuttle moves of retentions into agents' pools: kind park|prefetch, why it was "
            "due (idle, kv_usage, pin_ending, think_time), outcome (moved, skipped_*, failed_*).",
            ["kind", "reason", "outcome"],
            registry=registry,
        )
        self.moved_bytes = Counter(
            "kvshuttle_router_moved_bytes", "KV bytes the shuttle moved.", ["kind"], registry=registry
        )
        self.move_seconds = Histogram(
            "kvshuttle_router_move_seconds",
            "Moves that reached the agent: claim to the registry's move (or the failure).",
            ["kind"],
            buckets=_MOVE_BUCKETS,
            registry=registry,
        )
        self.scheduled = Gauge(
            "kvshuttle_router_shuttle_scheduled",
            "Conversations the shuttle has scheduled (moves in flight excluded).",
            registry=registry,
        )
        self.moves_in_flight = Gauge(
            "kvshuttle_router_moves_in_flight", "Shuttle moves running now.", registry=registry
        )

        # The children of the per-call series, looked up once (labels() validates and locks).
        self.own_plan = self.own_seconds.labels("PlanTurn")
        self.own_commit = self.own_seconds.labels("CommitTurn")
        self.own_abort = self.own_seconds.labels("AbortTurn")
        self._reused_tokens = self.tokens.labels("reused")
        self._recomputed_tokens = self.tokens.labels("recomputed")
        self._children: dict[tuple[object, ...], Any] = {}

    def child(self, metric: Counter, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: label sets here are few (enums, outcomes)."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def watch_caches(self, chains: ChainCache, hints: RetentionHints, prompts: _Sized | None = None) -> None:
        self._registry.register(CacheCollector(chains, hints, prompts))

    def committed(self, outcome: str, end: str) -> None:
        self.child(self.commits, outcome).inc()
        self.child(self.turn_ends, end).inc()

    def decided(self, decision: Decision, reason: Reason, reused: int, recomputed: int) -> None:
        self.child(self.decisions, decision.value, reason.value).inc()
        self._reused_tokens.inc(reused)
        self._recomputed_tokens.inc(recomputed)
