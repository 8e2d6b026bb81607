"""The KV-event forwarder: batches from the receiver's queue to the registry's block index, in
sequence order, with the gaps filled from the engine's replay endpoint.

The forwarder keeps a cursor: the seq the registry expects next from this node. It learns it
when a registration starts (an empty ReportBlockEvents answers it; 0 means the registry holds
nothing of the node's sequence, e.g. after a registry restart or a lapsed lease) and from every
report's `next_seq` (the registry's word wins over the agent's arithmetic). For each batch, in
order:

* seq == cursor: forwarded.
* seq > cursor: a gap (the engine's PUB dropped messages, the queue was full, the agent started
  late, the registry lost the node's index). The missing range [cursor, seq) is fetched from the
  replay endpoint and forwarded first; what the replay cannot give is skipped, and the registry
  reports the gap (`gap_detected`).
* flagged `restart` (the receiver saw the seq go back), or seq < cursor for the first batch the
  agent receives (the engine restarted while the agent was away): the engine restarted. The
  registry only treats seq 0 as a restart, so the batches from 0 are fetched from the replay
  endpoint, and when seq 0 cannot be had an empty batch with seq 0 stands in for it (it clears
  the node's index, which is what a restarted engine's cache is: empty).
* any other seq < cursor: already in the registry; skipped.

When the queue runs empty and the registry's cursor is behind the last batch received (the
queue dropped batches; a new registration found the registry without the node's index), the
missing range is fetched from the replay endpoint at once rather than at the engine's next batch.

Reports carry up to `max_batches` batches and about `max_request_bytes`; the forwarder waits
`linger` seconds after the first batch to let a report fill. When the registry cannot be
reached it retries the same report with backoff (the queue in front absorbs, then drops); when
the registry answers that the lease is gone it tells the lease, waits for the new registration,
re-synchronises the cursor and sends what is left. Any other failure drops the report, logs
it at error and counts it by reason (`rejection_reason`); it is never retried: a report the
registry refused (INVALID_ARGUMENT: over its limits) or one the agent failed to build (a bug,
logged with its traceback) would fail again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import structlog

from kvshuttle.agent.lease import NodeLease, lease_lost
from kvshuttle.agent.model import Backoff, EventStreamStats, LiveBatch
from kvshuttle.agent.ports import RegistryPort, RegistryRefused, ReplayPort
from kvshuttle.core.errors import Unavailable
from kvshuttle.core.kv_events import BlockRemoved, BlockStored, EventBatch

__all__ = ["EventForwarder", "estimated_bytes", "rejection_reason"]

log = structlog.get_logger("kvshuttle.agent")


def rejection_reason(exc: BaseException) -> str:
    """The label a dropped report is counted under: the registry's reason for a refusal, the
    exception's type for a failure of the agent's own."""
    if isinstance(exc, RegistryRefused):
        return exc.reason
    return type(exc).__name__


def estimated_bytes(batch: EventBatch) -> int:
    """An upper bound of the batch's protobuf size (token ids at 5 bytes, hashes at 9)."""
    size = 16
    for event in batch.events:
        if isinstance(event, BlockStored):
            size += 32 + 9 * len(event.block_hashes) + 5 * len(event.token_ids) + len(event.medium)
            if event.cache_salt_sha256:
                size += 2 + len(event.cache_salt_sha256)
        elif isinstance(event, BlockRemoved):
            size += 16 + 9 * len(event.block_hashes) + len(event.medium)
        else:
            size += 4
    return size


