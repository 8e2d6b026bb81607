"""One emulated vLLM 0.32 engine with the NixlConnector (`kv_both`, bidirectional) and the
OffloadingConnector, without a transport: what the HTTP stand-in (bench/emulator/http/engine.py)
and the fleet simulator (bench/emulator/fleet/engine.py) both drive. They bring the transport (how
a READ reaches the holder: `KvReader`) and the content model (what a block's key and content are,
and what answer a request's KV gives); the rules are here, once.

A request, as kvshuttle and the peers use vLLM's `/v1/completions` with `kv_transfer_params`:

1. `find`: the prompt's leading blocks found in the GPU prefix cache, then the host tier (loaded
   back over the engine's PCIe link), then READ from another engine when the params ask for it:
   * `remote_engine_id` / `remote_request_id` / `remote_block_ids` / `remote_num_tokens`: with
     `do_remote_prefill` (a decode gets its prefill's blocks) whatever was not found is read;
     with `do_remote_decode` (a later turn's prefill gets a decode's retained blocks) only when
     they cover at least `kv_recompute_threshold` tokens more than what was found, else
     declined (vLLM's pull scheduler); either way the holder is notified and frees them (single
     use). A failed READ recomputes, or with
     `kv_load_failure_policy: fail` fails the request (`KvLoadFailed`).
   * `p2p_source_engine` / `p2p_source_tokens` (llm-d's P2P KV sharing): the leading blocks read
     from that engine's host tier (not freed there), above the same threshold.
   READs go over the engine's link (its NIC: processor-sharing, so concurrent reads slow each
   other), or flat per block when the engine is not profile-timed.
2. `submit`: the step scheduler (bench/emulator/core/scheduler.py) times the request: prompt
   tokens not found are computed (at least one: vLLM recomputes the last), then the output.
3. `keep`: the sequence's blocks go into the pool (full ones cached, their KV events published);
   with params they are held for one remote reader and the answered params name them: a request
   that came with `do_remote_decode` (a prefill for its decode) holds them for `kv_lease_s`; one
   with other params, with `retain_decode` (vLLM's `bidirectional_kv_xfer`), holds prompt +
   output - 1 tokens for `kv_blocks_ttl` s and answers `do_remote_decode` params (the next
   turn's prefill reads them once). Holdings expire on a timer at their due time.
4. `offload`: the OffloadingConnector stores the request's full blocks to host memory as it
   finishes (`offload_prompt_only: false`: the answer's blocks too), LRU by capacity.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from deploy.profiles.schema import EngineProfile

from bench.emulator.core.link import Link
from bench.emulator.core.pool import BlockPool, CacheFull, HostTier
from bench.emulator.core.timing import FixedTiming, Run, SteppedTiming, Timing
from kvshuttle.router.cost import LinkModel

__all__ = ["CacheFull", "CoreConfig", "EngineCore", "Found", "KvLoadFailed", "KvReader"]

_ADDRESSED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")

K = TypeVar("K", bound=Hashable)
C = TypeVar("C")
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)
C_co = TypeVar("C_co", covariant=True)


class KvLoadFailed(Exception):
    """A READ failed under `kv_load_failure_policy: fail`."""


class KvReader(Protocol[K_contra, C_co]):
    """How an engine's READs reach other engines (the transport)."""

    async def read(
        self, params: Mapping[str, Any], skip_blocks: int, upto_blocks: int
    ) -> Sequence[C_co] | None:
        """The contents of blocks [skip_blocks, upto_blocks) of the holding `params` name, read,
        and the holder notified (it frees the holding: single use; with nothing wanted this is
        the notification alone). None when the read failed (holding gone, holder unreachable)."""
        ...

    async def read_host(self, params: Mapping[str, Any], keys: Sequence[K_contra]) -> Sequence[C_co]:
        """The contents of the leading run of `keys` in the host tier of the engine `params` name
        (`p2p_source_engine`), not freed there; [] when it has none or cannot be reached."""
        ...


