"""The forwarder against a registry port that refuses or breaks: no sockets. A report that can
never succeed is dropped once, counted by its reason and logged at error; the batches after it
still reach the registry."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from structlog.testing import capture_logs

from kvshuttle.agent.forwarder import EventForwarder
from kvshuttle.agent.lease import NodeLease
from kvshuttle.agent.model import Backoff, EventStreamStats, LiveBatch
from kvshuttle.agent.ports import RegistryRefused
from kvshuttle.core.kv_events import ApplyResult, EventBatch
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec

SPEC = NodeSpec(
    name="nodes/d0",
    role=NodeRole.DECODE,
    engine_id="engine-d0",
    http_endpoint="http://127.0.0.1:8000",
    side_channel_host="127.0.0.1",
    side_channel_port=5600,
    agent_endpoint="",
    model="m",
    block_size=16,
    kv_bytes_per_token=64,
)


class FailingPort:
    """Registers at once; refuses (or breaks on) reports holding a poisoned seq."""

    def __init__(self, poisoned: dict[int, BaseException]) -> None:
        self.poisoned = poisoned
        self.accepted: list[int] = []

    async def register_node(self, spec: NodeSpec, ttl: float) -> int:
        return 1

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float, load: NodeLoad) -> None:
        return None

    async def deregister_node(self, name: str, incarnation: int, *, deadline_s: float) -> None:
        return None

    async def evict_retention(self, name: str, node: str) -> None:
        raise AssertionError("no eviction here")

    async def report_block_events(
        self, node: str, incarnation: int, batches: Sequence[EventBatch]
    ) -> ApplyResult:
        for b in batches:
            if b.seq in self.poisoned:
                raise self.poisoned[b.seq]
        self.accepted.extend(b.seq for b in batches)
        next_seq = batches[-1].seq + 1 if batches else (self.accepted[-1] + 1 if self.accepted else 0)
        return ApplyResult(len(batches), next_seq, gap_detected=False, engine_restarted=False)


@pytest.mark.parametrize(
    ("error", "reason", "traceback"),
    [
        (
            RegistryRefused("batches[0]: too many events", reason="INVALID_ARGUMENT"),
            "INVALID_ARGUMENT",
            False,
        ),
        (TypeError("a bug of the agent's own"), "TypeError", True),
    ],
)
async def test_undeliverable_report_is_counted_by_reason_and_logged(
    error: BaseException, reason: str, traceback: bool
) -> None:
    port = FailingPort({1: error})
    lease = NodeLease(port, SPEC, ttl=10, heartbeat_interval=1, load=NodeLoad, backoff=Backoff(0.01, 0.02))
    queue: asyncio.Queue[LiveBatch | None] = asyncio.Queue()
    stats = EventStreamStats()
    forwarder = EventForwarder(
        port,
        lease,
        queue,
        stats,
        replay=None,
        max_batches=1,  # one batch a report: only the poisoned one is lost
        linger=0,
        max_request_bytes=1 << 20,
        backoff=Backoff(0.01, 0.02),
    )
    for seq in range(3):
        queue.put_nowait(LiveBatch(EventBatch(seq=seq, engine_time=0.0, events=())))
    lease_task = asyncio.create_task(lease.run())
    with capture_logs() as logs:
        run = asyncio.create_task(forwarder.run())
        await lease.wait_registered()
        for _ in range(200):
            if port.accepted == [0, 2]:
                break
            await asyncio.sleep(0.01)
        forwarder.stop()
        await asyncio.wait_for(run, 5)
    lease_task.cancel()
    assert port.accepted == [0, 2]
    assert dict(stats.batches_rejected) == {reason: 1}
    assert stats.batches_forwarded == 2
    [line] = [x for x in logs if x["event"] == "events.report_rejected"]
    assert (line["log_level"], line["reason"], line["first_seq"]) == ("error", reason, 1)
    assert line["exc_info"] is traceback
