"""NodeDirectory: the node list in hand, refreshed in the background, on a hand-moved clock."""

from __future__ import annotations

import asyncio

import pytest

from kvshuttle.core.errors import Unavailable
from kvshuttle.core.nodes import NodeRole
from kvshuttle.router.model import NodeInfo
from kvshuttle.router.node_directory import NodeDirectory


def node(name: str) -> NodeInfo:
    return NodeInfo(
        name=name,
        role=NodeRole.DECODE,
        engine_id=f"engine-{name}",
        http_endpoint="",
        model="m",
        block_size=16,
        kv_bytes_per_token=1,
        healthy=True,
    )


class Lister:
    """A registry port that only lists: each read answers the next of `answers`."""

    def __init__(self, *answers: list[NodeInfo] | Exception) -> None:
        self.answers = list(answers)
        self.reads = 0
        self.gate: asyncio.Event | None = None

    async def list_nodes(self, model: str) -> list[NodeInfo]:
        self.reads += 1
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


class Monotonic:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def directory(port: Lister, clock: Monotonic) -> NodeDirectory:
    return NodeDirectory(port, refresh_s=1.0, max_age_s=10.0, monotonic=clock)  # type: ignore[arg-type]


async def test_the_list_in_hand_serves_until_it_is_refreshed_behind_the_plans_back() -> None:
    clock = Monotonic()
    port = Lister([node("a")], [node("b")])
    nodes = directory(port, clock)

    assert [n.name for n in await nodes.nodes("m")] == ["a"]  # nothing in hand: read
    clock.now += 0.5
    assert [n.name for n in await nodes.nodes("m")] == ["a"] and port.reads == 1  # fresh: no read
    clock.now += 0.5
    assert [n.name for n in await nodes.nodes("m")] == ["a"]  # old enough: refreshed, not awaited
    await settle()
    assert port.reads == 2
    assert [n.name for n in await nodes.nodes("m")] == ["b"]


async def test_one_background_refresh_at_a_time() -> None:
    clock = Monotonic()
    port = Lister([node("a")], [node("b")])
    nodes = directory(port, clock)
    await nodes.nodes("m")
    port.gate = asyncio.Event()
    clock.now += 2
    for _ in range(3):
        await nodes.nodes("m")
    await settle()
    assert port.reads == 2
    port.gate.set()
    await settle()
    assert [n.name for n in await nodes.nodes("m")] == ["b"]


async def test_a_failed_refresh_keeps_the_list_and_a_list_too_old_is_read_in_the_plan() -> None:
    clock = Monotonic()
    failure = Unavailable("down", reason="REGISTRY_UNAVAILABLE")
    port = Lister([node("a")], failure, failure, failure)
    nodes = directory(port, clock)
    await nodes.nodes("m")
    clock.now += 2
    assert [n.name for n in await nodes.nodes("m")] == ["a"]
    await settle()  # that refresh failed (and was logged)
    assert port.reads == 2
    # The list in hand still serves, and the next plan tries the refresh again.
    assert [n.name for n in await nodes.nodes("m")] == ["a"]
    await settle()
    assert port.reads == 3
    clock.now += 10  # past max_age_s: the plan waits for the registry, and sees its error
    with pytest.raises(Unavailable):
        await nodes.nodes("m")
    assert port.reads == 4


def rereading(port: Lister, clock: Monotonic) -> NodeDirectory:
    """Refreshed in the background only after a minute: what a plan sees sooner is reread()."""
    return NodeDirectory(port, refresh_s=60.0, max_age_s=600.0, miss_refresh_s=0.5, monotonic=clock)  # type: ignore[arg-type]


async def test_a_reread_reads_the_registry_at_once_unless_the_list_in_hand_is_that_young() -> None:
    clock = Monotonic()
    port = Lister([], [node("a")], [node("a"), node("b")])
    nodes = rereading(port, clock)
    assert await nodes.nodes("m") == []
    clock.now += 0.25  # younger than miss_refresh_s: the list in hand, no read
    assert await nodes.reread("m") == [] and port.reads == 1
    clock.now += 0.25
    assert [n.name for n in await nodes.reread("m")] == ["a"] and port.reads == 2
    # The list it read is in hand for the plans after it, and starts the interval again.
    assert [n.name for n in await nodes.nodes("m")] == ["a"]
    clock.now += 0.25
    assert [n.name for n in await nodes.reread("m")] == ["a"] and port.reads == 2
    clock.now += 0.25
    assert [n.name for n in await nodes.reread("m")] == ["a", "b"] and port.reads == 3


async def test_plans_that_reread_together_share_one_read_and_join_the_background_refresh() -> None:
    clock = Monotonic()
    port = Lister([], [node("a")], [node("b")])
    nodes = NodeDirectory(port, refresh_s=1.0, max_age_s=600.0, miss_refresh_s=0.5, monotonic=clock)  # type: ignore[arg-type]
    await nodes.nodes("m")
    port.gate = asyncio.Event()
    clock.now += 2
    await nodes.nodes("m")  # starts the background refresh, held at the gate
    plans = [asyncio.create_task(nodes.reread("m")) for _ in range(5)]
    await settle()
    assert port.reads == 2
    port.gate.set()
    assert [[n.name for n in got] for got in await asyncio.gather(*plans)] == [["a"]] * 5
    assert port.reads == 2


async def test_a_plan_cancelled_while_it_rereads_leaves_the_read_to_the_others() -> None:
    clock = Monotonic()
    port = Lister([], [node("a")])
    nodes = rereading(port, clock)
    await nodes.nodes("m")
    port.gate = asyncio.Event()
    clock.now += 1
    gone, waiting = asyncio.create_task(nodes.reread("m")), asyncio.create_task(nodes.reread("m"))
    await settle()
    gone.cancel()
    await settle()
    port.gate.set()
    assert [n.name for n in await waiting] == ["a"]
    assert gone.cancelled() and port.reads == 2


async def test_a_failed_reread_answers_the_list_in_hand_and_counts_toward_the_interval() -> None:
    clock = Monotonic()
    failure = Unavailable("down", reason="REGISTRY_UNAVAILABLE")
    port = Lister([node("a")], failure, [node("a"), node("b")])
    nodes = rereading(port, clock)
    await nodes.nodes("m")
    clock.now += 1
    assert [n.name for n in await nodes.reread("m")] == ["a"] and port.reads == 2
    # The registry is not asked again until the list in hand is miss_refresh_s older.
    clock.now += 0.25
    assert [n.name for n in await nodes.reread("m")] == ["a"] and port.reads == 2
    clock.now += 0.25
    assert [n.name for n in await nodes.reread("m")] == ["a", "b"] and port.reads == 3
