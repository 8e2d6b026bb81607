"""The pool's data plane: how KV moves into an agent's pool and out of it, as the mover needs it.

* read a holder's blocks into fresh pool slots and notify the holder (`SlotReader`: a park,
  prefetch or pull);
* serve the pool's sealed slots to a reader and learn that the read is done (`ReadServer`);
* the holders' and the own engine's descriptions (`Handshake`: block size, layout, clock), from
  their side channels.

`DataPlane` opens both for one start of the pool. NIXL is the one that ships
(kvshuttle.agent.pool.nixl_plane: UCX READs into registered host memory, vLLM's side channel);
an emulated cluster brings its own (bench/emulator/http/pool_plane.py). No NIXL here: a plane's own
module imports what it moves bytes with.

What every plane shares: the retention's params read as `RetainedBlocks`, and the checks a read
must pass before any slot is allocated (`check_readable`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar

from kvshuttle.agent.pool.blocks import Allocation, BlockPool
from kvshuttle.agent.pool.side_channel import Handshake
from kvshuttle.core.errors import FailedPrecondition, InvalidArgument
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

if TYPE_CHECKING:
    import zmq.asyncio

    from kvshuttle.agent.config import PoolSettings
    from kvshuttle.vllm.nixl_compat import Expected

__all__ = [
    "DataPlane",
    "HolderFetch",
    "OpenedPool",
    "Parked",
    "PreparedRead",
    "ReadServer",
    "RetainedBlocks",
    "SlotReader",
    "check_readable",
]

_REQUIRED: Final = ("remote_engine_id", "remote_request_id", "remote_num_tokens", "remote_blocks_expiry_time")
_R = TypeVar("_R")


@dataclass(frozen=True, slots=True)
class RetainedBlocks:
    """What decode's kv_transfer_params say it retains: one KV-cache group's block ids."""

    engine_id: str
    request_id: str  # exactly as returned: the notification names it
    block_ids: tuple[int, ...]
    num_tokens: int
    expiry_time: float  # the engine's perf_counter; its blocks may be reused after it

    @classmethod
    def of(cls, params: KvTransferParams, field: str = "kv_transfer_params") -> RetainedBlocks:
        """Raises InvalidArgument naming the missing or unusable field."""
        for name in _REQUIRED:
            if not params.HasField(name):
                raise InvalidArgument(f"{field}.{name}", "missing")
        if len(params.remote_block_ids) != 1 or not params.remote_block_ids[0].block_ids:
            raise InvalidArgument(f"{field}.remote_block_ids", "must hold one non-empty KV-cache group")
        return cls(
            engine_id=params.remote_engine_id,
            request_id=params.remote_request_id,
            block_ids=tuple(params.remote_block_ids[0].block_ids),
            num_tokens=params.remote_num_tokens,
            expiry_time=params.remote_blocks_expiry_time,
        )


@dataclass(frozen=True, slots=True)
class Parked:
    allocation: Allocation  # SEALED: slot i holds the engine's block_ids[i]
    num_tokens: int
    bytes: int  # moved by the READ
    read_seconds: float  # from posting the READ to its completion


@dataclass(frozen=True, slots=True)
class PreparedRead(Generic[_R]):
    """A READ whose slots are allocated (FILLING) and not started yet: its reader's `read` it.
    `read` is the reader's own (what it will transfer)."""

    name: str
    retained: RetainedBlocks
    read: _R


def check_readable(
    pool: BlockPool, retained: RetainedBlocks, holder: Handshake, *, timeout: float, expiry_margin: float
) -> None:
    """Raises what a park raises for params `holder` cannot serve, without touching the pool:
    FailedPrecondition (another engine's blocks: NODE_MISMATCH; the holder's pin ends within
    a READ's `timeout` + `expiry_margin`: PIN_EXPIRED; a pool that does not mirror the holder's
    blocks), InvalidArgument (too few blocks for the tokens)."""
    meta = holder.metadata
    if retained.engine_id != meta.engine_id:
        raise FailedPrecondition(
            f"the retention's blocks are on engine {retained.engine_id}, not {meta.engine_id}",
            reason=ErrorReason.NODE_MISMATCH,
        )
    pool.layout.check_mirrors([r.block_len for r in holder.layout.regions])
    if len(retained.block_ids) < math.ceil(retained.num_tokens / meta.block_size):
        raise InvalidArgument(
            "kv_transfer_params.remote_block_ids", f"too few blocks for {retained.num_tokens} tokens"
        )
    # The engine may reuse the blocks once its pin ends: a READ must finish well before.
    left = holder.clock.to_local(retained.expiry_time) - time.perf_counter()
    if left < timeout + expiry_margin:
        raise FailedPrecondition(
            f"the engine's pin on the blocks ends in {left:.1f} s, within a READ's {timeout:g} s deadline",
            reason=ErrorReason.PIN_EXPIRED,
        )


