"""The simulated fleet: P and D engines (bench/emulator/fleet/engine.py) built from one profile, what each
policy may know of them, and with what delay.

Every policy sees what it would see deployed, with the same delays (`Visibility`):

* **KV events** (`CacheView`): each engine's stored and removed blocks by tier (GPU, CPU), as
  vLLM publishes them after each step, reaching a subscriber `kv_event_lag_s` later (ZMQ to an
  indexer: llm-d's kv-cache manager, Dynamo's router, kvshuttle's agent forwarding to the
  registry).
* **Load** (`LoadView`): each engine's running and waiting requests and KV usage, as scraped from
  `/metrics` (vLLM's gauges) every `load_poll_s` (llm-d's and Dynamo's metric refresh; kvshuttle's
  agent load poll and heartbeat, whose cadence its own model sets).
* **Its own in-flight requests**, exactly: every router knows what it has sent and not yet seen
  answered.

Nothing else is shared: no policy reads an engine's internals.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, cast

from deploy.profiles.schema import EngineProfile

from bench.emulator.fleet.engine import EngineConfig, KvSource, SimEngine
from bench.emulator.fleet.vtime import VirtualTimeLoop
from kvshuttle.router.cost import LinkModel

__all__ = ["CacheView", "Fleet", "FleetConfig", "LoadView", "Visibility"]

GIB: Final = 2**30


@dataclass(frozen=True, slots=True)
class Visibility:
    kv_event_lag_s: float = 0.05
    load_poll_s: float = 0.05


@dataclass(frozen=True, slots=True)
class FleetConfig:
    profile: EngineProfile
    prefill: int = 8
    decode: int = 8
    # The engines' --block-size: 64, as llm-d's P2P guides and Dynamo's toolagent run set it
    # (vLLM's default on H100/H200 is 16; the KV capacity in tokens is the profile's either way,
    # and a fourth of the blocks is a fourth of this process's work per request).
    block_size: int = 64
    # Host memory for each engine's OffloadingConnector tier (0: none). A 2 TiB 8-GPU node with
    # TP2 engines: four engines share it; 256 GiB each leaves room for the OS and the pools.
    host_gib_per_engine: float = 0.0
    # The roles whose engines run the OffloadingConnector tier (Dynamo's KVBM: prefill only).
    host_roles: tuple[str, ...] = ("prefill", "decode")
    # Host <-> GPU per engine (PCIe 5.0 x16 per GPU, ~50 GB/s usable, times the engine's GPUs).
    pcie_gb_s_per_gpu: float = 50.0
    pcie_fixed_ms: float = 0.05
    retain_decode: bool = False
    kv_blocks_ttl: float = 480.0
    # The roles whose engines run vLLM's prefix cache (the conformance pair turns it off on P).
    prefix_caching_roles: tuple[str, ...] = ("prefill", "decode")
    visibility: Visibility = field(default_factory=Visibility)

    @property
    def gpus(self) -> int:
        return (self.prefill + self.decode) * self.profile.hardware.gpus_per_engine


class CacheView:
    """One subscriber's picture of the engines' cached blocks from their KV events: per engine
    and tier (`GPU`, `CPU`), the set of keys stored and not removed."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[str, str], set[int]] = {}

    def apply(self, engine: str, kind: str, keys: Iterable[int], medium: str) -> None:
        held = self.blocks.setdefault((engine, medium), set())
        if kind == "stored":
            held.update(keys)
        else:
            held.difference_update(keys)

    def leading(self, engine: str, key_list: Sequence[int], media: tuple[str, ...] = ("GPU",)) -> int:
        """Leading blocks of `keys` this engine holds in any of `media`. A binary search: exact
        when what an engine holds is prefix-closed (a block is stored after its parent, and the
        LRU evicts a sequence's tail before its head, as a chain's blocks are touched in order);
        a linear walk would cost O(prompt blocks) per engine per request in this process."""
        sets = [held for m in media if (held := self.blocks.get((engine, m)))]
        if not sets:
            return 0
        held = sets[0] if len(sets) == 1 else None  # one medium: a set lookup per probe
        lo, hi = 0, len(key_list)  # blocks [0, lo) held; the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            k = key_list[mid - 1]
            if k in held if held is not None else any(k in s for s in sets):
                lo = mid
            else:
                hi = mid - 1
        return lo


class Load(NamedTuple):  # a tuple: 16 of them every 50 ms of a run
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


