"""Park: move one retention's blocks from a holder into the agent's block pool.

The holder is whatever answers a vLLM side channel: the agent's own engine (its handshake from
kvshuttle.agent.pool.side_channel.verify_engine), another engine, or another agent's pool server
(kvshuttle.agent.pool.serve), which stands in for an engine. One NIXL READ into freshly allocated
pool slots, carrying (unless told not to) the notification that frees the blocks at the holder
(`read_done_message(remote_request_id, 1)`), then `seal`. Anything short of a complete READ
releases the slots and raises, so the pool never holds a half-moved retention.

NIXL calls block, and the pool's NIXL agent runs without thread synchronisation or a progress
thread (kvshuttle.agent.pool.nixl_memory): every READ runs on the memory's one NIXL thread, polled to
its deadline there (pumping the notifications serving waits for meanwhile). Pool bookkeeping
stays on the event loop, beside the expiry sweep. Holders' NIXL agents are added once and kept,
by engine id, up to `max_remotes` (the least recently read from is removed past it).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import structlog

from kvshuttle.agent.pool.blocks import BlockPool
from kvshuttle.agent.pool.data_plane import Parked, PreparedRead, RetainedBlocks, check_readable
from kvshuttle.agent.pool.nixl_memory import NixlPoolMemory
from kvshuttle.agent.pool.side_channel import Handshake
from kvshuttle.core.errors import Unavailable
from kvshuttle.vllm.nixl_wire import read_done_message

__all__ = ["Parked", "Parker", "PreparedRead", "RetainedBlocks"]

log = structlog.get_logger("kvshuttle.agent")

# FILLING slots outlive a READ's deadline by this much before the expiry sweep may free them:
# a READ NIXL could not cancel may still write into them meanwhile.
QUARANTINE: Final = 60.0
_MIN_POLL: Final = 20e-6
_MAX_POLL: Final = 1e-3
# Holders' NIXL agents kept added (a decode engine or two, a few peers' pools).
MAX_REMOTES: Final = 16


@dataclass(frozen=True, slots=True)
class _Read:
    engine: Handshake
    local: npt.NDArray[np.uint64]
    remote: list[tuple[int, int, int]]
    notification: bytes | None
    deadline: float  # time.monotonic()


class _StillRunning(Unavailable):
    """NIXL could not cancel a timed-out READ: its slots stay FILLING (quarantined) until expiry."""


class Parker:
    """Parks retentions from any holder into `pool`/`memory` (whose close() waits for a READ in
    flight)."""

    def __init__(
        self,
        pool: BlockPool,
        memory: NixlPoolMemory,
        *,
        timeout: float = 10.0,
        expiry_margin: float = 1.0,
        max_remotes: int = MAX_REMOTES,
    ) -> None:
        if timeout <= 0 or expiry_margin < 0 or max_remotes < 1:
            raise ValueError("timeout and max_remotes must be positive and expiry_margin not negative")
        self._pool = pool
        self._memory = memory
        self._timeout = timeout
        self._expiry_margin = expiry_margin
        self._max_remotes = max_remotes
        # engine id -> the NIXL name of its agent, added; least recently read from first.
        self._remotes: OrderedDict[str, Any] = OrderedDict()

    @property
    def remotes(self) -> dict[str, Any]:
        """The holders' NIXL agents added, by engine id."""
        return dict(self._remotes)

    async def park(
        self, name: str, retained: RetainedBlocks, engine: Handshake, *, expire_at: float, notify: bool = True
    ) -> Parked:
        """Read `retained`'s blocks from `engine` (the holder's handshake) into slots held as
        `name`, sealed with `expire_at` (time.monotonic()); `notify`: send the holder the
        read-done notification that frees its blocks. Raises, changing nothing in the pool:
        FailedPrecondition (the params name another engine: NODE_MISMATCH; the holder's pin
        ends before the READ's deadline: PIN_EXPIRED; a pool layout that does not mirror the
        holder's; `name` already holds slots), InvalidArgument (block ids outside the holder's
        layout), ResourceExhausted (not enough free slots), Unavailable (the READ failed or
        timed out; the holder keeps its blocks until its own expiry)."""
        return await self.read(self.prepare(name, retained, engine, notify=notify), expire_at=expire_at)

    def prepare(
        self, name: str, retained: RetainedBlocks, engine: Handshake, *, notify: bool = True
    ) -> PreparedRead[_Read]:
        """park()'s checks and allocation, at once (no await): raises what park() raises before
        its READ. The slots are FILLING until `read` ends: read it right away."""
        self.check(retained, engine)
        remote = engine.layout.descriptors(retained.block_ids)  # InvalidArgument when out of range
        deadline = time.monotonic() + self._timeout
        allocation = self._pool.allocate(name, len(retained.block_ids), expire_at=deadline + QUARANTINE)
        read = _Read(
            engine,
            self._memory.write_descriptors(allocation),
            remote,
            read_done_message(retained.request_id, 1) if notify else None,
            deadline,
        )
        return PreparedRead(name, retained, read)

    async def read(self, prepared: PreparedRead[_Read], *, expire_at: float) -> Parked:
        """Run a prepared READ and seal its slots with `expire_at` (time.monotonic())."""
        name, retained, read = prepared.name, prepared.retained, prepared.read
        future = self._memory.run(lambda: self._read(read))
        try:
            seconds = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The READ goes on in its thread: its slots are freed only once it stopped.
            future.add_done_callback(lambda _: self._discard(name, future.exception()))
            raise
        except Exception as exc:
            self._discard(name, exc)
            raise
        sealed = self._pool.seal(name, expire_at=expire_at)
        log.info(
            "agent.parked",
            retention=name,
            engine=retained.engine_id,
            blocks=sealed.blocks,
            bytes=sealed.bytes,
            notified=read.notification is not None,
            ms=round(seconds * 1000, 3),
        )
        return Parked(sealed, retained.num_tokens, sealed.bytes, seconds)

    def check(self, retained: RetainedBlocks, engine: Handshake) -> None:
        """Raises what park() raises for params `engine` cannot serve (NODE_MISMATCH,
        PIN_EXPIRED, layout, too few blocks), without touching the pool."""
        check_readable(self._pool, retained, engine, timeout=self._timeout, expiry_margin=self._expiry_margin)

    def _discard(self, name: str, exc: BaseException | None) -> None:
        if isinstance(exc, _StillRunning):
            log.error("agent.park_stuck", retention=name, quarantine_s=QUARANTINE)
            return
        self._pool.release(name)
        log.warning("agent.park_failed", retention=name, error=str(exc) if exc else "cancelled")

    # -- on the NIXL thread ---------------------------------------------------------------------

    def _read(self, read: _Read) -> float:
        agent = self._memory.agent
        held: list[Any] = []  # NIXL handles, released last first
        try:
            if time.monotonic() >= read.deadline:
                raise Unavailable("the park waited past its deadline for the NIXL thread")
            try:
                remote = self._remote_agent(read.engine)
                held.append(agent.prep_xfer_dlist("NIXL_INIT_AGENT", read.local, "DRAM"))
                held.append(agent.prep_xfer_dlist(remote, read.remote, read.engine.layout.mem_type))
                rows = list(range(len(read.remote)))
                note = read.notification or b""  # empty: no notification
                held.append(agent.make_prepped_xfer("READ", held[0], rows, held[1], rows, note))
                started = time.monotonic()
                state = self._wait(agent, held[2], agent.transfer(held[2]), read.deadline)
            except Exception as exc:  # NIXL's bindings raise a dozen types with no common base
                raise Unavailable(f"NIXL READ failed: {type(exc).__name__}: {exc}") from None
            if state != "DONE":
                raise Unavailable("NIXL READ failed" if state == "ERR" else "NIXL READ timed out")
            return time.monotonic() - started
        finally:
            self._release(held)

    def _wait(self, agent: Any, handle: Any, state: str, deadline: float) -> str:
        delay = _MIN_POLL
        while state == "PROC" and time.monotonic() < deadline:
            # No progress thread: UCX moves only while the agent is called.
            self._memory.pump()
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL)
            state = agent.check_xfer_state(handle)
        return str(state)

    def _remote_agent(self, engine: Handshake) -> Any:
        agent = self._memory.agent
        engine_id = engine.metadata.engine_id
        name = agent.add_remote_agent(engine.metadata.agent_metadata)  # idempotent for one agent
        old = self._remotes.pop(engine_id, None)
        if old is not None and old != name and old not in self._remotes.values():
            agent.remove_remote_agent(old)  # the holder restarted: its old agent is gone
        self._remotes[engine_id] = name
        while len(self._remotes) > self._max_remotes:
            _, evicted = self._remotes.popitem(last=False)
            if evicted not in self._remotes.values():
                agent.remove_remote_agent(evicted)
        return name

    @staticmethod
    def _release(held: Sequence[Any]) -> None:
        for handle in reversed(held):
            try:
                handle.release()  # a transfer in flight is cancelled
            except Exception as exc:
                raise _StillRunning(f"NIXL could not cancel the READ: {type(exc).__name__}: {exc}") from None