class SlotReader(Protocol[_R]):
    """Reads a holder's blocks into pool slots (kvshuttle.agent.pool.park.Parker for NIXL)."""

    def check(self, retained: RetainedBlocks, engine: Handshake) -> None:
        """check_readable with the reader's deadline."""

    def prepare(
        self, name: str, retained: RetainedBlocks, engine: Handshake, *, notify: bool = True
    ) -> PreparedRead[_R]:
        """The checks, then `retained`'s slots allocated (FILLING) as `name`, at once (no await);
        `notify`: the READ tells the holder it is done (it frees its blocks)."""

    async def read(self, prepared: PreparedRead[_R], *, expire_at: float) -> Parked:
        """Run a prepared READ and seal its slots with `expire_at` (time.monotonic()). Raises
        Unavailable (the slots released, unless a READ that cannot be stopped still writes)."""


class ReadServer(Protocol):
    """Serves sealed allocations to readers (kvshuttle.agent.pool.serve.PoolServer for NIXL)
    on a side channel of its own, as an engine serves its held blocks."""

    engine_id: str  # what the side channel's handshake names (fresh per server)
    host: str
    port: int  # bound once started
    reads: int  # allocations freed by their reader's read-done
    shared_reads: int  # shared readers' read-done (kvshuttle.vllm.shared_reads): nothing freed

    @property
    def serving(self) -> bool: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def publish(self, name: str, num_tokens: int) -> dict[str, Any]:
        """kv_transfer_params that make a prefill read `name`'s sealed slots from this server;
        the slots are released once read (unless read shared)."""

    def withdraw(self, name: str) -> None: ...

    def active(self, name: str) -> bool:
        """Whether a reader is on `name`'s slots (never evicted meanwhile)."""


class HolderFetch(Protocol):
    """A holder's handshake from its side channel (fetch_handshake's signature). Raises
    Unavailable (no answer), InvalidArgument (a malformed one), NixlIncompatible (its hash is
    not `expected_hash`)."""

    def __call__(
        self,
        context: zmq.asyncio.Context,
        host: str,
        port: int,
        *,
        reply_timeout: float,
        expected_hash: str | None,
    ) -> Awaitable[Handshake]: ...


@dataclass(frozen=True, slots=True)
class OpenedPool:
    """A data plane opened for one start of the pool. `close` waits for a READ in flight."""

    reader: SlotReader[Any]
    server: ReadServer | None  # None: the pool is not served (pool.serve_port unset)
    close: Callable[[], Awaitable[None]]
    memory: Any = None  # the plane's own (NIXL's registered memory), for status and tests


class DataPlane(Protocol):
    """How KV moves for one agent (see the module doc)."""

    @property
    def fetch_holder(self) -> HolderFetch:
        """How the mover gets a holder's handshake."""

    async def verify_engine(
        self,
        context: zmq.asyncio.Context,
        host: str,
        port: int,
        expected: Expected,
        *,
        reply_timeout: float,
    ) -> Handshake:
        """The own engine's handshake from its side channel, checked: what fetch_holder raises,
        and NixlIncompatible naming every difference from `expected`."""

    async def open(
        self,
        pool: BlockPool,
        engine: Handshake,
        settings: PoolSettings,
        context: zmq.asyncio.Context,
        *,
        name: str,
    ) -> OpenedPool:
        """The reader and (with settings.serve_port) the server of `pool`, whose blocks mirror
        `engine`'s, the server started; `name` is unique to this start (peers cache by it)."""
