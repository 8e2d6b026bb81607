"""The work this router replica has placed on each node and no report has shown it yet.

A node's load as the registry lists it is up to a heartbeat plus the node list's refresh old
(0-2.5 s as deployed), and it counts requests, not their size. A burst of turns planned inside
that window would all see the same idle node; this replica's own placements fill the gap:

* **Prefill**: every plan adds its estimated prefill compute (the cost model's, queueing
  excluded) to the node's virtual queue, which drains in real time: the node is expected busy
  with this replica's work until `busy_until`. A turn seen finished (committed or aborted:
  its prefill is over) takes what is left of its own work off the queue at once. What other
  replicas placed reaches this one only through the node's reported requests; the larger of
  the two views counts, so this replica's own work is never counted twice (it is in both once
  the report covers it).
* **Short turns**: when this replica last placed a prefill shorter than the short lane's line
  on each node (kvshuttle.router.placement keeps the lane only on nodes short turns use).
* **Decode**: the turns this replica placed on the node in the last `window_s` and has not
  seen committed or aborted: the node's reports count them after that (a heartbeat and the node
  list's refresh: 2.5 s as deployed; the window doubles it). They add to the reported requests: a
  turn reported and still in the window counts twice for a moment, where the larger of the two
  would count the new ones not at all while older ones fill the report. Bounded in time, a
  turn committed on another replica (a gateway balancing calls round robin) is not counted here
  for its whole answer.

Both are bounded: queues by the number of nodes seen (a node not planned on for
`forget_after_s` is dropped), turns by `max_turns` (the oldest go first) and by the window, a
turn's prefill work by `max_turns` and by its end (queued work already done is forgotten).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PlacementLedger"]


@dataclass(slots=True)
class _Queue:
    busy_until: float = 0.0
    # Smoothed estimate of one prefill placed on the node (ms): what a reported request weighs.
    typical_ms: float = 0.0
    # When this replica last placed a short prefill here (monotonic; -inf: never).
    short_at: float = float("-inf")


class PlacementLedger:
    def __init__(
        self,
        *,
        max_turns: int = 100_000,
        window_s: float = 5.0,
        forget_after_s: float = 600.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._monotonic = monotonic
        self._max_turns = max_turns
        self._window_s = window_s
        self._forget_after_s = forget_after_s
        self._queues: dict[str, _Queue] = {}
        self._typical_ms = 0.0  # across nodes: a node this replica has not placed on yet
        # turn id -> (decode node, expires at on the monotonic clock)
        self._turns: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._in_flight: dict[str, int] = {}
        # turn id -> (prefill node, its estimate in ms, when its work is expected done)
        self._work: OrderedDict[str, tuple[str, float, float]] = OrderedDict()

    # -- prefill -----------------------------------------------------------------------------

    def queued_ms(self, node: str, reported_requests: int, unknown_ms: float) -> float:
        """How long a prefill placed on `node` now is expected to wait: this replica's own work
        still queued there, or the node's reported requests at the typical prefill's cost
        (`unknown_ms` while this replica has placed none), whichever is more."""
        queue = self._queues.get(node)
        now = self._monotonic()
        own = max(queue.busy_until - now, 0.0) * 1e3 if queue is not None else 0.0
        typical = queue.typical_ms if queue is not None and queue.typical_ms else self._typical_ms
        return max(own, reported_requests * (typical or unknown_ms))

    def placed_prefill(
        self, node: str, estimate_ms: float, turn_id: str = "", *, short: bool = False
    ) -> None:
        now = self._monotonic()
        queue = self._queues.get(node)
        if queue is None:
            self._forget_idle(now)
            queue = self._queues[node] = _Queue(busy_until=now)
        if short:
            queue.short_at = now
        queue.busy_until = max(queue.busy_until, now) + estimate_ms / 1e3
        queue.typical_ms = _smoothed(queue.typical_ms, estimate_ms)
        self._typical_ms = _smoothed(self._typical_ms, estimate_ms)
        if turn_id:
            while self._work and (
                len(self._work) >= self._max_turns or next(iter(self._work.values()))[2] <= now
            ):
                self._work.popitem(last=False)
            self._work[turn_id] = (node, estimate_ms, queue.busy_until)

    def took_short_within(self, node: str, window_s: float) -> bool:
        """Whether this replica placed a short prefill on `node` in the last `window_s`."""
        queue = self._queues.get(node)
        return queue is not None and self._monotonic() - queue.short_at <= window_s

    def _prefill_done(self, turn_id: str) -> None:
        """What is left of the turn's queued work comes off its node's queue (all of it when the
        queue has not reached it yet; none once it was expected done)."""
        work = self._work.pop(turn_id, None)
        queue = self._queues.get(work[0]) if work is not None else None
        if work is None or queue is None:
            return
        now = self._monotonic()
        left = min(work[1] / 1e3, max(work[2] - now, 0.0))
        queue.busy_until = max(queue.busy_until - left, now)

    def _forget_idle(self, now: float) -> None:
        idle = [n for n, q in self._queues.items() if now - q.busy_until > self._forget_after_s]
        for name in idle:
            del self._queues[name]

    # -- decode ------------------------------------------------------------------------------

    def unreported(self, node: str) -> int:
        """Turns this replica placed on `node` for decode in the last window and has not seen
        finish: those the node's reports may not show yet."""
        self._expire(self._monotonic())
        return self._in_flight.get(node, 0)

    def placed_decode(self, turn_id: str, node: str) -> None:
        now = self._monotonic()
        self._expire(now)
        if turn_id in self._turns:
            return
        if len(self._turns) >= self._max_turns:
            self._drop(next(iter(self._turns)))
        self._turns[turn_id] = (node, now + self._window_s)
        self._in_flight[node] = self._in_flight.get(node, 0) + 1

    def finished(self, turn_id: str) -> None:
        """The turn was committed or aborted: its prefill is over and its decode no longer in
        flight."""
        self._prefill_done(turn_id)
        if turn_id in self._turns:
            self._drop(turn_id)

    def _expire(self, now: float) -> None:
        # Turns are added in plan order with one window, so the oldest expires first.
        while self._turns:
            turn_id, (_, expires_at) = next(iter(self._turns.items()))
            if expires_at > now:
                break
            self._drop(turn_id)

    def _drop(self, turn_id: str) -> None:
        node, _ = self._turns.pop(turn_id)
        left = self._in_flight[node] - 1
        if left:
            self._in_flight[node] = left
        else:
            del self._in_flight[node]


def _smoothed(average: float, sample: float, weight: float = 0.1) -> float:
    return sample if average == 0.0 else average + weight * (sample - average)
