"""The engine id file (node.engine_id_file) and the lease following it, without sockets: the file
read, waited for and watched; the lease registering again with the new id, also when the change
lands while a registration of the old one is in flight."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from pathlib import Path

import pytest
from pydantic import ValidationError
from tests.agent.engine_fakes import write_id
from tests.agent.helpers import eventually

from kvshuttle.agent.config import NodeSettings
from kvshuttle.agent.engine_id import BadEngineId, EngineIdWatcher, read_engine_id, wait_for_engine_id
from kvshuttle.agent.lease import NodeLease
from kvshuttle.agent.model import Backoff
from kvshuttle.core.errors import FailedPrecondition
from kvshuttle.core.kv_events import ApplyResult, EventBatch
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec

SPEC = NodeSpec(
    name="nodes/d0",
    role=NodeRole.DECODE,
    engine_id="engine-1",
    http_endpoint="http://127.0.0.1:8000",
    side_channel_host="127.0.0.1",
    side_channel_port=5600,
    agent_endpoint="",
    model="m",
    block_size=16,
    kv_bytes_per_token=64,
)


def test_node_settings_take_exactly_one_engine_id_source(tmp_path: Path) -> None:
    base = {
        "name": "d0",
        "role": "decode",
        "http_endpoint": "http://127.0.0.1:8000",
        "model": "m",
        "block_size": 16,
        "kv_bytes_per_token": 64,
    }
    assert NodeSettings(**base, engine_id="e").engine_id == "e"  # type: ignore[arg-type]
    assert NodeSettings(**base, engine_id_file=tmp_path / "id").engine_id is None  # type: ignore[arg-type]
    for extra in ({}, {"engine_id": "e", "engine_id_file": tmp_path / "id"}):
        with pytest.raises(ValidationError, match="exactly one of engine_id and engine_id_file"):
            NodeSettings(**base, **extra)  # type: ignore[arg-type]


def test_reading_the_id_file(tmp_path: Path) -> None:
    path = tmp_path / "engine-id"
    assert read_engine_id(path) is None  # not written yet
    path.write_text("")
    assert read_engine_id(path) is None
    write_id(path, "decode-0-1a2b3c4d")
    assert read_engine_id(path) == "decode-0-1a2b3c4d"
    path.write_text("two words\n")
    with pytest.raises(BadEngineId, match="engine_id_file"):
        read_engine_id(path)
    path.write_text("x" * 5000)
    with pytest.raises(BadEngineId, match="over 4096 bytes"):
        read_engine_id(path)


async def test_start_waits_for_the_file_and_gives_up_when_bounded(tmp_path: Path) -> None:
    path = tmp_path / "engine-id"
    waiting = asyncio.create_task(wait_for_engine_id(path, wait_s=60, interval=0.01))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    write_id(path, "engine-7")
    assert await waiting == "engine-7"

    with pytest.raises(FailedPrecondition, match=r"no engine id in .* after 0\.05 s"):
        await wait_for_engine_id(tmp_path / "never", wait_s=0.05, interval=0.01)


async def test_the_watcher_follows_changes_and_ignores_what_is_no_id(tmp_path: Path) -> None:
    path = tmp_path / "engine-id"
    write_id(path, "engine-1")
    followed: list[str] = []

    async def follow(engine_id: str) -> None:
        followed.append(engine_id)

    watcher = EngineIdWatcher(path, "engine-1", follow, interval=1)
    assert not await watcher.check()  # unchanged
    path.unlink()  # between the engine's start and its write: kept
    assert not await watcher.check()
    path.write_text("not an id!")
    assert not await watcher.check()
    write_id(path, "engine-2")
    assert await watcher.check()
    assert not await watcher.check()
    assert (followed, watcher.current, watcher.changes) == (["engine-2"], "engine-2", 1)


async def test_a_failed_follow_is_tried_again(tmp_path: Path) -> None:
    path = tmp_path / "engine-id"
    write_id(path, "engine-2")
    attempts: list[str] = []

    async def follow(engine_id: str) -> None:
        attempts.append(engine_id)
        if len(attempts) == 1:
            raise RuntimeError("the pool's engine check failed")

    watcher = EngineIdWatcher(path, "engine-1", follow, interval=1)
    with pytest.raises(RuntimeError):
        await watcher.check()
    assert watcher.current == "engine-1"
    assert await watcher.check()
    assert (attempts, watcher.current) == (["engine-2", "engine-2"], "engine-2")


class Port:
    """Records what is registered; a registration may be held until the test releases it."""

    def __init__(self) -> None:
        self.registered: list[str] = []
        self.hold: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def register_node(self, spec: NodeSpec, ttl: float) -> int:
        sent = copy.deepcopy(spec)  # what went on the wire when the call began
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        self.registered.append(sent.engine_id)
        return len(self.registered)

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float, load: NodeLoad) -> None:
        return None

    async def deregister_node(self, name: str, incarnation: int, *, deadline_s: float) -> None:
        return None

    async def evict_retention(self, name: str, node: str) -> None:
        raise AssertionError("no eviction here")

    async def report_block_events(
        self, node: str, incarnation: int, batches: Sequence[EventBatch]
    ) -> ApplyResult:
        raise AssertionError("the lease reports no events")


def lease_of(port: Port) -> NodeLease:
    return NodeLease(
        port,
        copy.deepcopy(SPEC),
        ttl=10,
        heartbeat_interval=0.01,
        load=NodeLoad,
        backoff=Backoff(0.01, 0.05),
    )


async def test_register_again_registers_the_new_engine_id_in_a_new_epoch() -> None:
    port = Port()
    lease = lease_of(port)
    epochs: list[int] = []
    lease.add_listener(epochs.append)
    task = asyncio.create_task(lease.run())
    try:
        await lease.wait_registered()
        lease.spec.engine_id = "engine-2"
        lease.register_again("engine_id_changed")
        await eventually(lambda: lease.state.registered and lease.epoch == 2, what="the new registration")
        assert port.registered == ["engine-1", "engine-2"]
        assert (epochs, lease.state.incarnation) == ([1, 2], 2)
    finally:
        task.cancel()


async def test_a_change_during_a_registration_in_flight_registers_again() -> None:
    # The registration that began with engine-1 must not leave the lease registered as that.
    port = Port()
    port.hold = asyncio.Event()
    lease = lease_of(port)
    task = asyncio.create_task(lease.run())
    try:
        await port.entered.wait()
        lease.spec.engine_id = "engine-2"
        lease.register_again("engine_id_changed")
        port.hold.set()
        await lease.wait_registered()
        assert port.registered == ["engine-1", "engine-2"]
        assert (lease.epoch, lease.state.incarnation) == (1, 2)
    finally:
        task.cancel()
