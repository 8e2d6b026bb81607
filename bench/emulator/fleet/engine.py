"""A simulated vLLM 0.32 engine with the NixlConnector and the OffloadingConnector: the emulator's
engine core (bench/emulator/core/engine.py: its rules for finding, reading, holding and
offloading KV, the step scheduler's timing, links with contention) on the fleet simulator's
virtual clock, with the simulator's content model and transport.

Content model: a block's key is kvshuttle's chain hash of its tokens (kvshuttle.core.hashing, at
the engine's block size) and its content the key of the KV it holds; computing a block gives it
its own key. The answer's tokens are drawn from the prompt's seed when every block attended to
holds its own key, from another seed otherwise (`wrong`), so wrong KV shows as a wrong answer, as
the HTTP stand-in's does. A READ's trailing partial block is not counted (blocks are verified
whole here).

Transport: a READ takes blocks straight from the holder `remote_engine_id` names (an engine, or
a kvshuttle agent's pool: `KvSource`), timed over the reading engine's NIC; llm-d's P2P reads
(`p2p_source_engine`) take them from that engine's host tier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from deploy.profiles.schema import EngineProfile

from bench.emulator.core.engine import CoreConfig, CoreCounters, EngineCore
from bench.emulator.core.link import Link
from bench.emulator.core.timing import SteppedTiming
from bench.emulator.fleet.stepping import JumpingTiming
from kvshuttle.core.hashing import ROOT_HASH, chain_array
from kvshuttle.router.cost import LinkModel

__all__ = ["Completion", "EngineConfig", "KvSource", "Prompt", "SimEngine", "answer_tokens"]

Keys = npt.NDArray[np.uint64]

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
    prefix_caching: bool = True
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


# Engines by name, to resolve `remote_engine_id` (the fleet's registry of engines and pools).
Peers = Callable[[str], "KvSource | None"]


class KvSource:
    """Something a READ can take blocks from: an engine's holdings, or a pool's parked copies."""

    name: str
    nic: Link

    def take(self, holding: str, upto_blocks: int) -> list[int] | None:
        raise NotImplementedError

    def host_hits(self, keys: Sequence[int]) -> list[int]:
        return []


class _Reader:
    """The core's KvReader in the simulator: straight to the holder."""

    def __init__(self, peers: Peers) -> None:
        self._peers = peers

    async def read(self, params: Mapping[str, Any], skip_blocks: int, upto_blocks: int) -> list[int] | None:
        source = self._peers(str(params.get("remote_engine_id")))
        taken = source.take(str(params["remote_request_id"]), upto_blocks) if source is not None else None
        return None if taken is None else taken[skip_blocks:]

    async def read_host(self, params: Mapping[str, Any], keys: Sequence[int]) -> list[int]:
        source = self._peers(str(params["p2p_source_engine"]))
        return [] if source is None else source.host_hits(keys)


