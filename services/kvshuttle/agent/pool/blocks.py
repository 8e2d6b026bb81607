"""The agent's block pool: fixed-size slots of host memory, handed out to retentions whole.

Pure bookkeeping, no NIXL and no clock of its own (kvshuttle.agent.pool.nixl_memory holds the bytes;
the caller passes `now`, seconds on a monotonic clock). The layout is vLLM's: `regions` arrays
(one per attention layer, or per K and V) of `blocks` blocks of `block_bytes` each; slot `s` is
block `s` of every region, so one slot holds one engine block.

A retention's life here: `allocate` (FILLING: its slots are written, by a move's NIXL READ),
`seal` (PARKED: its bytes never change again; prefill may read them), and `release` or expiry,
which alone give the slots back. A slot lives in exactly one place, the free stack or one live
Allocation, so handing out a slot that a live retention names cannot happen: the free stack
never holds it. Who may read a parked retention is the registry's single-use claim, not the
pool's: the mover releases (evicts) one only once the registry dropped it, which it refuses
while a reader holds the claim, and prefill declines a read within 5 s of the deadline the pool
advertised (kvshuttle.agent.pool.serve).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvshuttle.core.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvshuttle.core.reasons import ErrorReason

__all__ = ["Allocation", "BlockPool", "PoolLayout", "PoolStats", "SlotState"]


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """`regions` x `blocks` x `block_bytes`, region-major (region i starts at i * region_bytes)."""

    regions: int
    blocks: int
    block_bytes: int

    def __post_init__(self) -> None:
        if self.regions <= 0 or self.blocks <= 0 or self.block_bytes <= 0:
            raise ValueError("a pool layout needs regions, blocks and block_bytes above 0")

    @property
    def region_bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: one block in every region."""
        return self.regions * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.regions * self.region_bytes

    def check_mirrors(self, block_lens: Sequence[int]) -> None:
        """Raises FailedPrecondition (metadata "differs": "regions" or "block_bytes") unless an
        engine block of `block_lens` (bytes in each of its regions, as its NIXL handshake
        advertises them) fills one slot exactly: as many regions, each of block_bytes."""
        if len(block_lens) != self.regions:
            raise FailedPrecondition(
                f"the engine has {len(block_lens)} KV regions, the pool {self.regions}: set pool.regions",
                metadata={"differs": "regions"},
            )
        other = sorted({n for n in block_lens if n != self.block_bytes})
        if other:
            raise FailedPrecondition(
                f"the engine's blocks are {other[0]} bytes in a region, the pool's {self.block_bytes}: "
                "set pool.block_bytes",
                metadata={"differs": "block_bytes"},
            )

    def offset(self, region: int, slot: int) -> int:
        """Byte offset of `slot`'s block in `region` from the start of the pool."""
        if not (0 <= region < self.regions and 0 <= slot < self.blocks):
            raise IndexError(f"no block {slot} in region {region} of {self}")
        return region * self.region_bytes + slot * self.block_bytes


class SlotState(StrEnum):
    FILLING = "filling"  # being written; not readable yet
    PARKED = "parked"  # sealed: immutable, readable, expires


@dataclass(frozen=True, slots=True)
class Allocation:
    """The slots one retention holds, as the pool last saw them (a snapshot: the pool replaces
    it on every change of state; its `slots` never change)."""

    name: str
    slots: tuple[int, ...]
    state: SlotState
    expire_at: float  # monotonic seconds
    slot_bytes: int

    @property
    def blocks(self) -> int:
        return len(self.slots)

    @property
    def bytes(self) -> int:
        return len(self.slots) * self.slot_bytes


@dataclass(frozen=True, slots=True)
class PoolStats:
    regions: int
    total_blocks: int
    used_blocks: int
    slot_bytes: int
    filling_retentions: int
    parked_retentions: int
    expired_retentions: int  # since the pool was made
    failed_allocations: int  # allocations refused for want of free slots

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    @property
    def capacity_bytes(self) -> int:
        return self.total_blocks * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.slot_bytes

    @property
    def free_bytes(self) -> int:
        return self.free_blocks * self.slot_bytes


