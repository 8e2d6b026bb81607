"""The block pool's bytes: page-aligned host memory registered with a NIXL agent (UCX, DRAM).

The NIXL agent runs without its progress thread (these machines have few cores, and the agent's
event loop already polls): UCX then moves only while someone calls into the agent, on both
sides of a transfer. A reader polls its transfer with `check_xfer_state`; the holder of the
memory must keep calling `progress()` (NIXL's get_new_notifs) while others read from it, or a
remote READ, its connection set-up included, never completes.

NIXL's agent is not thread-safe here (no progress thread, no synchronisation): every call into
it goes through `run`, one dedicated thread shared by parks and serving. `pump()` (on that
thread) drives UCX and keeps the notifications that arrived, bounded, for `take_notifications`.

Descriptors are vLLM's: one per (region, slot), region-major, `(address, block_bytes, 0)`, so a
peer indexes block b of region i as `i * blocks + b`, as vLLM's NixlConnector does with
`cumsum([0] + region_num_blocks)[i] + b`.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar

import numpy as np
import numpy.typing as npt
from nixl._api import nixl_agent, nixl_agent_config

from kvshuttle.agent.pool.blocks import Allocation, PoolLayout, SlotState
from kvshuttle.core.errors import FailedPrecondition

__all__ = ["MAX_PENDING_NOTIFICATIONS", "NixlPoolMemory"]

# Notifications kept between two take_notifications(); older ones are dropped (and counted)
# past it, so a flood from a peer costs bounded memory.
MAX_PENDING_NOTIFICATIONS: Final = 4096
_T = TypeVar("_T")

_DRAM = "DRAM"
_DEVICE_ID = 0  # host memory: NIXL wants device 0 for DRAM


class NixlPoolMemory:
    """`layout.total_bytes` of anonymous, page-aligned memory, registered with a NIXL agent of
    its own named `agent_name` (give a restarted agent a fresh name: peers cache by name).
    `close()` once."""

    def __init__(
        self,
        layout: PoolLayout,
        *,
        agent_name: str,
        backends: Sequence[str] = ("UCX",),
        max_pending_notifications: int = MAX_PENDING_NOTIFICATIONS,
    ) -> None:
        self.layout = layout
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshuttle-nixl")
        self._pending: deque[tuple[str, bytes]] = deque()
        self._max_pending = max_pending_notifications
        self._pending_lock = threading.Lock()
        self.dropped_notifications = 0
        # An anonymous mapping is page-aligned and zero-filled, and its pages are committed
        # only when touched: a large pool costs nothing until it is used.
        self._mmap = mmap.mmap(-1, layout.total_bytes)
        self._array: npt.NDArray[np.uint8] = np.frombuffer(self._mmap, dtype=np.uint8).reshape(
            layout.regions, layout.blocks, layout.block_bytes
        )
        self.base_address: int = self._array.ctypes.data
        self.agent = nixl_agent(
            agent_name,
            nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=list(backends)),
        )
        self.agent_name = agent_name
        self._registered = self.agent.register_memory(
            [(self.base_address, layout.total_bytes, _DEVICE_ID, "")], _DRAM
        )
        self._closed = False

    def metadata(self) -> bytes:
        """This agent's NIXL metadata, for a peer's add_remote_agent."""
        return bytes(self.agent.get_agent_metadata())

    def block(self, region: int, slot: int) -> npt.NDArray[np.uint8]:
        """A view of `slot`'s block in `region`. Drop it before close(): a view still held keeps
        the mapping alive until it is collected."""
        view: npt.NDArray[np.uint8] = self._array[region, slot]
        return view

    def descriptors(self, slots: Sequence[int] | None = None) -> npt.NDArray[np.uint64]:
        """(address, length, device) rows for `slots` (all when None), region-major: every slot's
        block in region 0, then region 1, ..."""
        layout = self.layout
        chosen = np.arange(layout.blocks, dtype=np.uint64) if slots is None else np.asarray(slots, np.uint64)
        if chosen.size and int(chosen.max()) >= layout.blocks:
            raise IndexError(f"slot {int(chosen.max())} is outside a pool of {layout.blocks}")
        regions = np.arange(layout.regions, dtype=np.uint64)[:, None] * np.uint64(layout.region_bytes)
        addresses = np.uint64(self.base_address) + regions + chosen[None, :] * np.uint64(layout.block_bytes)
        rows = np.empty((addresses.size, 3), dtype=np.uint64)
        rows[:, 0] = addresses.ravel()
        rows[:, 1] = layout.block_bytes
        rows[:, 2] = _DEVICE_ID
        return rows

    def write_descriptors(self, allocation: Allocation) -> npt.NDArray[np.uint64]:
        """Where a park's READ may write: only a FILLING allocation's slots. Sealed slots are
        never a destination, so a parked retention's bytes cannot change."""
        if allocation.state is not SlotState.FILLING:
            raise FailedPrecondition(f"{allocation.name} is {allocation.state}: its slots are sealed")
        return self.descriptors(allocation.slots)

    def run(self, call: Callable[[], _T]) -> asyncio.Future[_T]:
        """`call()` on the NIXL thread, after whatever NIXL work was queued before it (from a
        running event loop). Cancelling the future does not stop a call already started."""
        return asyncio.get_running_loop().run_in_executor(self._thread, call)

    def progress(self) -> dict[str, list[bytes]]:
        """Drive UCX once (no progress thread) and return the notifications that arrived, by
        remote agent name. Only where nothing else takes this agent's notifications."""
        notifs: dict[str, list[bytes]] = self.agent.get_new_notifs()
        return notifs

    def pump(self) -> None:
        """On the NIXL thread: drive UCX once and keep what arrived for take_notifications()."""
        arrived = [(str(peer), bytes(m)) for peer, messages in self.progress().items() for m in messages]
        if not arrived:
            return
        with self._pending_lock:
            self._pending.extend(arrived)
            while len(self._pending) > self._max_pending:
                self._pending.popleft()
                self.dropped_notifications += 1

    def take_notifications(self) -> list[tuple[str, bytes]]:
        """(remote agent name, message) of every notification pump() kept since the last call."""
        with self._pending_lock:
            taken = list(self._pending)
            self._pending.clear()
        return taken

    def close(self) -> None:
        """Waits for the NIXL work in flight (a READ, bounded by its deadline), then frees the
        memory. Blocking: call it off the event loop where that matters."""
        if self._closed:
            return
        self._closed = True
        self._thread.shutdown(wait=True)
        self.agent.deregister_memory(self._registered)
        del self._array
        with contextlib.suppress(BufferError):  # a block() view is still held
            self._mmap.close()
