"""The block index across registry replicas (kvshuttle.registry.feeds.redis_index): two Registry
domain objects over one real redis-server, each with its own index fed from the shared stream,
an agent's reports landing on either. The sequence rules run against both index feeds. A
cancelled reader ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from tests.support.block_events import batch, removed, stored, toks
from tests.support.clock import FakeClock
from tests.support.registry_model import spec

from kvshuttle.core.errors import FailedPrecondition
from kvshuttle.core.hashing import ROOT_HASH, chain_hashes
from kvshuttle.core.kv_events import EventBatch
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RedisSettings
from kvshuttle.registry.feeds.index import IndexFeed, LocalIndexFeed
from kvshuttle.registry.feeds.redis_index import RedisIndexFeed
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.main import redis_client as registry_client
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.redis.store import RedisStore

BS = 4
NODE = "nodes/d0"


def chain(n_blocks: int, start: int = 0) -> list[int]:
    return chain_hashes(toks(n_blocks, start), BS, ROOT_HASH)


async def settle(check: Callable[[], bool]) -> None:
    """Wait (bounded) for the replicas' readers to get there."""
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    assert check()


@dataclass
class Replica:
    registry: Registry
    index: BlockIndex
    feed: RedisIndexFeed


@pytest.fixture
async def replicas(redis_client: aioredis.Redis) -> AsyncIterator[Callable[[], Replica]]:
    """Makes registry replicas over the test's Redis, their readers running; one clock."""
    clock = FakeClock()
    tasks: list[asyncio.Task[None]] = []

    def make() -> Replica:
        index = BlockIndex(1000)
        feed = RedisIndexFeed(redis_client, index, block_ms=50)
        registry = Registry(
            RedisStore(redis_client, StoreLimits()), clock, index, RegistryLimits(), index_feed=feed
        )
        tasks.append(asyncio.create_task(registry.run_feed()))
        return Replica(registry, index, feed)

    make.clock = clock  # type: ignore[attr-defined]
    yield make
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_reports_round_robin_on_two_replicas_each_answers_the_full_index(
    replicas: Callable[[], Replica],
) -> None:
    a, b = replicas(), replicas()
    node = await a.registry.register_node(spec(NODE), ttl=60)
    await b.registry.register_node(spec("nodes/d1", "engine-d1"), ttl=60)
    on = [a, b]
    for seq in range(6):  # one conversation's turns, chained, to alternating replicas
        parent = None if seq == 0 else 100 + seq - 1
        event = stored((100 + seq,), toks(1, seq * BS), parent)
        result = await on[seq % 2].registry.report_block_events(NODE, node.incarnation, [batch(seq, event)])
        assert (result.applied_batches, result.next_seq, result.gap_detected) == (1, seq + 1, False)
    await settle(lambda: a.index.node_block_count(NODE) == b.index.node_block_count(NODE) == 6)
    for replica in (a, b):
        assert await replica.registry.lookup_blocks(chain(6), model="m", role=None) == [(NODE, 6)]
        assert replica.index.next_seq(NODE) == 6


async def test_the_reporting_replica_reads_its_own_report(replicas: Callable[[], Replica]) -> None:
    a = replicas()
    node = await a.registry.register_node(spec(NODE), ttl=60)
    await a.registry.report_block_events(NODE, node.incarnation, [batch(0, stored((1, 2), toks(2)))])
    assert a.index.node_block_count(NODE) == 2  # no waiting: the report waited for its entry


async def test_duplicates_gaps_and_restarts_are_decided_once_across_replicas(
    replicas: Callable[[], Replica],
) -> None:
    a, b = replicas(), replicas()
    node = await a.registry.register_node(spec(NODE), ttl=60)
    inc = node.incarnation
    await a.registry.report_block_events(NODE, inc, [batch(0, stored((1,), toks(1)))])
    await a.registry.report_block_events(NODE, inc, [batch(1, stored((2,), toks(1, BS), 1))])
    # B has not necessarily applied seq 1 yet: the shared state decides, not B's own index.
    again = await b.registry.report_block_events(NODE, inc, [batch(1, stored((2,), toks(1, BS), 1))])
    assert (again.applied_batches, again.next_seq) == (0, 2)
    gap = await b.registry.report_block_events(NODE, inc, [batch(4, stored((5,), toks(1, 4 * BS), 2))])
    assert (gap.applied_batches, gap.next_seq, gap.gap_detected) == (1, 5, True)
    # The agent's replay of the missing seqs comes too late for the rule: duplicates now.
    late = await a.registry.report_block_events(NODE, inc, [batch(2, removed(1)), batch(3)])
    assert (late.applied_batches, late.next_seq) == (0, 5)
    await settle(lambda: b.index.node_block_count(NODE) == 3)
    restart = await a.registry.report_block_events(NODE, inc, [batch(0, stored((9,), toks(1, 50)))])
    assert (restart.applied_batches, restart.next_seq, restart.engine_restarted) == (1, 1, True)
    await settle(lambda: b.index.next_seq(NODE) == 1)
    for replica in (a, b):
        assert replica.index.node_block_count(NODE) == 1
        assert replica.index.lookup(chain_hashes(toks(1, 50), BS, ROOT_HASH)) == [(NODE, 1)]
        assert replica.index.lookup(chain(1)) == []
    # An empty report (the agent's sync after a registration) answers the shared cursor.
    sync = await b.registry.report_block_events(NODE, inc, [])
    assert (sync.applied_batches, sync.next_seq) == (0, 1)