@dataclass(frozen=True, slots=True)
class CoreConfig:
    engine_id: str
    role: Literal["prefill", "decode"]  # a decode engine may prefill locally: both work anywhere
    block_size: int
    num_blocks: int
    profile: EngineProfile | None = None  # None: flat per-token costs, each request on its own
    prefix_caching: bool = True
    host_blocks: int = 0  # the OffloadingConnector's CPU tier (0: none)
    pcie: LinkModel | None = None  # host <-> GPU, for host-tier loads
    retain_decode: bool = True  # vLLM's bidirectional_kv_xfer on decode
    kv_blocks_ttl: float = 480.0  # decoder_kv_blocks_ttl
    kv_lease_s: float = 30.0  # how long prefill holds blocks for its decode
    kv_recompute_threshold: int = 64
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    # Whether a READ's trailing, partly valid block counts (vLLM's: yes). The fleet simulator's
    # content model verifies KV by full blocks only, so it counts full blocks alone.
    partial_block_reads: bool = True
    host: str = "127.0.0.1"  # what its params name as remote_host
    side_channel_port: int = 5600
    # Without a profile: flat costs (the stand-in's own flags).
    prefill_us_per_token: float = 20.0
    decode_ms_per_token: float = 0.5
    read_us_per_block: float = 50.0
    # Every modelled or configured duration (compute, reads, TTLs) times this.
    time_scale: float = 1.0


@dataclass(slots=True)
class Found(Generic[C]):
    """What `find` found of a prompt: `contents` of its leading blocks (the last may be valid only
    up to `tokens`), and where they came from."""

    contents: list[C]
    tokens: int = 0
    gpu_tokens: int = 0
    host_tokens: int = 0
    read_tokens: int = 0
    host_bytes: int = 0
    read_bytes: int = 0
    read_failed: bool = False


@dataclass
class CoreCounters:
    requests: int = 0
    reads: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    read_failures: int = 0
    reads_declined: int = 0
    gpu_hit_tokens: int = 0
    host_hit_tokens: int = 0
    computed_tokens: int = 0
    holdings_expired: int = 0


