"""What a pool's read server keeps, whatever side channel readers reach it on: the sealed
allocations published under fresh read ids, the readers' heartbeats that hold them, and the
read-done notifications that release them (kvshuttle.agent.pool.serve, NIXL's; an emulated
cluster's own, bench/emulator/http/pool_plane.py).

`publish()` registers a sealed allocation under a fresh read id and returns kv_transfer_params
that name the server; the router keeps them in the registry (the retention moved to the agent's
pool node) and hands them to a prefill once it claimed the retention there: the registry's
claim is the single-use guard. The reader reads the slots and notifies the read id with its
number of consumers, which releases them once that many arrived. A reader holding a shared
claim (the forks of one history) notifies the read id with its own suffix
(kvshuttle.vllm.shared_reads): its heartbeats and read-done hold the allocation like any
reader's, and its read-done frees nothing.

Deadlines: prefill compares `remote_blocks_expiry_time` with its perf_counter rebased by the
clock offset it measured in the handshake, i.e. in the clock of whoever answered the handshake:
the agent's own perf_counter (`clock`). It is the allocation's own expiry (the pool's sweep
frees it then), and prefill declines a read that would start within 5 s of it. A reader's
heartbeat naming a read id keeps its allocation at least `lease + grace` longer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import structlog

from kvshuttle.agent.pool.blocks import Allocation, BlockPool, SlotState
from kvshuttle.agent.pool.side_channel import Handshake
from kvshuttle.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kvshuttle.vllm.shared_reads import read_of

__all__ = ["PREFILL_EXPIRY_MARGIN", "PublishedReads", "Served"]

log = structlog.get_logger("kvshuttle.agent")

# vLLM 0.32's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN: prefill declines a read this close to the expiry.
PREFILL_EXPIRY_MARGIN: Final = 5.0


@dataclass(slots=True)
class Served:
    """A published allocation a reader may read, by the read id its notification names."""

    name: str  # the pool allocation
    read_id: str
    slots: tuple[int, ...]  # the allocation's: a later allocation of the same name is another
    expiry_time: float  # advertised, on the agent's perf_counter
    notified: int = 0
    active_until: float = 0.0  # time.monotonic(): a reader heartbeated or notified until then


class PublishedReads:
    """The published allocations of one server. Bounded: a served entry is a live allocation's,
    so there are never more than the pool has slots."""

    def __init__(
        self,
        pool: BlockPool,
        engine: Handshake,
        *,
        host: str,
        port: int = 0,
        lease: float = 30.0,
        grace: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`engine`: the handshake of the engine whose blocks the pool mirrors. `port` 0: any
        free port (see `port` once the side channel listens). `lease` + `grace`: seconds a
        reader's heartbeat holds its allocation; `lease` more than PREFILL_EXPIRY_MARGIN.
        `clock` is what deadlines are advertised on, `monotonic` the pool's."""
        if lease <= PREFILL_EXPIRY_MARGIN or grace < 0:
            raise ValueError(f"lease must exceed prefill's {PREFILL_EXPIRY_MARGIN:g} s margin, grace >= 0")
        pool.layout.check_mirrors(engine.metadata.block_lens)
        self._pool = pool
        self._engine = engine
        self.host = host
        self.port = port
        self._lease = lease
        self._grace = grace
        self._clock = clock
        self._monotonic = monotonic
        # Fresh per server: prefill caches a remote's layout by engine id.
        self.engine_id = f"kvshuttle-{uuid.uuid4().hex}"
        self._served: dict[str, Served] = {}  # by read id
        self._by_name: dict[str, str] = {}  # allocation name -> read id
        self.reads = 0  # allocations released by their read-done notifications
        self.shared_reads = 0  # shared readers' read-done notifications (nothing released)

    @property
    def served(self) -> dict[str, Served]:
        """Published allocations by read id."""
        return dict(self._served)

    def publish(self, name: str, num_tokens: int) -> dict[str, Any]:
        """Serve `name`'s sealed slots under a fresh read id, until the allocation's own expiry,
        and return the kv_transfer_params that make prefill read them from this server. Raises
        NotFound (no such allocation), FailedPrecondition (not PARKED, or already published),
        InvalidArgument (num_tokens outside the slots)."""
        allocation = self._pool.get(name)
        if allocation.state is not SlotState.PARKED:
            raise FailedPrecondition(f"{name} is {allocation.state}, not sealed")
        if name in self._by_name:
            raise FailedPrecondition(f"{name} is served already")
        block_size = self._engine.metadata.block_size
        if not 0 < num_tokens <= allocation.blocks * block_size:
            raise InvalidArgument("num_tokens", f"must be within 1..{allocation.blocks * block_size}")
        served = Served(
            name=name,
            read_id=f"kvshuttle-pool-{uuid.uuid4().hex}",
            slots=allocation.slots,
            expiry_time=self._clock() + (allocation.expire_at - self._monotonic()),
        )
        self._served[served.read_id] = served
        self._by_name[name] = served.read_id
        meta = self._engine.metadata
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": [list(allocation.slots)],
            "remote_num_tokens": num_tokens,
            "remote_request_id": served.read_id,
            "remote_blocks_expiry_time": served.expiry_time,
            "tp_size": 1,
            "pp_size": 1,
            "dcp_size": meta.dcp_size,
        }

    def withdraw(self, name: str) -> None:
        """Stop serving `name` (its allocation was released by its owner)."""
        read_id = self._by_name.pop(name, None)
        if read_id is not None:
            self._served.pop(read_id, None)

    def active(self, name: str) -> bool:
        """Whether a reader is on `name`'s slots: it heartbeated or notified part of its reads
        within `lease + grace`. Such an allocation is never evicted."""
        read_id = self._by_name.get(name)
        served = None if read_id is None else self._served.get(read_id)
        return served is not None and served.active_until > self._monotonic()

    def heartbeat(self, read_ids: Iterable[str]) -> None:
        """A reader waits to read `read_ids`: hold their allocations `lease + grace` longer."""
        hold = self._monotonic() + self._lease + self._grace
        for request_id in read_ids:
            served = self._served.get(read_of(request_id)[0])
            if served is not None and self._current(served) is not None:
                served.active_until = max(served.active_until, hold)
                allocation = self._pool.get(served.name)
                if allocation.expire_at < hold:
                    self._pool.renew(served.name, expire_at=hold)

    def read_done(self, peer: str, request_id: str, consumers: int) -> None:
        """One of `consumers` readers of `request_id` is done: released once all of them are,
        unless they read it shared (then it stays for the next reader)."""
        read_id, shared = read_of(request_id)
        served = self._served.get(read_id)
        if served is None:
            log.warning("agent.serve.unknown_read", peer=peer, request_id=request_id[:64])
            return
        served.active_until = max(served.active_until, self._monotonic() + self._lease + self._grace)
        if shared:
            self.shared_reads += 1
            return
        served.notified += 1
        if served.notified >= consumers:
            self._release(served, "read")

    def current(self, read_id: str) -> Served | None:
        """The entry `read_id` names while its allocation is still the one published."""
        served = self._served.get(read_id)
        return served if served is not None and self._current(served) is not None else None

    def _current(self, served: Served) -> Allocation | None:
        """`served`'s allocation while it is still the one published (sealed, same slots)."""
        try:
            allocation = self._pool.get(served.name)
        except NotFound:
            return None
        if allocation.slots != served.slots or allocation.state is not SlotState.PARKED:
            return None
        return allocation

    def _sweep(self) -> None:
        for served in [s for s in self._served.values() if self._current(s) is None]:
            self._forget(served)  # released meanwhile by its owner, or by expiry

    def _forget(self, served: Served) -> None:
        del self._served[served.read_id]
        if self._by_name.get(served.name) == served.read_id:
            del self._by_name[served.name]

    def _release(self, served: Served, why: str) -> None:
        self._forget(served)
        if self._current(served) is None:
            return
        allocation = self._pool.release(served.name)
        self.reads += 1
        log.info("agent.serve.released", retention=served.name, blocks=allocation.blocks, why=why)
