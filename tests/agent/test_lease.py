"""The node lease against a registry port in memory: no sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvshuttle.agent.lease import NodeLease
from kvshuttle.agent.model import Backoff
from kvshuttle.core.kv_events import ApplyResult, EventBatch
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec

SPEC = NodeSpec(
    name="nodes/p0",
    role=NodeRole.PREFILL,
    engine_id="engine-p0",
    http_endpoint="http://127.0.0.1:8000",
    side_channel_host="127.0.0.1",
    side_channel_port=5600,
    agent_endpoint="",
    model="m",
    block_size=16,
    kv_bytes_per_token=64,
)


class Port:
    """Registers at once and records the heartbeats' loads."""

    def __init__(self) -> None:
        self.loads: list[NodeLoad] = []
        self.beat = asyncio.Event()

    async def register_node(self, spec: NodeSpec, ttl: float) -> int:
        return 1

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float, load: NodeLoad) -> None:
        self.loads.append(load)
        self.beat.set()

    async def deregister_node(self, name: str, incarnation: int, *, deadline_s: float) -> None:
        return None

    async def evict_retention(self, name: str, node: str) -> None:
        raise AssertionError("no eviction here")

    async def report_block_events(
        self, node: str, incarnation: int, batches: Sequence[EventBatch]
    ) -> ApplyResult:
        raise AssertionError("the lease reports no events")


async def test_a_registration_is_followed_at_once_by_a_heartbeat_with_the_engines_load() -> None:
    # A node registers without its load, and the router places nothing on a node whose engine
    # is not reported healthy: after a registry restart, waiting an interval for the first
    # heartbeat would keep the node out of every plan that long.
    port = Port()
    lease = NodeLease(
        port,
        SPEC,
        ttl=30,
        heartbeat_interval=10,
        load=lambda: NodeLoad(engine_healthy=True),
        backoff=Backoff(0.01, 0.02),
    )
    task = asyncio.create_task(lease.run())
    try:
        async with asyncio.timeout(1.0):  # far less than the 10 s interval
            await port.beat.wait()
    finally:
        task.cancel()
    assert lease.state.registered and port.loads[0].engine_healthy


class HeldPort(Port):
    """Holds each heartbeat until `release` is set (then clears it for the next)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float, load: NodeLoad) -> None:
        self.entered.set()
        await self.release.wait()
        self.release.clear()
        await super().heartbeat_node(name, incarnation, ttl, load)


async def test_report_now_sends_a_heartbeat_with_the_new_load_before_the_interval_ends() -> None:
    # The registration's first heartbeat read the load before the engine's first poll (not
    # healthy yet); the poll then finds it healthy while that heartbeat is in flight. The next
    # heartbeat must follow at once, not an interval later: until then no plan places on it.
    port = HeldPort()
    load = NodeLoad(engine_healthy=False)
    lease = NodeLease(
        port, SPEC, ttl=7200, heartbeat_interval=3600, load=lambda: load, backoff=Backoff(0.01, 0.02)
    )
    task = asyncio.create_task(lease.run())
    try:
        await port.entered.wait()
        load = NodeLoad(engine_healthy=True)
        lease.report_now()
        port.release.set()
        await port.beat.wait()
        port.beat.clear()
        port.release.set()
        async with asyncio.timeout(60):  # the interval is an hour
            await port.beat.wait()
    finally:
        task.cancel()
    assert [x.engine_healthy for x in port.loads] == [False, True]


async def test_a_cancel_in_the_step_a_report_now_wakes_the_lease_stops_it() -> None:
    # The agent's shutdown cancels the lease; the engine poller's report_now() may wake its sleep
    # in the same step (under load). On Python 3.11 asyncio.wait_for would return the wake-up and
    # swallow the cancel (CPython gh-86296): the lease then heartbeats on and shutdown waits forever.
    port = Port()
    lease = NodeLease(
        port, SPEC, ttl=7200, heartbeat_interval=3600, load=NodeLoad, backoff=Backoff(0.01, 0.02)
    )
    task = asyncio.create_task(lease.run())
    await port.beat.wait()  # registered and heartbeated: now asleep for the interval
    await asyncio.sleep(0)
    lease.report_now()
    await asyncio.sleep(0)  # the wake-up's waiter finishes in this step
    task.cancel()
    async with asyncio.timeout(5):
        await asyncio.wait([task])
    assert task.cancelled()