class LoadView:
    """The engines' gauges as last scraped."""

    def __init__(self) -> None:
        self.loads: dict[str, Load] = {}

    def of(self, engine: str) -> Load:
        return self.loads.get(engine, Load())


class Fleet:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        profile = config.profile
        bs = config.block_size
        num_blocks = profile.engine.kv_capacity_tokens // bs
        block_bytes = bs * profile.kv_bytes_per_token
        host_blocks = int(config.host_gib_per_engine * GIB // block_bytes)
        gpus = profile.hardware.gpus_per_engine
        pcie = LinkModel(bandwidth_gb_s=config.pcie_gb_s_per_gpu * gpus, fixed_ms=config.pcie_fixed_ms)
        self.sources: dict[str, KvSource] = {}
        self._subscribers: list[CacheView] = []
        self._load_views: list[LoadView] = []
        self.engines: list[SimEngine] = []
        for role, count in (("prefill", config.prefill), ("decode", config.decode)):
            for i in range(count):
                engine = SimEngine(
                    EngineConfig(
                        name=f"{role}-{i}",
                        role=role,
                        profile=profile,
                        block_size=bs,
                        num_blocks=num_blocks,
                        host_blocks=host_blocks if role in config.host_roles else 0,
                        prefix_caching=role in config.prefix_caching_roles,
                        pcie=pcie,
                        retain_decode=config.retain_decode and role == "decode",
                        kv_blocks_ttl=config.kv_blocks_ttl,
                        kv_recompute_threshold=profile.min_reuse_tokens,
                    ),
                    self.sources.get,
                    on_event=self._event,
                )
                self.engines.append(engine)
                self.sources[engine.name] = engine
        self.prefills = [e for e in self.engines if e.config.role == "prefill"]
        self.decodes = [e for e in self.engines if e.config.role == "decode"]
        self._poller: asyncio.Task[None] | None = None
        self._started = False
        # KV events due at one instant (`_due_at`), delivered by one timer (`_due_timer`) in the
        # order they happened, while no other timer was set in between (so nothing runs in
        # another order); an engine's removals one after another are one event. An eviction is
        # an event per block: a timer and a delivery each cost more than the request evicting.
        self._due: list[tuple[SimEngine, str, list[int], int, str, Any]] = []
        self._due_at = -1.0
        self._due_timer: asyncio.TimerHandle | None = None
        self.event_hooks: list[Callable[[SimEngine, str, list[int], int, str, Any], None]] = []

    # -- subscriptions -----------------------------------------------------------------------

    def subscribe(self) -> CacheView:
        """A KV-event subscriber's view (events reach it kv_event_lag_s after they happen)."""
        view = CacheView()
        self._subscribers.append(view)
        return view

    def load_view(self) -> LoadView:
        view = LoadView()
        self._load_views.append(view)
        self._scrape(view)
        if self._started and self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        return view

    def _event(
        self, engine: SimEngine, kind: str, keys: list[int], first: int, medium: str, tokens: Any
    ) -> None:
        if not self._subscribers and not self.event_hooks:
            return
        loop = cast(VirtualTimeLoop, asyncio.get_running_loop())
        at = loop.time() + self.config.visibility.kv_event_lag_s
        due = self._due
        if at != self._due_at or self._due_timer is None or not loop.is_last_timer(self._due_timer):
            due = self._due = []
            self._due_at, self._due_timer = at, loop.call_at(at, self._deliver, due)
        elif kind == "removed" and (last := due[-1])[0] is engine and last[1] == kind and last[4] == medium:
            last[2].extend(keys)  # removing a, then b, is removing [a, b]: for a view and the index
            return
        due.append((engine, kind, list(keys), first, medium, tokens))

    def _deliver(self, due: list[tuple[SimEngine, str, list[int], int, str, Any]]) -> None:
        for engine, kind, keys, first, medium, tokens in due:
            for view in self._subscribers:
                view.apply(engine.name, kind, keys, medium)
            for hook in self.event_hooks:
                hook(engine, kind, keys, first, medium, tokens)

    def _scrape(self, view: LoadView) -> None:
        view.loads = {e.name: Load(e.running - (w := e.waiting), w, e.kv_usage()) for e in self.engines}

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.config.visibility.load_poll_s)
            for view in self._load_views:
                self._scrape(view)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        for engine in self.engines:
            engine.start()
        self._started = True
        if self._load_views:  # the scrapes run only for a policy that reads them
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for engine in self.engines:
            await engine.stop()

    def add_source(self, source: KvSource) -> None:
        """A pool a READ may name (kvshuttle's agents' host pools)."""
        self.sources[source.name] = source
