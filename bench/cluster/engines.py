"""The emulated cluster one policy runs on (bench/emulator/http/cluster.py: profile-timed engines in
this process's event loop), seen as what the policies and the kvshuttle stack need: each engine's
endpoints (deploy/local/engine_pair.py's `Engine`), its in-flight count, and the cluster's
counters (modelled GPU time, KV bytes moved).

Everything the engines model runs `time_scale` times faster than the profile's hardware; the
benchmark reports in the profile's time (real seconds / time_scale).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from deploy.profiles.schema import EngineProfile

from bench.emulator.core.timing import SteppedTiming
from bench.emulator.http.cluster import StandinCluster
from bench.emulator.http.engine import StandinEngine

Role = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class _Spec:
    role: Role


class Node:
    """One emulated engine: its endpoints as `Engine` (the stack's agents run beside it) and the
    requests a client-side policy has in flight on it (its load signal)."""

    def __init__(self, name: str, engine: StandinEngine) -> None:
        self.name, self.engine = name, engine
        self.spec = _Spec(engine.config.role)
        self.in_flight = 0
        self.sent = 0

    @property
    def role(self) -> Role:
        return self.engine.config.role

    @property
    def engine_id(self) -> str:
        return self.engine.config.engine_id

    @property
    def url(self) -> str:
        return self.engine.url

    @property
    def events_endpoint(self) -> str:
        return self.engine.events_endpoint

    @property
    def replay_endpoint(self) -> str:
        return self.engine.replay_endpoint

    @property
    def side_channel(self) -> tuple[str, int]:
        return self.engine.config.host, self.engine.side_channel_port


class EmulatedCluster:
    """`prefill` + `decode` profile-timed engines (started by `async with`), shaped as the
    stack's `EnginePair` (model_dir, engines) and with the counters a run reports."""

    def __init__(
        self,
        model_dir: Path,
        profile: EngineProfile,
        *,
        prefill: int,
        decode: int,
        time_scale: float,
        **overrides: Any,
    ) -> None:
        self.model_dir, self.profile, self.time_scale = model_dir, profile, time_scale
        self.standin = StandinCluster(
            model_dir, prefill=prefill, decode=decode, profile=profile, time_scale=time_scale, **overrides
        )
        self.nodes = tuple(Node(n, e) for n, e in zip(self.standin.names, self.standin.engines, strict=True))

    @property
    def engines(self) -> tuple[Node, ...]:
        return self.nodes

    def of_role(self, role: Role) -> list[Node]:
        return [node for node in self.nodes if node.role == role]

    @property
    def model(self) -> str:
        return self.standin.model

    @property
    def vocabulary(self) -> list[int]:
        return list(self.standin.engines[0].vocabulary)

    @property
    def gpus(self) -> int:
        return len(self.nodes) * self.profile.hardware.gpus_per_engine

    def counters(self) -> dict[str, float]:
        """Modelled GPU seconds (busy, prefilling, the prefill nodes busy; every GPU of an engine
        counted) and KV bytes read between engines, summed over the cluster, since it started."""
        gpus = self.profile.hardware.gpus_per_engine
        busy = prefill = prefill_nodes_busy = moved = 0.0
        for engine in self.standin.engines:
            if isinstance(engine.timing, SteppedTiming):
                busy += engine.timing.busy_ms / 1e3 * gpus
                prefill += engine.timing.prefill_ms / 1e3 * gpus
                if engine.config.role == "prefill":
                    prefill_nodes_busy += engine.timing.busy_ms / 1e3 * gpus
            if engine.core.link is not None:
                moved += engine.core.link.bytes_moved
        return {"gpu_busy_s": busy, "prefill_gpu_s": prefill, "prefill_nodes_busy_gpu_s": prefill_nodes_busy,
                "bytes_moved": moved}  # fmt: skip

    def decode_kv_blocks(self) -> dict[str, int]:
        """The decode engines' KV pools now, summed: blocks in use (running requests' and those
        retained for a next turn's reader) and of them the retained ones."""
        pools = [node.engine.cache for node in self.of_role("decode")]
        return {
            "in_use": sum(p.used_blocks() for p in pools),
            "held": sum(p.held_blocks() for p in pools),
        }

    def router_profile(self) -> dict[str, Any]:
        """The profile's cost model (kvshuttle.router.cost) on the emulated clock."""
        return router_profile(self.profile, self.time_scale)

    async def __aenter__(self) -> EmulatedCluster:
        await self.standin.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.standin.stop()


class RoundRobin:
    """The next of `nodes`, in turn."""

    def __init__(self, nodes: list[Node]) -> None:
        self._cycle: Iterator[Node] = itertools.cycle(nodes)

    def __call__(self) -> Node:
        return next(self._cycle)


def least_loaded(nodes: list[Node]) -> Node:
    """The node with the fewest requests in flight (of equals, the one sent the fewest)."""
    return min(nodes, key=lambda node: (node.in_flight, node.sent))


__all__ = ["EmulatedCluster", "Node", "Role", "RoundRobin", "least_loaded", "router_profile"]


def router_profile(p: EngineProfile, time_scale: float, model: str = "") -> dict[str, Any]:
    """`p`'s cost model (kvshuttle.router.cost) on the emulated clock, for served model `model`
    (default the profile's): the router measures the engines in real seconds, which are the
    profile's times `time_scale`."""
    s = time_scale
    return {
        "model": model or p.model,
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "min_reuse_tokens": p.min_reuse_tokens,
        "prefill": {
            "fixed_ms": p.prefill.fixed_ms * s,
            "per_token_ms": p.prefill.per_token_ms * s,
            "per_cached_token_ms": p.prefill.per_cached_token_ms * s,
            "per_pair_ns": p.prefill.per_pair_ns * s,
        },
        "link": {"bandwidth_gb_s": p.link.bandwidth_gb_s / s, "fixed_ms": p.link.fixed_ms * s},
    }
