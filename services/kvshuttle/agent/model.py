"""The agent's domain records: what it reports of its engine, its KV-event stream and its
lease, and the small pieces its loops share. No grpc, no sockets."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from kvshuttle.agent.pool.blocks import PoolStats
from kvshuttle.core.kv_events import EventBatch

__all__ = [
    "AgentStatus",
    "Backoff",
    "EngineState",
    "EventStreamStats",
    "LeaseState",
    "LiveBatch",
]


@dataclass(frozen=True, slots=True)
class LiveBatch:
    """A batch on its way from the engine's event stream to the registry.

    `restart`: the engine's sequence went back here (seq <= the last one received): the engine
    restarted, and the registry must see this batch as its new start.
    """

    batch: EventBatch
    restart: bool = False


@dataclass(slots=True)
class EventStreamStats:
    """Counters of the KV-event stream, since the agent started (monotonic except last_seq)."""

    endpoint: str = ""
    last_seq: int | None = None  # the last seq received live
    batches_received: int = 0  # live messages decoded
    batches_forwarded: int = 0  # batches the registry accepted (live and replayed)
    batches_dropped: int = 0  # live batches dropped because the forwarding queue was full
    # Batches never delivered, by reason: the registry's ErrorInfo reason when it refused them
    # (INVALID_ARGUMENT: a bug or a limit), the exception's type when the agent itself failed.
    batches_rejected: Counter[str] = field(default_factory=Counter)
    gaps_detected: int = 0  # ranges of seqs missing before a batch, relative to the registry
    gaps_filled: int = 0  # of those, ranges the replay endpoint filled completely
    replayed_batches: int = 0  # batches fetched from the replay endpoint and forwarded
    engine_restarts: int = 0  # the sequence went back (to 0, or below what was seen)
    registry_gaps: int = 0  # reports the registry answered with gap_detected
    foreign_topic: int = 0  # messages of another topic (a prefix of ours matched the filter)
    # An engine restart was seen but its batch was dropped: the next queued batch carries it.
    restart_pending: bool = False


@dataclass(slots=True)
class EngineState:
    """The agent's last view of its engine's HTTP server."""

    healthy: bool = False  # /health answered 200 at the last poll
    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    last_poll_time: float | None = None  # wall clock of the last completed poll
    polls: int = 0
    failed_polls: int = 0  # /health or /metrics unreachable or not 200
    missing_metrics: int = 0  # polls whose /metrics lacked one of the load metrics
    last_error: str = ""


@dataclass(slots=True)
class LeaseState:
    """The node's lease with the registry."""

    name: str  # nodes/{node}
    incarnation: int = 0  # 0: never registered
    registered: bool = False
    epoch: int = 0  # successful registrations by this agent (each starts a new incarnation)
    heartbeats: int = 0
    failed_heartbeats: int = 0
    failed_registrations: int = 0
    last_error: str = ""


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """GetStatus's answer, in domain terms."""

    lease: LeaseState
    http_endpoint: str
    engine_id: str
    engine: EngineState
    events: EventStreamStats
    pool: PoolStats | None = None  # None: the agent has no block pool


class Backoff:
    """Exponential backoff with jitter: the n-th delay is uniform in [cap / 10, cap], where
    cap = min(maximum, initial * 2 ** (n - 1)); `reset()` after a success."""

    def __init__(self, initial: float, maximum: float, *, rng: random.Random | None = None) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError("backoff must satisfy 0 < initial <= maximum")
        self._initial = initial
        self._maximum = maximum
        self._rng = rng or random.Random()
        self._attempt = 0

    def next(self) -> float:
        self._attempt += 1
        cap = min(self._maximum, self._initial * 2 ** min(self._attempt - 1, 32))
        # Never below a tenth of the cap: a failing peer must not be retried in a hot loop.
        return self._rng.uniform(cap / 10, cap)

    def reset(self) -> None:
        self._attempt = 0
