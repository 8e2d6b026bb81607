"""The Registry's expiry timer (kvshuttle.registry.service.registry): sweeps the store at each deadline
(woken early when an operation may have set an earlier one), drops expired nodes' blocks through
the index feed, publishes what lapsed, and outlives a store outage."""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from kvshuttle.core.errors import Unavailable
from kvshuttle.registry.model import ExpiryResult
from kvshuttle.registry.service.shared import RegistryShared

log = structlog.get_logger("kvshuttle.registry")


class RegistryExpiry:
    """Expiry: one sweep (expire_due) and the timer that runs it (run_expiry) until close."""

    def __init__(self, shared: RegistryShared) -> None:
        self._shared = shared
        self._store = shared.store
        self._clock = shared.clock
        self._index_feed = shared.index_feed
        self._stats = shared.stats
        self._wake = shared.wake
        self._closed = False

    async def expire_due(self) -> ExpiryResult:
        """Apply every lapse up to now. The timer calls this; tests call it after a FakeClock step."""
        result = await self._store.expire_due(self._clock.now())
        for expired in result.nodes:
            try:
                await self._index_feed.drop(
                    expired.node.name, expired.node.incarnation + 1, self._clock.now()
                )
            except Unavailable as err:  # the expiry committed: its changes are published still
                self._stats.feed_errors += 1
                log.warning("index_feed.drop_failed", node=expired.node.name, error=err.message[:300])
            self._stats.expirations["node"] += 1
            log.info("node.expired", node=expired.node.name, retentions=len(expired.changes))
        for change in result.retentions:
            kind = "claim" if change.retention.claim is not None else "retention"
            self._stats.expirations[kind] += 1
        await self._shared.publish(result.changes())
        return result

    def close(self) -> None:
        """End the timer (at its next wake-up, which this sets)."""
        self._closed = True
        self._wake.set()

    async def run_expiry(self, *, max_sleep: float = 1.0) -> None:
        """The expiry timer: sleeps until the next deadline (or a new, possibly earlier one).
        A store that does not answer (Redis down) is swept again after `max_sleep`: the timer
        outlives an outage, and what fell due meanwhile expires at the first sweep after it."""
        failing = False
        while not self._closed:
            deadline = self._store.next_deadline()
            delay = max_sleep if deadline is None else min(max(deadline - self._clock.now(), 0.0), max_sleep)
            if failing:
                delay = max_sleep
            self._wake.clear()
            if delay > 0:
                # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that lands in the
                # step the wake-up finishes (CPython gh-86296).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
            try:
                await self.expire_due()
            except Unavailable as err:
                if not failing:
                    log.warning("expiry.store_unavailable", error=err.message[:300], retry_s=max_sleep)
                failing = True
                continue
            if failing:
                log.info("expiry.store_back")
            failing = False
