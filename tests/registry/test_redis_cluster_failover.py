"""The registry through a real Redis Cluster failover, the registry process never restarted.

Three masters, a replica each (AOF on every node, cluster-node-timeout 1 s). Writers put
retentions on eight conversations spread over the masters; the master serving two of them (and
none of the registry's shared keys: the `{kvshuttle}` deadlines, the node's record, the tenant's
index) is SIGKILLed; its replica takes over its slots and redis-py's RedisCluster refreshes its
slot map. Every failed call is UNAVAILABLE with the registry's ErrorInfo, never INTERNAL; the
conversations on the failed master's slots are written again after the promotion, and, with
`cluster-require-full-coverage no`, those on other slots throughout. With the default (`yes`)
every master refuses every command (CLUSTERDOWN) from the moment the failed master is marked
FAIL until its replica is promoted: the test counts those failures rather than asserting none.

The figures (time to write again on the failed slots, failed calls by code and slot side,
acknowledged puts lost: above the generation the first put after the promotion replaced) are
printed and kept (tests/support/failover_registry.py: .run/results, or $KVSHUTTLE_RESULTS_DIR).
No timed assertion. Without `redis-server` and `redis-cli` these skip, unless
KVSHUTTLE_REQUIRE_REDIS is set."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from redis.crc import key_slot
from tests.support.failover_registry import Client, client_to, keep, registry_process
from tests.support.redis_topology import replicated_cluster

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WRITERS = 8
NODE_TIMEOUT_S = 1.0  # the cluster's cluster-node-timeout
# What the cluster is configured to take, at most, before the failed slots are served again: the
# dead master is PFAIL after the node timeout and FAIL once a majority agrees (gossip: within
# another node timeout); its replica (rank 0) asks for votes after 0.5 s + up to 0.5 s; an
# election not won within the auth timeout (max(2 x node timeout, 2 s)) is tried again after
# twice that, and one retry is allowed for here.
AUTH_TIMEOUT_S = max(2 * NODE_TIMEOUT_S, 2.0)
FAILOVER_BOUND_S = 2 * NODE_TIMEOUT_S + 1.0 + AUTH_TIMEOUT_S + 2 * AUTH_TIMEOUT_S
# Then the registry: a call in flight on the dead master waits at most its socket timeout
# (RedisSettings.socket_timeout_s, 5 s), and the next call maps the slots again at once. The
# promise checked here is that bound; the factor is the margin for a loaded two-core machine
# (every timer above runs late there), not a measurement: the time recovery takes is a figure
# this test prints and keeps (about 2-3 s here), never asserted.
RECOVERY_LIMIT = 4 * (FAILOVER_BOUND_S + 5.0)
PREFIX = "kvshuttle"
SHARED_TAGS = (PREFIX, "nodes/d0", "tenants/acme")  # what every put touches besides its conversation


@dataclass
class Writer:
    """One conversation, put ever newer generations; `failed_slot` when its master is killed."""

    index: int
    failed_slot: bool = False
    acked_before_kill: list[int] = field(default_factory=list)
    ok_after_kill: list[float] = field(default_factory=list)
    first_replaced_after_kill: int | None = None  # the generation the new master had
    errors: Counter[str] = field(default_factory=Counter)
    outcomes: list[tuple[float, bool]] = field(default_factory=list)  # (when, succeeded) per put
    gen: int = 0

    def during(self, start: float, end: float) -> tuple[int, int]:
        """(succeeded, failed) puts answered between `start` and `end`."""
        within = [ok for when, ok in self.outcomes if start <= when <= end]
        return sum(within), len(within) - sum(within)

    @property
    def conversation(self) -> str:
        return f"tenants/acme/conversations/c{self.index}"

    @property
    def slot(self) -> int:
        return key_slot(f"{PREFIX}:{{{self.conversation}}}".encode())


async def write(client: Client, w: Writer, killed: asyncio.Event, done: asyncio.Event) -> None:
    while not done.is_set():
        w.gen += 1
        before = not killed.is_set()
        try:
            put = await client.put(w.conversation, w.gen)
        except grpc.aio.AioRpcError as err:
            w.outcomes.append((time.monotonic(), False))
            client.failed(err)
            w.errors[err.code().name] += 1
            await asyncio.sleep(0.05)
            continue
        w.outcomes.append((time.monotonic(), True))
        if before:
            w.acked_before_kill.append(w.gen)
        else:
            if not w.ok_after_kill:
                w.first_replaced_after_kill = int(put.replaced.rsplit("/", 1)[1]) if put.replaced else 0
            w.ok_after_kill.append(time.monotonic())


@pytest.mark.parametrize("full_coverage", [False, True], ids=["full-coverage-no", "full-coverage-yes"])
async def test_the_registry_rides_out_a_cluster_failover(tmp_path: Path, full_coverage: bool) -> None:
    started = time.monotonic()
    node_timeout_ms = int(NODE_TIMEOUT_S * 1000)
    with replicated_cluster(
        tmp_path / "redis", full_coverage=full_coverage, node_timeout_ms=node_timeout_ms
    ) as cluster:
        seed = cluster.nodes[0]
        writers = [Writer(i) for i in range(WRITERS)]
        shared = {cluster.master_of(key_slot(f"{{{tag}}}".encode()), seed) for tag in SHARED_TAGS}
        owners = {w.index: cluster.master_of(w.slot, seed) for w in writers}
        victims = set(owners.values()) - shared - {seed.port}
        assert victims, f"every master serves a shared key ({shared}) or is the seed"
        victim = min(victims)
        for w in writers:
            w.failed_slot = owners[w.index] == victim
        assert any(w.failed_slot for w in writers) and not all(w.failed_slot for w in writers)

        redis_env = {"REDIS__MODE": "cluster", "REDIS__URL": f"redis://127.0.0.1:{seed.port}/0"}
        with registry_process(tmp_path, redis_env) as (service, addr, token):
            async with client_to(addr, token, service.log_path) as client:
                await client.register()
                killed, done = asyncio.Event(), asyncio.Event()
                tasks = [asyncio.create_task(write(client, w, killed, done)) for w in writers]
                try:
                    await asyncio.sleep(1.5)
                    cluster.server(victim).kill()
                    kill_time = time.monotonic()
                    killed.set()
                    while not all(len(w.ok_after_kill) >= 3 for w in writers):
                        assert time.monotonic() < kill_time + RECOVERY_LIMIT, "writes did not resume"
                        for task in tasks:  # a writer that met a wrong answer fails the test now
                            if task.done():
                                task.result()
                        await asyncio.sleep(0.1)
                    done.set()
                    await asyncio.gather(*tasks)
                finally:
                    killed.set()
                    done.set()
                    for task in tasks:
                        task.cancel()
                service.check()  # the same registry process throughout
                promoted = {cluster.master_of(w.slot, seed) for w in writers if w.failed_slot}
                assert len(promoted) == 1 and victim not in promoted
                # The fence the promoted replica kept holds: an older generation is refused.
                for w in writers:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await client.put(w.conversation, 1)
                    assert refused.value.code() == grpc.StatusCode.ABORTED
                    current = await client.conversation(w.conversation)
                    assert (await client.claim(current.retention.name)).claim.claim_id

    failed = [w for w in writers if w.failed_slot]
    healthy = [w for w in writers if not w.failed_slot]
    back = max(w.ok_after_kill[0] for w in failed)  # the failed slots written again
    outage = [w.during(kill_time, back) for w in healthy]
    if not full_coverage:
        # The other masters kept serving their slots through the outage. Not every call: each
        # call that meets the dead master makes redis-py close every connection of the client
        # (and map the slots again), so calls in flight on the other masters then fail
        # UNAVAILABLE (their outcome unknown: never sent twice).
        assert all(ok > 0 for ok, _ in outage), outage
    healthy_ok, healthy_failed = sum(ok for ok, _ in outage), sum(bad for _, bad in outage)
    lost = sum(sum(g > (w.first_replaced_after_kill or 0) for g in w.acked_before_kill) for w in failed)
    acked = sum(len(w.acked_before_kill) for w in failed)
    figures = {
        "topology": f"3 masters + 3 replicas, AOF everysec, cluster-node-timeout {node_timeout_ms} ms",
        "recovery_limit_s": RECOVERY_LIMIT,
        "cluster_require_full_coverage": "yes" if full_coverage else "no",
        "writers": WRITERS,
        "writers_on_failed_slots": len(failed),
        "kill_to_failed_slots_written_s": round(back - kill_time, 2),
        "failed_calls_on_failed_slots": sum(sum(w.errors.values()) for w in failed),
        "other_slots_during_outage": {"succeeded": healthy_ok, "failed": healthy_failed},
        "errors_by_code": dict(client.errors),
        "puts_acknowledged_before_kill_on_failed_slots": acked,
        "acknowledged_puts_lost": lost,
        "registry_restarted": False,
        "test_s": round(time.monotonic() - started, 1),
    }
    out = keep(f"cluster-coverage-{'yes' if full_coverage else 'no'}", figures)
    print(
        f"\nredis_failover (cluster, require-full-coverage {figures['cluster_require_full_coverage']}): "
        f"failed slots written again {figures['kill_to_failed_slots_written_s']} s after the SIGKILL; "
        f"failed calls {figures['failed_calls_on_failed_slots']} on them; meanwhile on other slots "
        f"{healthy_ok} puts succeeded, {healthy_failed} failed ({figures['errors_by_code']}); "
        f"{lost} of {acked} acknowledged puts lost; figures in {out}"
    )
