"""A simulated vLLM 0.32 engine with the NixlConnector and the OffloadingConnector: the stand-in's
model (deploy/standin/engine.py) without a transport, on the fleet simulator's virtual clock.

What decides time is the stand-in's own code: the step scheduler (deploy/standin/scheduler.py,
chunked prefill under the token budget, batched decode, admission by free blocks) driven by
`SteppedTiming` (deploy/standin/timing.py), and KV reads over a processor-sharing `Link`
(deploy/standin/link.py) from the profile. The KV memory is bench/fleet/kv.py's.

A request (`complete`) is vLLM's `/v1/completions` as kvshuttle and the peers use it, with
`kv_transfer_params` as vLLM's:

* none: a plain request; the prompt's leading blocks found in the prefix cache (then the host
  tier, loaded back over PCIe) are not computed.
* `do_remote_decode` (turn 1's params, to prefill): as above, plus blocks named by
  `remote_engine_id` / `remote_request_id` / `remote_num_tokens` are READ from that engine's
  holding (a decode's retained KV, a pool's parked copy) when they cover at least
  `kv_recompute_threshold` tokens more than the cache (vLLM's rule); prefill's prompt blocks are
  then held `kv_lease_s` for decode and the answer's params name them.
* `do_remote_prefill` (prefill's answer, to decode): decode READs what it does not have cached
  and decodes. With `retain_decode` (vLLM's `bidirectional_kv_xfer`), decode then holds prompt +
  output - 1 tokens for `decoder_kv_blocks_ttl` s and answers `do_remote_decode` params naming
  them (the next turn's prefill reads them once).
* `p2p_source_engine` / `p2p_source_tokens` (llm-d's P2P KV sharing): the leading blocks are read
  from that engine's host tier (not freed there) over the link.

A failed READ recomputes (`kv_load_failure_policy: recompute`, vLLM's default). The answer's
tokens are a function of the KV content used (bench/fleet/kv.py): `wrong` when it differs from a
clean recompute's.

OffloadingConnector (host tier, when configured): every full block a request computes or reads
is stored to host memory as the request finishes (`offload_prompt_only: false`: the answer's
blocks too), LRU by bytes; a request's blocks found there beyond the GPU cache are loaded back
over the engine's PCIe link before it is scheduled.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from deploy.profiles.schema import EngineProfile
from deploy.standin.link import Link
from deploy.standin.timing import SteppedTiming

from bench.fleet.kv import BlockPool, HostTier, Keys
from kvshuttle.core.hashing import ROOT_HASH, chain_array
from kvshuttle.router.cost import LinkModel

__all__ = ["Completion", "EngineConfig", "Prompt", "SimEngine", "answer_tokens"]

Tokens = npt.NDArray[np.uint32]
_WRONG_MASK: Final = 0x5DEECE66D
_VOCAB: Final = 151_000  # Qwen3's: what simulated answers draw from (ids below 1,000 left out)


def answer_tokens(seed: int, n: int) -> Tokens:
    """`n` answer tokens, a function of `seed` alone."""
    return np.random.Generator(np.random.PCG64(seed & (2**63 - 1))).integers(
        1_000, _VOCAB, n, dtype=np.uint32
    )


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt: its tokens and the chain keys of its full blocks (engine block size);
    `seed`: what a clean recompute's answer is drawn from."""

    tokens: Tokens
    keys: Keys
    seed: int
    key_list: list[int]  # `keys` as ints (the pool's dict keys), kept by the caller

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    name: str
    role: str  # "prefill" | "decode" (a decode node may prefill locally: both work anywhere)
    profile: EngineProfile
    block_size: int
    num_blocks: int
    host_blocks: int = 0  # the OffloadingConnector's CPU tier (0: none)
    pcie: LinkModel | None = None  # host <-> GPU, for host-tier loads
    retain_decode: bool = False  # vLLM's bidirectional_kv_xfer on decode
    kv_blocks_ttl: float = 480.0  # decoder_kv_blocks_ttl
    kv_lease_s: float = 30.0  # how long prefill holds blocks for its decode
    kv_recompute_threshold: int = 64
    side_channel_port: int = 5600  # what its params name (remote_host is its name)


@dataclass(slots=True)
class Completion:
    output: Tokens
    token_times: list[float]
    params: dict[str, Any] | None
    wrong: bool
    cached_tokens: int  # found in this engine's GPU prefix cache
    host_tokens: int  # loaded back from its host tier
    read_tokens: int  # read from another engine (or a pool, or a peer's host tier)
    computed_tokens: int
    arrived: float
    admitted_after_s: float = 0.0  # KV loads/reads before the scheduler got it
    read_bytes: int = 0
    host_bytes: int = 0
    read_failed: bool = False


@dataclass
class EngineCounters:
    requests: int = 0
    reads: int = 0
    read_failures: int = 0
    reads_declined: int = 0
    read_bytes: int = 0
    host_hit_tokens: int = 0
    gpu_hit_tokens: int = 0
    computed_tokens: int = 0