class BlockPool:
    """Slots of one PoolLayout, by retention name. Every method that raises changes nothing.

    Memory is bounded by the layout: every allocation holds at least one slot, so there are
    never more allocations than slots.
    """

    def __init__(self, layout: PoolLayout) -> None:
        self.layout = layout
        # A stack, lowest slots on top: a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(layout.blocks - 1, -1, -1))
        self._live: dict[str, Allocation] = {}
        self._expired = 0
        self._failed = 0

    def allocate(self, name: str, blocks: int, *, expire_at: float) -> Allocation:
        """`blocks` free slots for `name`, FILLING until sealed. Raises InvalidArgument (blocks
        < 1, or more than the pool has), FailedPrecondition (name already live) or
        ResourceExhausted (not enough free slots now)."""
        if not 0 < blocks <= self.layout.blocks:
            raise InvalidArgument("blocks", f"must be within 1..{self.layout.blocks}")
        if name in self._live:
            raise FailedPrecondition(f"{name} already holds pool slots")
        if blocks > len(self._free):
            self._failed += 1
            raise ResourceExhausted(
                f"the pool has {len(self._free)} free blocks, {blocks} asked",
                reason=ErrorReason.CAPACITY_EXCEEDED,
                metadata={"free_blocks": str(len(self._free))},
            )
        slots = tuple(self._free.pop() for _ in range(blocks))
        allocation = Allocation(name, slots, SlotState.FILLING, expire_at, self.layout.slot_bytes)
        self._live[name] = allocation
        return allocation

    def seal(self, name: str, *, expire_at: float | None = None) -> Allocation:
        """FILLING -> PARKED: the slots are written and never change again until freed."""
        return self._move(name, SlotState.FILLING, SlotState.PARKED, expire_at)

    def renew(self, name: str, *, expire_at: float) -> Allocation:
        """A new expiry for a PARKED retention."""
        return self._move(name, SlotState.PARKED, SlotState.PARKED, expire_at)

    def release(self, name: str) -> Allocation:
        """Free `name`'s slots, in any state. Raises NotFound when it holds none."""
        allocation = self._live.pop(name, None)
        if allocation is None:
            raise NotFound(f"{name} holds no pool slots", reason=ErrorReason.RETENTION_NOT_FOUND)
        self._free.extend(reversed(allocation.slots))
        return allocation

    def expire(self, now: float) -> list[Allocation]:
        """Free every FILLING or PARKED allocation whose expire_at is at or before `now`."""
        due = [a for a in self._live.values() if a.expire_at <= now]
        for allocation in due:
            self.release(allocation.name)
        self._expired += len(due)
        return due

    def get(self, name: str) -> Allocation:
        allocation = self._live.get(name)
        if allocation is None:
            raise NotFound(f"{name} holds no pool slots", reason=ErrorReason.RETENTION_NOT_FOUND)
        return allocation

    def allocations(self) -> list[Allocation]:
        return list(self._live.values())

    def stats(self) -> PoolStats:
        states = [a.state for a in self._live.values()]
        return PoolStats(
            regions=self.layout.regions,
            total_blocks=self.layout.blocks,
            used_blocks=self.layout.blocks - len(self._free),
            slot_bytes=self.layout.slot_bytes,
            filling_retentions=states.count(SlotState.FILLING),
            parked_retentions=states.count(SlotState.PARKED),
            expired_retentions=self._expired,
            failed_allocations=self._failed,
        )

    def _move(self, name: str, before: SlotState, after: SlotState, expire_at: float | None) -> Allocation:
        allocation = self.get(name)
        if allocation.state is not before:
            raise FailedPrecondition(f"{name} is {allocation.state}, not {before}")
        moved = Allocation(
            name,
            allocation.slots,
            after,
            allocation.expire_at if expire_at is None else expire_at,
            allocation.slot_bytes,
        )
        self._live[name] = moved
        return moved