class EventForwarder:
    """Forwards `queue` (fed by an EventReceiver) to the registry for `lease`'s node."""

    def __init__(
        self,
        port: RegistryPort,
        lease: NodeLease,
        queue: asyncio.Queue[LiveBatch | None],
        stats: EventStreamStats,
        *,
        replay: ReplayPort | None,
        max_batches: int,
        linger: float,
        max_request_bytes: int,
        backoff: Backoff,
    ) -> None:
        if max_batches <= 0 or linger < 0 or max_request_bytes <= 0:
            raise ValueError("max_batches and max_request_bytes must be positive, linger not negative")
        self._port = port
        self._lease = lease
        self._queue = queue
        self._stats = stats
        self._replay = replay
        self._max_batches = max_batches
        self._linger = linger
        self._max_bytes = max_request_bytes
        self._backoff = backoff
        self._cursor = 0  # the seq the registry expects next (valid within self._epoch)
        self._epoch = 0  # the lease epoch the cursor was synchronised in; 0: never
        self._seen_live = False
        self._stopping = False
        lease.add_listener(self._registered)

    def stop(self) -> None:
        """Forward what is queued, then end `run()` (the receiver must be stopped first)."""
        self._stopping = True
        # Wakes a run() waiting on an empty queue; with a full queue run() is busy and checks
        # the flag before it waits again.
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)

    def _registered(self, epoch: int) -> None:
        # A new registration may find the registry without this node's index (a registry
        # restart, a lapsed lease): wake run() to catch up even when the engine is quiet.
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)

    async def run(self) -> None:
        """Forward until stopped (and the queue drained) or cancelled."""
        while True:
            items = await self._collect()
            if items is None:
                return
            if items:
                await self._deliver(items)
            await self._catch_up()

    async def _catch_up(self) -> None:
        """Once the queue is empty: forward, from the replay endpoint, what the registry lacks
        up to the last batch received: batches the queue dropped, or the whole index after a
        registration that found the registry without it (a registry restart, a lapsed lease).
        So the index is whole before the engine's next batch; whatever this cannot do, that
        batch's gap handling does."""
        state = self._lease.state
        last = self._stats.last_seq
        if (
            self._replay is None
            or last is None
            or not self._seen_live
            or not state.registered
            or not self._queue.empty()
            or self._stats.restart_pending  # the registry must see the restart first
        ):
            return
        incarnation, epoch = state.incarnation, state.epoch
        if epoch != self._epoch and not await self._sync(incarnation, epoch):
            return
        if self._cursor <= last:
            start = self._cursor
            filled = await self._fill(start, last + 1, restart=False, engine_time=0.0)
            self._cursor = max(start, filled[-1].batch.seq + 1) if filled else start
            await self._send(filled, incarnation, epoch)

    async def _collect(self) -> list[LiveBatch] | None:
        """The next report's batches (at least one); None once stopping and drained."""
        queue = self._queue
        if self._stopping and queue.empty():
            return None
        first = await queue.get()
        if first is None:  # stop() or a new registration
            return None if self._stopping and queue.empty() else []
        items = [first]
        if self._linger > 0 and not self._stopping and queue.qsize() < self._max_batches - 1:
            await asyncio.sleep(self._linger)
        while len(items) < self._max_batches:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            if item is not None:
                items.append(item)
        return items

    async def _deliver(self, items: list[LiveBatch]) -> None:
        pending = items
        live = True
        while pending:
            incarnation, epoch = await self._lease.wait_registered()
            if epoch != self._epoch and not await self._sync(incarnation, epoch):
                continue
            batches = await self._sequence(pending, live=live)
            live = False
            pending = await self._send(batches, incarnation, epoch)

    async def _sync(self, incarnation: int, epoch: int) -> bool:
        """Learn the registry's cursor for a new registration; False to try again."""
        try:
            result = await self._port.report_block_events(self._lease.spec.name, incarnation, [])
        except Exception as exc:
            if lease_lost(exc):
                self._lease.lost(epoch, getattr(exc, "reason", type(exc).__name__))
            else:
                await self._pause("sync", exc)
            return False
        self._backoff.reset()
        log.info("events.synced", node=self._lease.spec.name, epoch=epoch, next_seq=result.next_seq)
        self._cursor, self._epoch = result.next_seq, epoch
        return True

    async def _sequence(self, items: Sequence[LiveBatch], *, live: bool) -> list[LiveBatch]:
        """`items` in the registry's order from the cursor on: gaps filled, restarts made
        visible, what the registry has skipped. Advances the cursor past the result."""
        out: list[LiveBatch] = []
        cursor = self._cursor
        for item in items:
            batch, restart = item.batch, item.restart
            seq = batch.seq
            if live and not self._seen_live:
                self._seen_live = True
                if not restart and seq < cursor:
                    # The registry has seqs past this from an earlier life of the engine.
                    self._stats.engine_restarts += 1
                    restart = True
                    log.warning("events.engine_restarted", seq=seq, registry_next_seq=cursor)
            if not restart and seq < cursor:
                continue
            if restart:
                cursor = 0
            if seq > cursor:
                filled = await self._fill(cursor, seq, restart=restart, engine_time=batch.engine_time)
                restart = restart and not (filled and filled[0].restart)
                out.extend(filled)
            out.append(LiveBatch(batch, restart))
            cursor = seq + 1
        self._cursor = cursor
        return out

    async def _fill(self, start: int, end: int, *, restart: bool, engine_time: float) -> list[LiveBatch]:
        """The batches [start, end) from the replay endpoint (as many as it has)."""
        stats = self._stats
        stats.gaps_detected += 1
        got = await self._replay.fetch(start, end) if self._replay is not None else []
        got = [b for b in got if start <= b.seq < end]
        stats.replayed_batches += len(got)
        complete = len(got) == end - start
        stats.gaps_filled += complete
        log.info("events.gap", start=start, end=end, replayed=len(got), filled=complete)
        out = [LiveBatch(b) for b in got]
        if restart:
            if out and out[0].batch.seq == 0:
                out[0] = LiveBatch(out[0].batch, restart=True)
            else:  # the registry must see seq 0 to know the engine restarted
                out.insert(0, LiveBatch(EventBatch(seq=0, engine_time=engine_time, events=()), restart=True))
        return out

    def _chunk(self, batches: Sequence[LiveBatch], start: int) -> list[LiveBatch]:
        chunk: list[LiveBatch] = []
        size = 0
        for item in batches[start : start + self._max_batches]:
            item_size = estimated_bytes(item.batch)
            if chunk and size + item_size > self._max_bytes:
                break
            chunk.append(item)
            size += item_size
        return chunk

    async def _send(self, batches: list[LiveBatch], incarnation: int, epoch: int) -> list[LiveBatch]:
        """Report `batches`; returns what is left unsent when the registration was lost."""
        node = self._lease.spec.name
        stats = self._stats
        i = 0
        while i < len(batches):
            chunk = self._chunk(batches, i)
            try:
                result = await self._port.report_block_events(node, incarnation, [b.batch for b in chunk])
            except Exception as exc:
                if lease_lost(exc):
                    self._lease.lost(epoch, getattr(exc, "reason", type(exc).__name__))
                    return batches[i:]
                if isinstance(exc, Unavailable):
                    await self._pause("report", exc)
                    if self._lease.epoch != epoch or not self._lease.state.registered:
                        return batches[i:]
                    continue
                # Never retried: the same batches would fail the same way. Counted by reason, and
                # logged at error with the traceback when the fault is the agent's own.
                reason = rejection_reason(exc)
                stats.batches_rejected[reason] += len(chunk)
                log.error(
                    "events.report_rejected",
                    node=node,
                    first_seq=chunk[0].batch.seq,
                    batches=len(chunk),
                    reason=reason,
                    error=str(exc),
                    exc_info=not isinstance(exc, RegistryRefused),
                )
                i += len(chunk)
                continue
            self._backoff.reset()
            stats.batches_forwarded += len(chunk)
            stats.registry_gaps += result.gap_detected
            i += len(chunk)
            expected = chunk[-1].batch.seq + 1
            if result.next_seq != expected:
                log.warning("events.registry_cursor", node=node, expected=expected, next_seq=result.next_seq)
            if i == len(batches):
                self._cursor = result.next_seq
        return []

    async def _pause(self, what: str, exc: BaseException) -> None:
        delay = self._backoff.next()
        log.warning("events.registry_unavailable", call=what, error=str(exc), retry_in=round(delay, 3))
        await asyncio.sleep(delay)