# Engines by name, to resolve `remote_engine_id` (the fleet's registry of engines and pools).
Peers = Callable[[str], "KvSource | None"]


class KvSource:
    """Something a READ can take blocks from: an engine's holdings, or a pool's parked copies."""

    name: str
    nic: Link

    def take(self, holding: str, upto_blocks: int) -> list[int] | None:
        raise NotImplementedError

    def host_hits(self, keys: list[int]) -> list[int]:
        return []


class SimEngine(KvSource):
    def __init__(
        self, config: EngineConfig, peers: Peers, *, on_event: Callable[..., None] | None = None
    ) -> None:
        """`on_event(engine, kind, keys, first, medium, tokens)`: its KV events (`stored` /
        `removed`; a GPU store carries the sequence's tokens, as vLLM's BlockStored does), what
        KV-event subscribers (the registry's agent, llm-d's indexer) get."""
        self.config = config
        self.name = config.name
        self._peers = peers
        emit = on_event or (lambda *a: None)
        self.pool = BlockPool(
            config.num_blocks,
            config.block_size,
            on_stored=lambda keys, first, tokens: emit(self, "stored", keys, first, "GPU", tokens),
            on_removed=lambda keys: emit(self, "removed", keys, 0, "GPU", None),
        )
        self.host = HostTier(
            config.host_blocks, on_removed=lambda keys: emit(self, "removed", keys, 0, "CPU", None)
        )
        self._emit = emit
        self.timing = SteppedTiming(config.profile, self.pool)  # type: ignore[arg-type]
        self.nic = Link(config.profile.link)
        self.pcie = Link(config.pcie) if config.pcie is not None else None
        self.counters = EngineCounters()
        self.running = 0  # requests in the engine (vLLM's running + waiting)
        self._ids = itertools.count(1)
        self._expiry: asyncio.TimerHandle | None = None
        self.block_bytes = config.block_size * config.profile.kv_bytes_per_token

    # -- what others see ---------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self.timing.waiting

    def kv_usage(self) -> float:
        return self.pool.used_blocks() / self.pool.num_blocks

    def take(self, holding: str, upto_blocks: int) -> list[int] | None:
        got = self.pool.take(holding, upto_blocks)
        self.timing.kick()
        return got

    def host_hits(self, keys: list[int]) -> list[int]:
        return self.host.hits(keys)

    def start(self) -> None:
        self.timing.start()

    async def stop(self) -> None:
        await self.timing.stop()
        if self._expiry is not None:
            self._expiry.cancel()

    # -- a request ---------------------------------------------------------------------------

    async def complete(self, prompt: Prompt, output: int, params: dict[str, Any] | None = None) -> Completion:
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        self.running += 1
        self.counters.requests += 1
        try:
            return await self._complete(prompt, output, params or {}, arrived)
        finally:
            self.running -= 1

    async def _complete(
        self, prompt: Prompt, output: int, params: dict[str, Any], arrived: float
    ) -> Completion:
        cfg, bs = self.config, self.config.block_size
        key_list = prompt.key_list
        contents = self.pool.hits(key_list)
        gpu = len(contents)
        host = self.host.hits(key_list, gpu) if self.config.host_blocks else []
        contents += host
        done = Completion(np.zeros(0, np.uint32), [], None, False, gpu * bs, len(host) * bs, 0, 0, arrived)
        if host and self.pcie is not None:
            done.host_bytes = len(host) * self.block_bytes
            await self.pcie.transfer(done.host_bytes)
        await self._read(prompt, params, contents, done)
        found = min(len(contents) * bs, len(prompt) - 1) if contents else 0
        decode_reader = bool(params.get("do_remote_prefill"))
        run = self.timing.submit(len(prompt), found, output)
        done.admitted_after_s = asyncio.get_running_loop().time() - arrived
        try:
            await run.prefilled()
            done.computed_tokens = len(prompt) - found
            self.counters.computed_tokens += done.computed_tokens
            self.counters.gpu_hit_tokens += done.cached_tokens
            self.counters.host_hit_tokens += done.host_tokens
            contents += key_list[len(contents) :]  # the rest computed: its own KV
            wrong = contents != key_list
            seed = prompt.seed ^ _WRONG_MASK if wrong else prompt.seed
            answer = answer_tokens(seed, output)
            done.output, done.wrong = answer, wrong
            seq_keys, seq_contents = self._sequence(prompt, contents, answer, wrong)
            done.params = self._place(prompt, seq_keys, seq_contents, answer, params, decode_reader)
            run.placed()
            await run.finished()
            done.token_times = list(run.request.token_times)  # type: ignore[attr-defined]
        finally:
            run.close()
        if cfg.host_blocks:
            self._offload(seq_keys, seq_contents)
        return done

    async def _read(
        self, prompt: Prompt, params: dict[str, Any], contents: list[int], done: Completion
    ) -> None:
        """READs the params ask for, appended to `contents` (the KV found so far)."""
        cfg, bs = self.config, self.config.block_size
        p2p = params.get("p2p_source_engine")
        if p2p:
            source = self._peers(str(p2p))
            upto = min(int(params.get("p2p_source_tokens") or 0), len(prompt)) // bs
            if source is not None and upto - len(contents) > 0:
                got = source.host_hits(prompt.key_list[:upto])
                extra = got[len(contents) :]
                if len(extra) * bs >= cfg.kv_recompute_threshold:
                    contents += extra
                    await self._transfer(source, len(extra), done)
            return
        holding = params.get("remote_request_id")
        engine_id = params.get("remote_engine_id")
        if not holding or not engine_id or not (params.get("remote_block_ids") or [[]])[0]:
            return
        source = self._peers(str(engine_id))
        n = min(int(params.get("remote_num_tokens") or 0), len(prompt))
        threshold = cfg.kv_recompute_threshold if not params.get("do_remote_prefill") else 1
        upto = -(-n // bs)
        worth = n - len(contents) * bs >= threshold
        taken = source.take(str(holding), upto) if source is not None else None
        if not worth:
            self.counters.reads_declined += 1  # vLLM still notifies the holder: freed there
            return
        if source is None or taken is None:
            self.counters.read_failures += 1
            done.read_failed = True
            return
        full = min(len(taken), n // bs, len(prompt.keys))
        extra = taken[len(contents) : full]
        contents += extra
        await self._transfer(source, len(extra), done)

    async def _transfer(self, source: KvSource, blocks: int, done: Completion) -> None:
        if blocks <= 0:
            return
        nbytes = blocks * self.block_bytes
        done.read_tokens += blocks * self.config.block_size
        done.read_bytes += nbytes
        self.counters.reads += 1
        self.counters.read_bytes += nbytes
        await self.nic.transfer(nbytes)

    def _sequence(
        self, prompt: Prompt, contents: list[int], answer: Tokens, wrong: bool
    ) -> tuple[list[int], list[int]]:
        """The keys and contents of the sequence's full blocks once decoded: the prompt's, then
        those the answer fills (prompt + output - 1 tokens have KV), their KV as right or wrong
        as what it attended to."""
        bs, keys = self.config.block_size, prompt.key_list
        total = len(prompt) + len(answer) - 1
        if total // bs <= len(keys):
            return keys, contents
        tail = np.concatenate([prompt.tokens[len(keys) * bs :], answer[:-1]])
        more = chain_array(tail, bs, keys[-1] if keys else ROOT_HASH).tolist()
        return keys + more, contents + ([k ^ _WRONG_MASK for k in more] if wrong else more)

    def _place(
        self,
        prompt: Prompt,
        seq_keys: list[int],
        seq_contents: list[int],
        answer: Tokens,
        params: dict[str, Any],
        decode_reader: bool,
    ) -> dict[str, Any] | None:
        """Cache the request's blocks; hold them for a remote reader where vLLM would, and answer
        the params that name them (None: nothing held)."""
        cfg, bs = self.config, self.config.block_size
        prompt_blocks = -(-len(prompt) // bs)
        loop = asyncio.get_running_loop()
        if params.get("do_remote_decode") and cfg.role == "prefill":
            n = len(prompt.keys)
            ids = self.pool.place(seq_keys[:n], seq_contents[:n], prompt_blocks, prompt_blocks, prompt.tokens)
            return self._hold(ids, len(prompt), loop.time() + cfg.kv_lease_s, prefill=True)
        output = len(answer)
        total = len(prompt) + output - 1
        tokens = np.concatenate([prompt.tokens, answer[:-1]]) if output > 1 else prompt.tokens
        ids = self.pool.place(
            seq_keys, seq_contents, max(-(-total // bs), prompt_blocks), prompt_blocks, tokens
        )
        if decode_reader and cfg.retain_decode:
            return self._hold(ids, total, loop.time() + cfg.kv_blocks_ttl, prefill=False)
        self.pool.release(ids)
        return None

    def _hold(self, ids: list[int], tokens: int, expires_at: float, *, prefill: bool) -> dict[str, Any]:
        holding = f"{self.name}-{next(self._ids)}"
        self.pool.hold(holding, ids, expires_at)
        self._arm_expiry()
        return {
            "do_remote_prefill": prefill,
            "do_remote_decode": not prefill,
            "remote_block_ids": [ids],
            "remote_engine_id": self.name,
            "remote_request_id": holding,
            "remote_host": self.name,
            "remote_port": self.config.side_channel_port,
            "remote_num_tokens": tokens,
            "tp_size": 1,
        }

    def _arm_expiry(self) -> None:
        if self._expiry is not None:
            return
        at = self.pool.next_expiry()
        if at is None:
            return
        loop = asyncio.get_running_loop()
        self._expiry = loop.call_at(at, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        if self.pool.expire(asyncio.get_running_loop().time()):
            self.timing.kick()
        self._arm_expiry()

    def _offload(self, keys: list[int], contents: list[int]) -> None:
        """The OffloadingConnector stores the request's full blocks to host memory."""
        new = self.host.store(keys, contents)
        if new:
            self._emit(self, "stored", new, -1, "CPU", None)