class SimEngine(KvSource):
    def __init__(
        self, config: EngineConfig, peers: Peers, *, on_event: Callable[..., None] | None = None
    ) -> None:
        """`on_event(engine, kind, keys, first, medium, tokens)`: its KV events (`stored` /
        `removed`; a GPU store carries `(tokens, parent key)`, as vLLM's BlockStored carries the
        tokens), what KV-event subscribers (the registry's agent, llm-d's indexer) get."""
        self.config = config
        self.name = config.name
        emit = on_event or (lambda *a: None)
        self._emit = emit
        self.nic = Link(config.profile.link)
        self.core: EngineCore[int, int] = EngineCore(
            CoreConfig(
                engine_id=config.name,
                role="prefill" if config.role == "prefill" else "decode",
                block_size=config.block_size,
                num_blocks=config.num_blocks,
                profile=config.profile,
                host_blocks=config.host_blocks,
                prefix_caching=config.prefix_caching,
                pcie=config.pcie,
                retain_decode=config.retain_decode,
                kv_blocks_ttl=config.kv_blocks_ttl,
                kv_lease_s=config.kv_lease_s,
                kv_recompute_threshold=config.kv_recompute_threshold,
                partial_block_reads=False,
                host=config.name,
                side_channel_port=config.side_channel_port,
            ),
            _Reader(peers),
            on_stored=self._stored,
            on_removed=lambda keys, medium: emit(self, "removed", keys, 0, medium, None),
            link=self.nic,
            holding_prefix=config.name,
            # One wakeup per decode stretch, not per step.
            stepped=JumpingTiming,
        )
        self.pool = self.core.pool
        self.host = self.core.host
        assert isinstance(self.core.timing, SteppedTiming)  # a profile is required here
        self.timing: SteppedTiming = self.core.timing
        self.pcie = self.core.pcie
        self.counters: CoreCounters = self.core.counters
        self.running = 0  # requests in the engine (vLLM's running + waiting)
        self.block_bytes = self.core.block_bytes

    def _stored(self, indices: list[int], sequence: tuple[Sequence[int], Any]) -> None:
        keys, tokens = sequence
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first = run[0]
            parent = keys[first - 1] if first else None
            self._emit(self, "stored", [keys[i] for i in run], first, "GPU", (tokens, parent))

    # -- what others see ---------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self.core.waiting

    def kv_usage(self) -> float:
        """vLLM's kv_cache_usage_perc: blocks referenced (running requests' and held ones), the
        prefix cache's idle ones not. A running request's blocks are its admission reservation
        until it ends (the core places them then)."""
        return (self.pool.used_blocks() + self.pool.reserved) / self.pool.num_blocks

    def take(self, holding: str, upto_blocks: int) -> list[int] | None:
        return self.core.take_leading(holding, upto_blocks)

    def host_hits(self, keys: Sequence[int]) -> list[int]:
        return self.host.hits(keys)

    def start(self) -> None:
        self.core.start()

    async def stop(self) -> None:
        await self.core.stop()

    # -- a request ---------------------------------------------------------------------------

    async def complete(self, prompt: Prompt, output: int, params: dict[str, Any] | None = None) -> Completion:
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        self.running += 1
        try:
            return await self._complete(prompt, output, params or {}, arrived)
        finally:
            self.running -= 1

    async def _complete(
        self, prompt: Prompt, output: int, params: dict[str, Any], arrived: float
    ) -> Completion:
        core, bs = self.core, self.config.block_size
        key_list = prompt.key_list
        found = await core.find(key_list, len(prompt), params)
        done = Completion(
            np.zeros(0, np.uint32),
            [],
            None,
            False,
            found.gpu_tokens,
            found.host_tokens,
            found.read_tokens,
            0,
            arrived,
            read_bytes=found.read_bytes,
            host_bytes=found.host_bytes,
            read_failed=found.read_failed,
        )
        run = core.submit(len(prompt), found.tokens, output)
        done.admitted_after_s = asyncio.get_running_loop().time() - arrived
        placed: list[int] | None = None
        try:
            await run.prefilled()
            done.computed_tokens = len(prompt) - min(found.tokens, len(prompt) - 1)
            contents = found.contents[: found.tokens // bs] + key_list[found.tokens // bs :]
            wrong = contents != key_list
            answer = answer_tokens(prompt.seed ^ _WRONG_MASK if wrong else prompt.seed, output)
            done.output, done.wrong = answer, wrong
            seq_keys, seq_contents, tokens = self._sequence(prompt, contents, answer, wrong)
            total = len(prompt) + output - 1
            partial = -(-max(total, len(prompt)) // bs) - len(seq_keys)
            # The blocks stay pinned while the answer decodes into them, and are held or freed
            # when it ends: a running request's KV is memory a decode engine cannot give away.
            placed = core.place(
                seq_keys, seq_contents + [-1] * partial, len(prompt), total, (seq_keys, tokens)
            )
            run.placed()
            await run.finished()
            done.params, placed = core.finish(placed, total, params), None
            done.token_times = list(run.request.token_times)  # type: ignore[attr-defined]
        finally:
            if placed is not None:
                core.unpin(placed)
            run.close()
        new = core.offload(seq_keys, seq_contents)
        if new:
            self._emit(self, "stored", new, -1, "CPU", None)
        return done

    def _sequence(
        self, prompt: Prompt, contents: list[int], answer: Tokens, wrong: bool
    ) -> tuple[list[int], list[int], Tokens]:
        """The keys, contents and tokens of the sequence once decoded: the prompt's full blocks,
        then those the answer fills (prompt + output - 1 tokens have KV), their KV as right or
        wrong as what it attended to."""
        bs, keys = self.config.block_size, prompt.key_list
        total = len(prompt) + len(answer) - 1
        tokens = np.concatenate([prompt.tokens, answer[:-1]]) if len(answer) > 1 else prompt.tokens
        if total // bs <= len(keys):
            return keys, contents, tokens
        tail = np.concatenate([prompt.tokens[len(keys) * bs :], answer[:-1]])
        more = chain_array(tail, bs, keys[-1] if keys else ROOT_HASH).tolist()
        return keys + more, contents + ([k ^ _WRONG_MASK for k in more] if wrong else more), tokens