async def test_node_expiry_on_one_replica_clears_the_other_replicas_index(
    replicas: Callable[[], Replica],
) -> None:
    a, b = replicas(), replicas()
    clock: FakeClock = replicas.clock  # type: ignore[attr-defined]
    node = await a.registry.register_node(spec(NODE), ttl=5)
    await a.registry.report_block_events(NODE, node.incarnation, [batch(0, stored((1, 2), toks(2)))])
    await settle(lambda: b.index.node_block_count(NODE) == 2)
    clock.advance(5)
    assert [n.node.name for n in (await a.registry.expire_due()).nodes] == [NODE]
    await settle(lambda: b.index.node_block_count(NODE) == 0)
    assert b.index.next_seq(NODE) is None
    # Back with a new incarnation: its cursor starts over (the agent replays what it can).
    again = await b.registry.register_node(spec(NODE), ttl=5)
    sync = await a.registry.report_block_events(NODE, again.incarnation, [])
    assert sync.next_seq == 0


async def test_a_report_checked_before_a_removal_is_refused_after_it(replicas: Callable[[], Replica]) -> None:
    a, b = replicas(), replicas()
    node = await a.registry.register_node(spec(NODE), ttl=60)
    await b.registry.deregister_node(NODE, node.incarnation)
    # What a replica's report does after its incarnation check passed, the removal meanwhile:
    with pytest.raises(FailedPrecondition) as err:
        await a.feed.report(NODE, node.incarnation, [batch(0, stored((1,), toks(1)))])
    assert err.value.reason == "NODE_INCARNATION_MISMATCH"
    assert a.index.node_block_count(NODE) == 0


async def test_an_engine_change_clears_the_node_on_every_replica(replicas: Callable[[], Replica]) -> None:
    a, b = replicas(), replicas()
    node = await a.registry.register_node(spec(NODE), ttl=60)
    await a.registry.report_block_events(NODE, node.incarnation, [batch(0, stored((1,), toks(1)))])
    await settle(lambda: b.index.node_block_count(NODE) == 1)
    await a.registry.register_node(spec(NODE, "engine-new"), ttl=60)
    await settle(lambda: b.index.node_block_count(NODE) == 0)
    with pytest.raises(FailedPrecondition):  # the old engine's report, after its check passed
        await b.feed.report(NODE, node.incarnation, [batch(1, stored((2,), toks(1, BS), 1))])


async def test_a_replica_started_later_rebuilds_from_the_stream(
    replicas: Callable[[], Replica], redis_client: aioredis.Redis
) -> None:
    a = replicas()
    node = await a.registry.register_node(spec(NODE), ttl=60)
    for seq in range(4):
        parent = None if seq == 0 else seq
        await a.registry.report_block_events(
            NODE, node.incarnation, [batch(seq, stored((seq + 1,), toks(1, seq * BS), parent))]
        )
    late = replicas()
    await settle(lambda: late.index.node_block_count(NODE) == 4)
    assert late.index.lookup(chain(4)) == [(NODE, 4)]
    # A replica that missed an entry (trimmed before it read it) cannot know what it missed, a
    # removal perhaps: it starts over from the entries after the gap.
    entries = await redis_client.xrange(a.feed.key)
    await redis_client.xdel(a.feed.key, entries[1][0])
    behind = replicas()
    await settle(lambda: behind.feed.gaps == 1)
    assert behind.index.node_block_count(NODE) == 0  # seq 2 and 3 chain from the missed seq 1
    assert behind.index.next_seq(NODE) == 4


async def _report(feed: IndexFeed, batches: list[EventBatch]) -> tuple[int, int, bool, bool]:
    result = await feed.report(NODE, 1, batches)
    return result.applied_batches, result.next_seq, result.gap_detected, result.engine_restarted


@pytest.fixture(params=["local", "redis"])
def index_feed(request: pytest.FixtureRequest) -> Callable[[BlockIndex], IndexFeed]:
    if request.param == "local":
        return LocalIndexFeed
    client: aioredis.Redis = request.getfixturevalue("redis_client")
    return lambda index: RedisIndexFeed(client, index, block_ms=50)


async def test_the_sequence_rule_is_the_same_on_both_feeds(
    index_feed: Callable[[BlockIndex], IndexFeed],
) -> None:
    index = BlockIndex(1000)
    feed = index_feed(index)
    reader = asyncio.create_task(feed.run())
    try:
        assert await _report(feed, []) == (0, 0, False, False)
        assert await _report(feed, [batch(3, stored((1,), toks(1)))]) == (1, 4, False, False)
        assert await _report(feed, [batch(3), batch(5, stored((2,), toks(1, BS), 1))]) == (1, 6, True, False)
        assert index.node_block_count(NODE) == 2
        assert await _report(feed, [batch(0), batch(1, stored((7,), toks(1, 9)))]) == (2, 2, False, True)
        assert index.node_block_count(NODE) == 1
        await feed.drop(NODE, 1, 0.0)
        assert index.node_block_count(NODE) == 0
        assert await _report(feed, [batch(1)]) == (1, 2, False, False)  # a new start: any seq
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def test_a_reader_cancelled_as_it_applies_an_entry_stops(redis_server: int) -> None:
    """As the change feed's (test_change_feed): cancelled in the step it applied an entry, its next
    XREAD being sent under redis-py's wait_for, the reader ends all the same."""
    client = registry_client(RedisSettings(url=f"redis://127.0.0.1:{redis_server}/0"))
    feed = RedisIndexFeed(client, BlockIndex(1000))
    reader = asyncio.create_task(feed.run())
    try:
        # Waiting on the reader's condition before the entry exists: woken in the reader's step.
        async with feed._moved:
            entry = asyncio.ensure_future(client.xadd(feed.key, {"n": 1, "d": NODE}))
            await feed._moved.wait_for(lambda: feed._applied != (0, 0))
        reader.cancel()
        await asyncio.wait({reader}, timeout=5)
        assert reader.cancelled()
        await entry
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await client.aclose()
