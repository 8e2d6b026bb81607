"""One simulated run: a policy on a fresh fleet, one workload's sessions at one rate and seed, in
virtual time; and what the policies are, each on the fleet it ships with.

Every policy runs on the same hardware (the profile's engines, `HOST_GIB_PER_ENGINE` of host
DRAM beside each); what each puts in that DRAM is what it ships with:

    kvshuttle          as shipped: RouterPolicy() (reuse by cost, placement by its own ledger,
                       superseded retentions released, idle ones parked into the agents' host
                       pools: the host DRAM, as deploy/kubernetes/base sizes them; extend and
                       prefetch off), decode retaining for D->P reads (bidirectional_kv_xfer)
    kvshuttle-no-pool  as shipped, on agents without a pool (a deployment with no host DRAM to
                       spare): nothing is parked, retentions stay on decode until read, released
                       or the engine's TTL
    kvshuttle-extend   as shipped with extend on the holder turned on (POLICY__EXTEND__ENABLED):
                       the opt-in that runs a turn on the decode engine holding its history
    llm-d              bench/fleet/peers.py, OffloadingConnector CPU tier on every engine
    dynamo             bench/fleet/peers.py, KVBM host tier on the prefill engines
    affinity-local, prefix-aware, recompute, proxy    bench/fleet/baselines.py (proxy's decode
                       retains, as the seed's bidirectional setup; no host tier for these)
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, runtime_checkable

import numpy as np
from deploy.profiles.schema import EngineProfile

from bench.cluster.workload.tokens import TokenMap
from bench.emulator.fleet import vtime
from bench.emulator.fleet.fleet import Fleet, FleetConfig
from bench.fleet.baselines import AffinityLocal, PrefixAware, Proxy, Recompute
from bench.fleet.kvshuttle_sim import AgentModel, Kvshuttle, quiet_logs
from bench.fleet.peers import Dynamo, LlmD
from bench.fleet.replay import Arrival, Policy, ReplayResult, replay
from kvshuttle.router.policy import ExtendPolicy, RouterPolicy

__all__ = ["POLICIES", "RunResult", "RunSpec", "run"]

HOST_GIB_PER_ENGINE: Final = 256.0
SAMPLE_S: Final = 10.0  # occupancy samples


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    build: Callable[[Fleet, int], Policy]
    retain_decode: bool = False
    host_roles: tuple[str, ...] = ()


def _kvshuttle(fleet: Fleet, seed: int) -> Policy:
    return Kvshuttle(fleet, agent=AgentModel(pool_gib=HOST_GIB_PER_ENGINE), seed=seed)


def _kvshuttle_no_pool(fleet: Fleet, seed: int) -> Policy:
    return Kvshuttle(fleet, name="kvshuttle-no-pool", agent=AgentModel(pool_gib=0.0), seed=seed)


def _kvshuttle_extend(fleet: Fleet, seed: int) -> Policy:
    policy = RouterPolicy(extend=ExtendPolicy(enabled=True))
    agent = AgentModel(pool_gib=HOST_GIB_PER_ENGINE)
    return Kvshuttle(fleet, name="kvshuttle-extend", policy=policy, agent=agent, seed=seed)


POLICIES: Final = {
    p.name: p
    for p in (
        PolicySpec("kvshuttle", _kvshuttle, retain_decode=True),
        PolicySpec("kvshuttle-no-pool", _kvshuttle_no_pool, retain_decode=True),
        PolicySpec("kvshuttle-extend", _kvshuttle_extend, retain_decode=True),
        PolicySpec("llm-d", lambda f, s: LlmD(f, seed=s), host_roles=("prefill", "decode")),
        PolicySpec("dynamo", lambda f, s: Dynamo(f, seed=s), host_roles=("prefill",)),
        PolicySpec("affinity-local", lambda f, s: AffinityLocal(f)),
        PolicySpec("prefix-aware", lambda f, s: PrefixAware(f)),
        PolicySpec("recompute", lambda f, s: Recompute(f)),
        PolicySpec("proxy", lambda f, s: Proxy(f), retain_decode=True),
    )
}


@dataclass(frozen=True, slots=True)
class RunSpec:
    policy: str
    workload: str
    rate: float  # sessions per second
    seed: int
    profile: EngineProfile
    prefill: int
    decode: int
    arrivals: Sequence[Arrival]
    max_model_len: int
    # Sessions arrive over [0, window_s); turns sent in [warmup_s, window_s) are measured (the
    # fleet filled, arrivals still coming); none is sent after window_s, and turns still running
    # drain_s after it are cut (misses).
    window_s: float = 60.0
    warmup_s: float = 0.0
    drain_s: float = 60.0
    block_size: int = 64
    # A fleet with more turns in flight than this per engine, or an engine with more requests
    # queued for admission than `collapse_waiting`, has collapsed: the run stops there and its
    # turns in flight are cut (misses). A fleet near the SLO at the sweeps' top rates has a few
    # hundred turns in flight at 8P+8D and tens queued on its busiest engine; simulating a
    # collapse to its end decides nothing and cost up to ten CPU-minutes a run.
    collapse_in_flight_per_engine: int = 128
    collapse_waiting: int = 256


@dataclass
class RunResult:
    spec: dict[str, Any]
    result: ReplayResult
    cpu_s: float
    virtual_s: float
    engines: dict[str, dict[str, float]] = field(default_factory=dict)
    occupancy: list[dict[str, float]] = field(default_factory=list)


@runtime_checkable
class _Pool(Protocol):
    """A host pool beside the engines (kvshuttle's agents' pools), as sampled."""

    capacity_blocks: int

    def used_blocks(self) -> int: ...


async def _sample(fleet: Fleet, into: list[dict[str, float]]) -> None:
    loop = asyncio.get_running_loop()
    engines_by_name = {e.name for e in fleet.engines}
    while True:
        row: dict[str, float] = {"t": round(loop.time(), 3)}
        for role, engines in (("prefill", fleet.prefills), ("decode", fleet.decodes)):
            usage = [e.kv_usage() for e in engines]
            # The mean, and the fullest engine: one full decode queues its answers however
            # empty the others are.
            row[f"{role}_hbm"] = round(float(np.mean(usage)), 4)
            row[f"{role}_hbm_max"] = round(float(np.max(usage)), 4)
            cap = sum(e.host.capacity_blocks for e in engines)
            row[f"{role}_host"] = round(sum(len(e.host) for e in engines) / cap, 4) if cap else 0.0
        pools = [s for n, s in fleet.sources.items() if n not in engines_by_name and isinstance(s, _Pool)]
        if pools:
            cap = sum(p.capacity_blocks for p in pools)
            row["agent_pools"] = round(sum(p.used_blocks() for p in pools) / cap, 4) if cap else 0.0
        into.append(row)
        await asyncio.sleep(SAMPLE_S)


async def _run(spec: RunSpec) -> RunResult:
    policy_spec = POLICIES[spec.policy]
    fleet = Fleet(
        FleetConfig(
            spec.profile,
            prefill=spec.prefill,
            decode=spec.decode,
            block_size=spec.block_size,
            host_gib_per_engine=HOST_GIB_PER_ENGINE if policy_spec.host_roles else 0.0,
            host_roles=policy_spec.host_roles,
            retain_decode=policy_spec.retain_decode,
        )
    )
    fleet.start()
    policy = policy_spec.build(fleet, spec.seed)
    starter = getattr(policy, "start", None)
    if starter is not None:
        await starter()
    occupancy: list[dict[str, float]] = []
    sampler = asyncio.get_running_loop().create_task(_sample(fleet, occupancy))
    token_map = TokenMap(151_000, seed=spec.seed, reserved=1_000)
    result = await replay(
        policy,
        spec.arrivals,
        token_map,
        block_size=spec.block_size,
        max_model_len=spec.max_model_len,
        send_until_s=spec.window_s,
        end_s=spec.window_s + spec.drain_s,
        collapse_if=lambda r: (
            r.in_flight > spec.collapse_in_flight_per_engine * (spec.prefill + spec.decode)
            or any(e.waiting > spec.collapse_waiting for e in fleet.engines)
        ),
    )
    sampler.cancel()
    closer = getattr(policy, "close", None)
    if closer is not None:
        await closer()
    engines = {
        e.name: {
            "busy_s": round(e.timing.busy_ms / 1e3, 3),
            "prefill_s": round(e.timing.prefill_ms / 1e3, 3),
            **{k: v for k, v in dataclasses.asdict(e.counters).items()},
            "evicted_blocks": e.pool.evicted_blocks,
            "dropped_holdings": e.pool.dropped_holdings,
            "expired_holdings": e.pool.expired_holdings,
            "host_evicted_blocks": e.host.evicted_blocks,
            # Every byte over the engine's links: reads, P2P pulls, kvshuttle's parks and prefetches.
            "nic_bytes": e.nic.bytes_moved,
            "pcie_bytes": e.pcie.bytes_moved if e.pcie is not None else 0,
            **{f"audit_{k}": v for k, v in e.pool.audit().items()},
        }
        for e in fleet.engines
    }
    await fleet.stop()
    virtual = asyncio.get_running_loop().time()
    return RunResult({}, result, 0.0, virtual, engines, occupancy)


def run(spec: RunSpec) -> RunResult:
    """The run, in virtual time; `cpu_s` what it cost this process."""
    started = time.process_time()
    with quiet_logs():
        out = vtime.run(_run(spec))
    out.cpu_s = time.process_time() - started
    out.spec = {
        "policy": spec.policy,
        "workload": spec.workload,
        "rate": spec.rate,
        "seed": spec.seed,
        "prefill": spec.prefill,
        "decode": spec.decode,
        "sessions": len(spec.arrivals),
        "window_s": spec.window_s,
        "warmup_s": spec.warmup_s,
    }
    return out