class EngineCore(Generic[K, C]):
    """`reader`: its READs; `on_stored(indices, sequence)` / `on_removed(keys, medium)` /
    `on_cleared()`: its KV events (`sequence` is what `keep` was given); `link`: its NIC (default:
    one of its own, the profile's); `params_clock`: the clock its params' expiry times are on
    (vLLM's perf_counter over HTTP; default the event loop's); `holding_prefix`: what its holdings'
    names (vLLM's request ids) start with (default: random, so that a restarted engine never
    answers a reader's stale name with other blocks); `stepped`: how a profile-timed engine paces
    its steps (the fleet's plans a decode stretch at once)."""

    def __init__(
        self,
        config: CoreConfig,
        reader: KvReader[K, C],
        *,
        on_stored: Callable[[list[int], Any], None] | None = None,
        on_removed: Callable[[list[K], str], None] | None = None,
        on_cleared: Callable[[], None] | None = None,
        link: Link | None = None,
        params_clock: Callable[[], float] | None = None,
        holding_prefix: str | None = None,
        stepped: type[SteppedTiming] = SteppedTiming,
    ) -> None:
        self.config = config
        self._reader = reader
        removed = on_removed or (lambda keys, medium: None)
        self.pool: BlockPool[K, C] = BlockPool(
            config.num_blocks,
            config.block_size,
            prefix_caching=config.prefix_caching,
            on_stored=on_stored or (lambda indices, sequence: None),
            on_removed=lambda keys: removed(keys, "GPU"),
            on_cleared=on_cleared or (lambda: None),
        )
        self.host: HostTier[K, C] = HostTier(config.host_blocks, on_removed=lambda keys: removed(keys, "CPU"))
        scale, profile = config.time_scale, config.profile
        self.timing: Timing
        self.link: Link | None = None
        if profile is None:
            decode_ms = config.decode_ms_per_token if config.role == "decode" else 0.0
            self.timing = FixedTiming(config.prefill_us_per_token, decode_ms, scale)
        else:
            self.timing = stepped(profile, self.pool, time_scale=scale)
            self.link = link or Link(profile.link, time_scale=scale)
        self.pcie = Link(config.pcie, time_scale=scale) if config.pcie is not None else None
        self.block_bytes = config.block_size * (profile.kv_bytes_per_token if profile else 0)
        self.counters = CoreCounters()
        self._params_clock = params_clock
        self._ids = itertools.count(1)
        self._holding_prefix = holding_prefix or f"cmpl-{uuid.uuid4().hex}"
        self._expiry: asyncio.TimerHandle | None = None

    # -- what others see ---------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self.timing.waiting

    def take(self, holding: str, block_ids: Sequence[int], *, notify: bool = True) -> list[C] | None:
        """A remote reader's READ of a holding (see BlockPool.take): freed blocks may admit a
        waiting request."""
        got = self.pool.take(holding, block_ids, notify=notify)
        self.timing.kick()
        return got

    def take_leading(self, holding: str, upto_blocks: int) -> list[C] | None:
        got = self.pool.take_leading(holding, upto_blocks)
        self.timing.kick()
        return got

    def start(self) -> None:
        self.timing.start()

    async def stop(self) -> None:
        await self.timing.stop()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    # -- a request ---------------------------------------------------------------------------

    async def find(self, keys: Sequence[K], prompt_tokens: int, params: Mapping[str, Any]) -> Found[C]:
        """The prompt's KV found here or read (see the module's 1.); `keys` are its full blocks'."""
        cfg, bs = self.config, self.config.block_size
        self.counters.requests += 1
        contents = self.pool.hits(keys)
        found = Found(contents, gpu_tokens=len(contents) * bs)
        if cfg.host_blocks:
            host = self.host.hits(keys, len(contents))
            if host:
                contents += host
                found.host_tokens = len(host) * bs
                found.host_bytes = len(host) * self.block_bytes
                if self.pcie is not None:
                    await self.pcie.transfer(found.host_bytes)
        found.tokens = len(contents) * bs
        if params.get("p2p_source_engine"):
            await self._read_host(keys, prompt_tokens, params, found)
        else:
            await self._read(prompt_tokens, params, found)
        self.counters.gpu_hit_tokens += found.gpu_tokens
        self.counters.host_hit_tokens += found.host_tokens
        return found

    async def _read(self, prompt_tokens: int, params: Mapping[str, Any], found: Found[C]) -> None:
        cfg, bs = self.config, self.config.block_size
        if not (params.get("remote_request_id") and (params.get("remote_block_ids") or [[]])[0]):
            return
        # vLLM's pull scheduler: a decode reads all its prefill computed; a prefill reads a
        # decode's blocks (bidirectional) only when fully addressed and above the threshold.
        if params.get("do_remote_prefill"):
            threshold = 1
        elif params.get("do_remote_decode") and all(p in params for p in _ADDRESSED):
            threshold = cfg.kv_recompute_threshold
        else:
            return
        n = min(int(params.get("remote_num_tokens") or 0), prompt_tokens)
        if not cfg.partial_block_reads:
            n = n // bs * bs
        have = len(found.contents)
        if n - found.tokens < threshold:
            self.counters.reads_declined += 1
            await self._reader.read(params, 0, 0)  # vLLM notifies the holder on every outcome
            return
        got = await self._reader.read(params, have, -(-n // bs))
        if got is None:
            self.counters.read_failures += 1
            found.read_failed = True
            if cfg.kv_load_failure_policy == "fail":
                raise KvLoadFailed("KV load failed")
            return
        found.contents += got
        found.read_tokens = n - found.tokens
        found.tokens = n
        await self._transfer(len(got), found)

    async def _read_host(
        self, keys: Sequence[K], prompt_tokens: int, params: Mapping[str, Any], found: Found[C]
    ) -> None:
        cfg, bs = self.config, self.config.block_size
        upto = min(int(params.get("p2p_source_tokens") or 0), prompt_tokens) // bs
        have = len(found.contents)
        if upto - have <= 0:
            return
        extra = (await self._reader.read_host(params, keys[:upto]))[have:]
        if len(extra) * bs < cfg.kv_recompute_threshold:
            return
        found.contents += extra
        found.read_tokens = len(extra) * bs
        found.tokens += found.read_tokens
        await self._transfer(len(extra), found)

    async def _transfer(self, blocks: int, found: Found[C]) -> None:
        """A READ's time: the link's for the blocks' bytes (profile-timed), else flat per block."""
        if blocks <= 0:
            return
        cfg = self.config
        nbytes = blocks * self.block_bytes
        found.read_bytes += nbytes
        self.counters.reads += 1
        self.counters.read_blocks += blocks
        self.counters.read_bytes += nbytes
        if self.link is None:
            await asyncio.sleep(blocks * cfg.read_us_per_block / 1e6 * cfg.time_scale)
        else:
            await self.link.transfer(nbytes)

    def submit(self, prompt_tokens: int, found_tokens: int, output: int) -> Run:
        """The request's pace (see the module's 2.). Raises CacheFull when it could never fit."""
        computed_from = min(found_tokens, prompt_tokens - 1)
        self.counters.computed_tokens += prompt_tokens - computed_from
        return self.timing.submit(prompt_tokens, computed_from, output)

    def keep(
        self,
        keys: Sequence[K],
        contents: Sequence[C],
        prompt_tokens: int,
        total_tokens: int,
        params: Mapping[str, Any],
        sequence: Any = None,
        **extra: Any,
    ) -> dict[str, Any] | None:
        """Place the finished request's sequence of `total_tokens` (`prompt_tokens` of prompt,
        then what decode computed: prompt + output - 1), `contents` per block and `keys` per full
        block, and hold it where vLLM's NixlConnector would (request_finished: by the params,
        not the engine's role): with `do_remote_decode` for the reader's lease, answering
        `do_remote_prefill` params; with other params and `retain_decode`, for `kv_blocks_ttl`,
        answering `do_remote_decode` params; else freed (cached). None: nothing held. `extra`
        goes into the params."""
        ids = self.place(keys, contents, prompt_tokens, total_tokens, sequence)
        return self.finish(ids, total_tokens, params, **extra)

    def place(
        self,
        keys: Sequence[K],
        contents: Sequence[C],
        prompt_tokens: int,
        total_tokens: int,
        sequence: Any = None,
    ) -> list[int]:
        """`keep`'s first half, once the prompt is computed: the sequence's blocks placed and
        pinned while the request decodes into them (vLLM's running request holds its blocks; a
        prefix-cache eviction cannot take them). `finish` them when it ends, or `unpin` them."""
        bs = self.config.block_size
        return self.pool.place(keys, contents[: -(-max(total_tokens, prompt_tokens) // bs)], sequence)

    def unpin(self, ids: list[int]) -> None:
        """A placed request that ended without finishing (aborted): its blocks freed (cached)."""
        self.pool.release(ids)
        self.timing.kick()

    def finish(
        self, ids: list[int], total_tokens: int, params: Mapping[str, Any], **extra: Any
    ) -> dict[str, Any] | None:
        """`keep`'s second half, when the request ends (vLLM's request_finished)."""
        if params and params.get("do_remote_decode"):
            return self._hold(ids, total_tokens, self.config.kv_lease_s, prefill=True, **extra)
        if params and self.config.retain_decode:
            return self._hold(ids, total_tokens, self.config.kv_blocks_ttl, prefill=False, **extra)
        self.pool.release(ids)
        self.timing.kick()  # freed blocks may admit a waiting request
        return None

    def offload(self, keys: Sequence[K], contents: Sequence[C]) -> list[K]:
        """The OffloadingConnector stores a finished request's full blocks; the keys new there."""
        if not self.config.host_blocks:
            return []
        return self.host.store(keys, contents[: len(keys)])

    # -- holdings ----------------------------------------------------------------------------

    def _hold(
        self, ids: list[int], tokens: int, ttl: float, *, prefill: bool, **extra: Any
    ) -> dict[str, Any]:
        cfg, loop = self.config, asyncio.get_running_loop()
        holding = f"{self._holding_prefix}-{next(self._ids)}"
        self.pool.hold(holding, ids, loop.time() + ttl * cfg.time_scale)
        self._arm_expiry()
        clock = self._params_clock or loop.time
        return {
            "do_remote_prefill": prefill,
            "do_remote_decode": not prefill,
            "remote_block_ids": [ids],
            "remote_engine_id": cfg.engine_id,
            "remote_request_id": holding,
            "remote_host": cfg.host,
            "remote_port": cfg.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": None if prefill else clock() + ttl * cfg.time_scale,
            "transfer_mode": "pull",
            **extra,
        }

    def _arm_expiry(self) -> None:
        at = self.pool.next_expiry()
        if at is None:
            return
        if self._expiry is not None:
            if self._expiry.when() <= at:
                return
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_at(at, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        expired = self.pool.expire(asyncio.get_running_loop().time())
        if expired:
            self.counters.holdings_expired += expired
            self.timing.kick()
        self._arm_expiry()
