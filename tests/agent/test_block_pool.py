"""The agent's block pool bookkeeping: layout, lifecycle, accounting, expiry, and the property
that a slot a live retention names is never handed out again (a state machine)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvshuttle.agent.pool.blocks import BlockPool, PoolLayout, SlotState
from kvshuttle.core.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvshuttle.core.reasons import ErrorReason

LAYOUT = PoolLayout(regions=4, blocks=8, block_bytes=1024)


def test_layout_is_region_major_like_vllm() -> None:
    assert (LAYOUT.region_bytes, LAYOUT.slot_bytes, LAYOUT.total_bytes) == (8192, 4096, 32768)
    assert LAYOUT.offset(0, 0) == 0
    assert LAYOUT.offset(0, 3) == 3 * 1024
    assert LAYOUT.offset(2, 3) == 2 * 8192 + 3 * 1024
    with pytest.raises(IndexError):
        LAYOUT.offset(4, 0)
    with pytest.raises(IndexError):
        LAYOUT.offset(0, 8)
    with pytest.raises(ValueError, match="above 0"):
        PoolLayout(regions=1, blocks=0, block_bytes=1)


def test_lifecycle_and_accounting() -> None:
    pool = BlockPool(LAYOUT)
    a = pool.allocate("r/a", 3, expire_at=10.0)
    assert (a.slots, a.state, a.blocks, a.bytes) == ((0, 1, 2), SlotState.FILLING, 3, 3 * 4096)
    pool.allocate("r/b", 2, expire_at=10.0)
    assert pool.seal("r/a").state is SlotState.PARKED
    stats = pool.stats()
    assert (stats.total_blocks, stats.used_blocks, stats.free_blocks) == (8, 5, 3)
    assert (stats.capacity_bytes, stats.used_bytes, stats.free_bytes) == (32768, 5 * 4096, 3 * 4096)
    assert (stats.filling_retentions, stats.parked_retentions) == (1, 1)
    assert pool.release("r/a").slots == (0, 1, 2)
    assert pool.stats().used_blocks == 2
    with pytest.raises(NotFound) as not_found:
        pool.release("r/a")
    assert not_found.value.reason == ErrorReason.RETENTION_NOT_FOUND


def test_refusals_change_nothing() -> None:
    pool = BlockPool(LAYOUT)
    pool.allocate("r/a", 6, expire_at=10.0)
    before = (pool.allocations(), pool.stats().used_blocks)
    with pytest.raises(ResourceExhausted) as full:
        pool.allocate("r/b", 3, expire_at=10.0)
    assert (full.value.reason, full.value.metadata) == (ErrorReason.CAPACITY_EXCEEDED, {"free_blocks": "2"})
    with pytest.raises(FailedPrecondition):
        pool.allocate("r/a", 1, expire_at=10.0)
    for blocks in (0, 9):
        with pytest.raises(InvalidArgument):
            pool.allocate("r/c", blocks, expire_at=10.0)
    with pytest.raises(FailedPrecondition):
        pool.renew("r/a", expire_at=99.0)  # still filling: nothing sealed to renew
    pool.seal("r/a")
    with pytest.raises(FailedPrecondition):
        pool.seal("r/a")  # sealed once: its bytes never change again
    assert pool.stats().failed_allocations == 1
    assert [a.slots for a in pool.allocations()] == [s.slots for s in before[0]]
    assert pool.stats().used_blocks == before[1]


def test_expiry_frees_filling_and_parked_at_their_deadlines() -> None:
    pool = BlockPool(LAYOUT)
    pool.allocate("filling", 1, expire_at=5.0)
    pool.allocate("parked", 1, expire_at=5.0)
    pool.seal("parked")
    pool.allocate("later", 1, expire_at=50.0)
    pool.seal("later")
    assert pool.expire(4.9) == []
    assert sorted(a.name for a in pool.expire(5.0)) == ["filling", "parked"]
    assert sorted(a.name for a in pool.allocations()) == ["later"]
    pool.renew("later", expire_at=100.0)
    assert pool.expire(60.0) == []
    assert pool.stats().expired_retentions == 2


def test_a_live_retentions_slots_are_never_handed_out() -> None:
    pool = BlockPool(LAYOUT)
    pool.allocate("parked", 4, expire_at=10.0)
    held = set(pool.seal("parked").slots)
    taken = set(pool.allocate("other", 4, expire_at=10.0).slots)
    assert not held & taken
    with pytest.raises(ResourceExhausted):
        pool.allocate("third", 1, expire_at=10.0)
    pool.release("parked")
    assert set(pool.allocate("third", 4, expire_at=10.0).slots) == held


class PoolMachine(RuleBasedStateMachine):
    """Any sequence of pool operations keeps every slot in exactly one place."""

    names = Bundle("names")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(PoolLayout(regions=2, blocks=12, block_bytes=64))
        self.now = 0.0
        self.counter = 0

    @rule(target=names, blocks=st.integers(1, 13), ttl=st.floats(0, 10))
    def allocate(self, blocks: int, ttl: float) -> str:
        self.counter += 1
        name = f"r/{self.counter}"
        free_before = self.pool.stats().free_blocks
        live_slots = {s for a in self.pool.allocations() for s in a.slots}
        try:
            allocation = self.pool.allocate(name, blocks, expire_at=self.now + ttl)
        except (ResourceExhausted, InvalidArgument):
            assert blocks > free_before
            return name
        assert not set(allocation.slots) & live_slots
        assert len(set(allocation.slots)) == blocks
        return name

    @rule(name=names)
    def seal(self, name: str) -> None:
        with contextlib.suppress(NotFound, FailedPrecondition):
            self.pool.seal(name)

    @rule(name=consumes(names))
    def release(self, name: str) -> None:
        with contextlib.suppress(NotFound):
            self.pool.release(name)

    @rule(seconds=st.floats(0, 5))
    def tick(self, seconds: float) -> None:
        self.now += seconds
        live = {a.name: a.expire_at for a in self.pool.allocations()}
        expired = {a.name for a in self.pool.expire(self.now)}
        assert expired == {name for name, at in live.items() if at <= self.now}

    @invariant()
    def slots_partition(self) -> None:
        held = [s for a in self.pool.allocations() for s in a.slots]
        assert len(held) == len(set(held))
        stats = self.pool.stats()
        assert (stats.used_blocks, stats.free_blocks) == (len(held), 12 - len(held))
        assert set(held) <= set(range(12))


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, derandomize=True)
test_pool_state_machine = PoolMachine.TestCase
