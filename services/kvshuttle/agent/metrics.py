"""Prometheus metrics of the agent, read from its state at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvshuttle.agent.agent import Agent
from kvshuttle.agent.pool.blocks import PoolStats

if TYPE_CHECKING:  # NIXL is imported only by an agent with a pool
    from kvshuttle.agent.pool.mover import MoveStats

_Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily


class AgentCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[_Family]:
        agent = self._agent
        lease, engine, events, decode = (
            agent.lease.state,
            agent.poller.state,
            agent.events,
            agent.decoder.stats,
        )
        yield GaugeMetricFamily(
            "kvshuttle_agent_registered", "1 while the node holds a lease.", value=int(lease.registered)
        )
        yield CounterMetricFamily(
            "kvshuttle_agent_registrations", "Successful registrations (lease epochs).", value=lease.epoch
        )
        failures = CounterMetricFamily(
            "kvshuttle_agent_registry_failures", "Failed lease calls by kind.", labels=["call"]
        )
        failures.add_metric(["register"], lease.failed_registrations)
        failures.add_metric(["heartbeat"], lease.failed_heartbeats)
        yield failures
        yield GaugeMetricFamily(
            "kvshuttle_agent_engine_healthy",
            "1 when the engine's /health answered 200.",
            value=int(engine.healthy),
        )
        yield CounterMetricFamily(
            "kvshuttle_agent_engine_failed_polls", "Engine polls that failed.", value=engine.failed_polls
        )
        batches = CounterMetricFamily(
            "kvshuttle_agent_event_batches", "KV-event batches by outcome.", labels=["outcome"]
        )
        for outcome, value in (
            ("received", events.batches_received),
            ("forwarded", events.batches_forwarded),
            ("dropped", events.batches_dropped),
            ("rejected", events.batches_rejected.total()),
            ("replayed", events.replayed_batches),
        ):
            batches.add_metric([outcome], value)
        yield batches
        rejected = CounterMetricFamily(
            "kvshuttle_agent_event_batches_rejected",
            "KV-event batches never delivered, by reason (the registry's, or the agent's own error).",
            labels=["reason"],
        )
        for reason, value in sorted(events.batches_rejected.items()):
            rejected.add_metric([reason], value)
        yield rejected
        gaps = CounterMetricFamily(
            "kvshuttle_agent_event_gaps", "Sequence gaps by outcome.", labels=["outcome"]
        )
        gaps.add_metric(["detected"], events.gaps_detected)
        gaps.add_metric(["filled"], events.gaps_filled)
        gaps.add_metric(["registry_reported"], events.registry_gaps)
        yield gaps
        yield CounterMetricFamily(
            "kvshuttle_agent_engine_restarts",
            "Engine restarts seen in the event sequence.",
            value=events.engine_restarts,
        )
        skipped = CounterMetricFamily(
            "kvshuttle_agent_events_skipped",
            "KV events or messages the decoder skipped, by cause.",
            labels=["cause"],
        )
        for cause, value in (
            ("malformed_message", decode.malformed_messages),
            ("malformed_payload", decode.malformed_payloads),
            ("malformed_event", decode.malformed_events),
            ("other_group", decode.other_group_events),
            ("unknown_type", decode.unknown_events),
        ):
            skipped.add_metric([cause], value)
        yield skipped
        yield CounterMetricFamily(
            "kvshuttle_agent_event_unknown_keys",
            "Event keys vLLM sent that the decoder does not know.",
            value=decode.unknown_keys,
        )
        yield GaugeMetricFamily(
            "kvshuttle_agent_event_queue", "Batches waiting to be forwarded.", value=agent.queue.qsize()
        )
        if agent.pool is not None:
            yield from _pool_metrics(agent.pool.stats())
        if agent.pool_lease is not None:
            yield GaugeMetricFamily(
                "kvshuttle_agent_pool_node_registered",
                "1 while the pool's node holds a lease.",
                value=int(agent.pool_lease.state.registered),
            )
        if agent.mover is not None:
            yield from _move_metrics(agent.mover.stats)
        if agent.server is not None:
            reads = CounterMetricFamily(
                "kvshuttle_agent_pool_reads",
                "Readers done with the pool's KV: single (its slots freed) or shared (a fork's read; kept).",
                labels=["kind"],
            )
            reads.add_metric(["single"], agent.server.reads)
            reads.add_metric(["shared"], agent.server.shared_reads)
            yield reads


def _move_metrics(stats: MoveStats) -> Iterator[_Family]:
    from kvshuttle.agent.pool.mover import READ_SECONDS_BUCKETS, MoveKind  # noqa: PLC0415

    moves = CounterMetricFamily(
        "kvshuttle_agent_moves",
        "KV moves into the pool (park, prefetch, pull) by outcome: moved, or the refusal's reason.",
        labels=["kind", "outcome"],
    )
    for (kind, outcome), value in sorted(stats.moves.items()):
        moves.add_metric([kind, outcome], value)
    yield moves
    moved = CounterMetricFamily(
        "kvshuttle_agent_moved_bytes", "Bytes read into the pool by moves, by kind.", labels=["kind"]
    )
    for kind in MoveKind:
        moved.add_metric([kind], stats.bytes[kind])
    yield moved
    reads = HistogramMetricFamily("kvshuttle_agent_move_read_seconds", "Seconds of a move's NIXL READ.")
    reads.add_metric(
        [],
        [(repr(bound), count) for bound, count in zip(READ_SECONDS_BUCKETS, stats.read_buckets, strict=False)]
        + [("+Inf", stats.read_buckets[-1])],
        stats.read_seconds_sum,
    )
    yield reads
    evictions = CounterMetricFamily(
        "kvshuttle_agent_pool_evictions",
        "Moved retentions freed from the pool unread, by why: pool_full (evicted for room), expired.",
        labels=["why"],
    )
    for why in ("pool_full", "expired"):
        evictions.add_metric([why], stats.evictions[why])
    yield evictions
    kept = CounterMetricFamily(
        "kvshuttle_agent_pool_evictions_refused",
        "Eviction candidates kept because the registry did not drop them, by reason.",
        labels=["reason"],
    )
    for reason, value in sorted(stats.evictions_refused.items()):
        kept.add_metric([reason], value)
    yield kept


def _pool_metrics(pool: PoolStats) -> Iterator[_Family]:
    yield GaugeMetricFamily(
        "kvshuttle_agent_pool_capacity_bytes",
        "Host memory of the block pool, registered with NIXL.",
        value=pool.capacity_bytes,
    )
    blocks = GaugeMetricFamily("kvshuttle_agent_pool_blocks", "Pool slots by state.", labels=["state"])
    blocks.add_metric(["used"], pool.used_blocks)
    blocks.add_metric(["free"], pool.free_blocks)
    yield blocks
    pool_bytes = GaugeMetricFamily("kvshuttle_agent_pool_bytes", "Pool bytes by state.", labels=["state"])
    pool_bytes.add_metric(["used"], pool.used_bytes)
    pool_bytes.add_metric(["free"], pool.free_bytes)
    yield pool_bytes
    retentions = GaugeMetricFamily(
        "kvshuttle_agent_pool_retentions", "Retentions holding pool slots, by state.", labels=["state"]
    )
    retentions.add_metric(["filling"], pool.filling_retentions)
    retentions.add_metric(["parked"], pool.parked_retentions)
    yield retentions
    yield CounterMetricFamily(
        "kvshuttle_agent_pool_expired_retentions",
        "Retentions whose pool slots expiry freed.",
        value=pool.expired_retentions,
    )
    yield CounterMetricFamily(
        "kvshuttle_agent_pool_failed_allocations",
        "Allocations refused for want of free slots.",
        value=pool.failed_allocations,
    )
