"""The node's liveness lease with the registry: register, heartbeat with the engine's load,
register again when the lease was lost, deregister on shutdown.

One task runs `NodeLease.run()`. It never ends on an error: while the registry cannot be
reached it retries with backoff (a heartbeat sooner than its interval, so a short outage does
not cost the lease), and when the registry answers that the lease is gone (NOT_FOUND: it
lapsed, or the registry restarted) or was replaced (NODE_INCARNATION_MISMATCH) it registers
again at once. Each successful registration starts a new `epoch`: the event forwarder
re-synchronises its sequence with the registry whenever the epoch changes (incarnation numbers
alone may repeat across registry restarts).

Other tasks that learn the lease is gone (a ReportBlockEvents refused) call `lost(epoch)`. The
engine poller calls `report_now()` when the engine's health changes: the router places turns
only on nodes whose last heartbeat said healthy, so a node back (or an engine gone) must not
wait out the interval (a registration's first heartbeat may carry the load read before the
engine's first poll). The agent calls `register_again()` after changing the spec (the engine
restarted with a new id).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from kvshuttle.agent.model import Backoff, LeaseState
from kvshuttle.agent.ports import RegistryPort
from kvshuttle.core.errors import FailedPrecondition, NotFound
from kvshuttle.core.nodes import NodeLoad, NodeSpec
from kvshuttle.core.reasons import ErrorReason

__all__ = ["NodeLease", "lease_lost"]

log = structlog.get_logger("kvshuttle.agent")


def lease_lost(exc: BaseException) -> bool:
    """Whether a registry error means this agent's registration is gone: register again."""
    if isinstance(exc, NotFound):
        return exc.reason in (ErrorReason.NODE_NOT_FOUND, ErrorReason.NOT_FOUND)
    if isinstance(exc, FailedPrecondition):
        return exc.reason == ErrorReason.NODE_INCARNATION_MISMATCH
    return False


class NodeLease:
    """Keeps `spec` registered. `load()` is read at every heartbeat."""

    def __init__(
        self,
        port: RegistryPort,
        spec: NodeSpec,
        *,
        ttl: float,
        heartbeat_interval: float,
        load: Callable[[], NodeLoad],
        backoff: Backoff,
    ) -> None:
        if not 0 < heartbeat_interval < ttl:
            raise ValueError("heartbeat_interval must be positive and below ttl")
        self._port = port
        self._spec = spec
        self._ttl = ttl
        self._interval = heartbeat_interval
        self._load = load
        self._backoff = backoff
        self.state = LeaseState(name=spec.name)
        self._registered = asyncio.Event()
        self._wake = asyncio.Event()
        self._closed = False
        # Bumped by register_again(): a registration begun before it registered the old spec.
        self._spec_version = 0
        self._listeners: list[Callable[[int], None]] = []

    @property
    def spec(self) -> NodeSpec:
        return self._spec

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def add_listener(self, on_registered: Callable[[int], None]) -> None:
        """Call `on_registered(epoch)` after every successful registration (it must not block)."""
        self._listeners.append(on_registered)

    async def wait_registered(self) -> tuple[int, int]:
        """(incarnation, epoch) of the current registration, once there is one."""
        while not self.state.registered:
            await self._registered.wait()
        return self.state.incarnation, self.state.epoch

    def lost(self, epoch: int, reason: str) -> None:
        """The registration of `epoch` is gone (another task learned it): register again.
        A stale epoch is ignored, so several reports of one loss register once."""
        if epoch != self.state.epoch or not self.state.registered:
            return
        log.warning("lease.lost", node=self._spec.name, incarnation=self.state.incarnation, reason=reason)
        self.state.registered = False
        self._registered.clear()
        self._wake.set()

    def report_now(self) -> None:
        """Heartbeat now, not at the end of the interval: the load changed in a way the registry
        must know (the engine's health). A lease not registered heartbeats as soon as it is."""
        self._wake.set()

    def register_again(self, reason: str) -> None:
        """The spec changed: register it anew (a new incarnation), whatever the lease's state."""
        log.info("lease.register_again", node=self._spec.name, engine_id=self._spec.engine_id, reason=reason)
        self._spec_version += 1
        self.state.registered = False
        self._registered.clear()
        self._wake.set()

    async def run(self) -> None:
        """Register, then heartbeat every interval, until cancelled."""
        delay = 0.0
        while not self._closed:
            if delay > 0:
                await self._sleep(delay)
                if self._closed:
                    return
            # Cleared before the step: a `lost()` or `report_now()` during it cuts the following
            # sleep short.
            self._wake.clear()
            delay = await (self._heartbeat() if self.state.registered else self._register())

    async def _sleep(self, seconds: float) -> None:
        """Sleep, woken early by `lost()` or `report_now()`."""
        # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that lands in the step the
        # wake-up finishes (CPython gh-86296), and the agent's shutdown then waits forever.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    async def _register(self) -> float:
        """One registration attempt; returns the delay before the next step."""
        state = self.state
        version = self._spec_version
        try:
            incarnation = await self._port.register_node(self._spec, self._ttl)
        except Exception as exc:
            state.failed_registrations += 1
            state.last_error = f"register: {exc}"
            delay = self._backoff.next()
            log.warning(
                "lease.register_failed", node=self._spec.name, error=str(exc), retry_in=round(delay, 3)
            )
            return delay
        self._backoff.reset()
        if version != self._spec_version:  # registered what the spec was: again, as it is now
            return 0.0
        state.incarnation = incarnation
        state.epoch += 1
        state.registered = True
        state.last_error = ""
        self._registered.set()
        log.info("lease.registered", node=self._spec.name, incarnation=incarnation, epoch=state.epoch)
        for listener in self._listeners:
            listener(state.epoch)
        # Heartbeat at once: a node registered without its load counts as unhealthy (no plan
        # places a turn on it) until its first heartbeat reports the engine healthy.
        return 0.0

    async def _heartbeat(self) -> float:
        state = self.state
        epoch = state.epoch
        try:
            await self._port.heartbeat_node(self._spec.name, state.incarnation, self._ttl, self._load())
        except Exception as exc:
            state.failed_heartbeats += 1
            state.last_error = f"heartbeat: {exc}"
            if lease_lost(exc):
                self.lost(epoch, getattr(exc, "reason", type(exc).__name__))
                return 0.0
            # Retry sooner than the interval (never later): the lease must not lapse over a blip.
            delay = min(self._backoff.next(), self._interval)
            log.warning(
                "lease.heartbeat_failed", node=self._spec.name, error=str(exc), retry_in=round(delay, 3)
            )
            return delay
        self._backoff.reset()
        state.heartbeats += 1
        return self._interval

    async def deregister(self, *, deadline_s: float) -> bool:
        """End the lease now (the run task must be stopped first); True when the registry
        confirmed. Failures are logged, never raised: the lease lapses on its own anyway."""
        self._closed = True
        state = self.state
        if not state.registered:
            return False
        state.registered = False
        self._registered.clear()
        try:
            await self._port.deregister_node(self._spec.name, state.incarnation, deadline_s=deadline_s)
        except Exception as exc:
            log.warning("lease.deregister_failed", node=self._spec.name, error=str(exc))
            return False
        log.info("lease.deregistered", node=self._spec.name, incarnation=state.incarnation)
        return True
