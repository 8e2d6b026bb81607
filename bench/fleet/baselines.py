"""The plain policies, on the simulated fleet (bench/emulator/fleet/fleet.py): what bench/cluster/policies.py
compares, without a transport.

    recompute       plain P->D: P and D round robin; every prompt computed on P (its own prefix
                    cache aside), decode's KV never read back
    proxy           vLLM's example toy proxy (the seed's): P and D round robin, decode's answered
                    params kept per conversation (one single-use entry, 450 s TTL) and handed to
                    the next turn's prefill, which reads decode's KV with no check that the new
                    prompt extends it (wrong answers counted)
    prefix-aware    P scored by the prompt's leading blocks in its GPU cache (KV events) 2 : its
                    queue 1 (min-max normalised in-flight), D least loaded; no D->P
    affinity-local  a conversation sticks to the decode node of its first turn, which prefills
                    later turns itself (its prefix cache serves the history): no load or length
                    check; the first turn is P->D
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any, Final

from bench.emulator.fleet.engine import Completion, SimEngine
from bench.emulator.fleet.fleet import Fleet
from bench.fleet.replay import Served, SimTurn

__all__ = ["START", "AffinityLocal", "InFlight", "PrefixAware", "Proxy", "Recompute", "p_to_d"]

START: Final = {"do_remote_decode": True}  # a first prefill: keep the prompt's blocks for decode
PROXY_TTL_S: Final = 450.0


class InFlight:
    """A router's own requests sent and not yet answered, per engine: exact, no lag."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}

    def __call__(self, engine: SimEngine) -> int:
        return self.count.get(engine.name, 0)

    async def run(self, engine: SimEngine, call: Any) -> Completion:
        self.count[engine.name] = self.count.get(engine.name, 0) + 1
        try:
            return await call  # type: ignore[no-any-return]
        finally:
            self.count[engine.name] -= 1


async def p_to_d(
    inflight: InFlight, p: SimEngine, d: SimEngine, turn: SimTurn, params: dict[str, Any]
) -> tuple[Completion, Completion]:
    """Prefill on `p` with `params`, then decode on `d` reading p's KV."""
    pre = await inflight.run(p, p.complete(turn.prompt, 1, params))
    answer = await inflight.run(d, d.complete(turn.prompt, turn.output, pre.params or {}))
    return pre, answer


def reused(pre: Completion) -> int:
    return pre.cached_tokens + pre.host_tokens + pre.read_tokens


class _RoundRobin:
    def __init__(self, engines: Sequence[SimEngine]) -> None:
        self._next = itertools.cycle(engines)

    def __call__(self) -> SimEngine:
        return next(self._next)


class Recompute:
    name = "recompute"

    def __init__(self, fleet: Fleet) -> None:
        self._p, self._d = _RoundRobin(fleet.prefills), _RoundRobin(fleet.decodes)
        self.inflight = InFlight()

    async def serve(self, turn: SimTurn) -> Served:
        p, d = self._p(), self._d()
        pre, answer = await p_to_d(self.inflight, p, d, turn, START)
        return Served(answer, p.name, d.name, "recompute", "", reused(pre), pre)


class Proxy:
    """Needs a fleet whose decode retains (FleetConfig.retain_decode)."""

    name = "proxy"

    def __init__(self, fleet: Fleet) -> None:
        self._p, self._d = _RoundRobin(fleet.prefills), _RoundRobin(fleet.decodes)
        self._kept: dict[str, tuple[dict[str, Any], float]] = {}
        self.inflight = InFlight()

    async def serve(self, turn: SimTurn) -> Served:
        now = asyncio.get_running_loop().time()
        p, d = self._p(), self._d()
        kept = self._kept.pop(turn.conversation, None)  # single use
        params = kept[0] if kept is not None and kept[1] > now else None
        pre, answer = await p_to_d(self.inflight, p, d, turn, params or START)
        if answer.params:
            self._kept[turn.conversation] = (answer.params, asyncio.get_running_loop().time() + PROXY_TTL_S)
        decision = "read" if params else "recompute"
        return Served(answer, p.name, d.name, decision, "", reused(pre), pre)


def _minmax(values: Sequence[float]) -> list[float]:
    lo, hi = min(values), max(values)
    return [0.0 if hi == lo else (v - lo) / (hi - lo) for v in values]


class PrefixAware:
    name = "prefix-aware"

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.cache = fleet.subscribe()
        self.load = fleet.load_view()
        self.inflight = InFlight()

    async def serve(self, turn: SimTurn) -> Served:
        keys = turn.prompt.key_list
        ps = self.fleet.prefills
        n = max(1, len(keys))
        prefix = [self.cache.leading(p.name, keys) / n for p in ps]
        queue = _minmax([self.inflight(p) for p in ps])
        scores = [2 * a + (1 - b) for a, b in zip(prefix, queue, strict=True)]
        p = ps[max(range(len(ps)), key=lambda i: scores[i])]
        d = min(self.fleet.decodes, key=lambda e: (self.inflight(e), self.load.of(e.name).kv_usage))
        pre, answer = await p_to_d(self.inflight, p, d, turn, START)
        return Served(answer, p.name, d.name, "recompute", "prefix", reused(pre), pre)


class AffinityLocal:
    name = "affinity-local"

    def __init__(self, fleet: Fleet) -> None:
        self._p, self._d = _RoundRobin(fleet.prefills), _RoundRobin(fleet.decodes)
        self._home: dict[str, SimEngine] = {}
        self.inflight = InFlight()

    async def serve(self, turn: SimTurn) -> Served:
        d = self._home.get(turn.conversation)
        if d is None:
            p, d = self._p(), self._d()
            self._home[turn.conversation] = d
            pre, answer = await p_to_d(self.inflight, p, d, turn, START)
            return Served(answer, p.name, d.name, "p2d", "first", reused(pre), pre)
        answer = await self.inflight.run(d, d.complete(turn.prompt, turn.output))
        return Served(answer, "", d.name, "local", "affinity", answer.cached_tokens + answer.host_tokens)
