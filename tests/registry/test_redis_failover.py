"""The registry through a real Redis Sentinel failover, the registry process never restarted.

A master and its replicas (AOF on each) watched by three Sentinels (quorum 2, down-after 1 s).
Writers put retentions through the registry's gRPC API; the master is SIGKILLed; the Sentinels
promote a replica and the registry's client (redis-py's Sentinel `master_for`, asking the
Sentinels again on each new connection) finds it. Meanwhile every failed call is UNAVAILABLE with
the registry's ErrorInfo, never INTERNAL; afterwards puts and claims succeed, every fence that
survived still refuses a put at or below it, and the old master, started again, comes back as a
replica of the new one. Twice: one replica and no write guard, and two replicas with
`min-replicas-to-write 1` (the new master takes writes once the other replica follows it).

Replication is asynchronous: a put the master acknowledged but had not sent to a replica yet is
lost with it. Each writer puts on one conversation until the kill and on another after it, so what
the promoted replica kept of the first is what had been replicated: the test counts acknowledged
puts above the fence it kept, and with the time until writes succeed again and the failed calls
by code prints them and keeps them (tests/support/failover_registry.py: .run/results, or
$KVSHUTTLE_RESULTS_DIR). No timed assertion: the figures are for the docs. Without a
`redis-server` these skip, unless KVSHUTTLE_REQUIRE_REDIS is set.

Beside it, what a registry meets around a failover, in process: a replica's READONLY and a
master's NOREPLICAS are UNAVAILABLE, and a put whose reply is lost after its script ran is
UNAVAILABLE and ran once (redis-py never sends a command twice)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis
from tests.support import registry_model as domain
from tests.support.clock import FakeClock
from tests.support.failover_registry import Client, client_to, keep, registry_process
from tests.support.redis_server import NO_PERSISTENCE, running_redis
from tests.support.redis_topology import AOF, SERVICE, in_sync, info, sentinel_group, wait_for
from tests.support.registry_messages import error_info

from kvshuttle.core.errors import Unavailable
from kvshuttle.registry.config import RedisSettings, RegistrySettings
from kvshuttle.registry.main import build_registry
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.redis.store import RedisStore

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WRITERS = 8
DOWN_AFTER_S = 1.0  # the Sentinels' down-after-milliseconds
FAILOVER_TIMEOUT_S = 4.0  # their failover-timeout (tests/support/redis_topology.py)
# What the group is configured to take, at most, before a replica is the master the Sentinels
# name: the master is subjectively down after down-after, objectively down once the quorum
# agrees (Sentinels ask each other every second), a leader is elected and promotes a replica
# (about a second); a failover not done in failover-timeout is tried again by another leader
# after twice that, and one retry is allowed for here.
FAILOVER_BOUND_S = DOWN_AFTER_S + 1.0 + 1.0 + 1.0 + 2 * FAILOVER_TIMEOUT_S
# Then the registry: a call in flight on the dead master waits at most its socket timeout
# (RedisSettings.socket_timeout_s, 5 s), and the next connection asks the Sentinels again. The
# factor is the margin for a loaded two-core machine, not a measurement: the time recovery
# takes is a figure this test prints and keeps, never asserted.
RECOVERY_LIMIT = 4 * (FAILOVER_BOUND_S + 5.0)
# The old master, started again, reports itself a master: a Sentinel makes it a replica only once
# it has been up and reporting that role for 4 publish periods (8 s, sentinel.c's convert-to-slave
# wait), and it learns the role from INFO, which it asks a replica that is up every 10 s. Then the
# new master's full resync. Same 4x margin: a full run on a busy machine took more than 30 s once.
REJOIN_LIMIT = 4 * (8.0 + 10.0 + 2.0)


async def until_writable(write: Callable[[], Awaitable[object]]) -> None:
    """`write` once it stops answering UNAVAILABLE (at most 15 s)."""
    deadline = time.monotonic() + 15.0
    while True:
        try:
            await write()
            return
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_a_replica_or_a_master_short_of_replicas_answers_unavailable(tmp_path: Path) -> None:
    """What a registry meets on the wrong side of a failover: a replica (READONLY, as a demoted
    master answers) and a master refusing writes for want of in-sync replicas (NOREPLICAS,
    min-replicas-to-write) are UNAVAILABLE, never INTERNAL; and once the replica is promoted
    (REPLICAOF NO ONE), the same registry writes to it."""
    (tmp_path / "m").mkdir()
    (tmp_path / "r").mkdir()
    with running_redis(tmp_path / "m") as master:
        options = (*NO_PERSISTENCE, "--replicaof", "127.0.0.1", str(master.port))
        with running_redis(tmp_path / "r", options) as replica:
            wait_for("the replica in sync", lambda: in_sync(replica.port))

            def registry_on(port: int) -> Registry:
                settings = RegistrySettings(
                    store="redis", redis=RedisSettings(url=f"redis://127.0.0.1:{port}/0")
                )
                return build_registry(settings, FakeClock())

            on_replica, on_master = registry_on(replica.port), registry_on(master.port)
            try:
                with pytest.raises(Unavailable, match="ReadOnlyError") as readonly:
                    await on_replica.register_node(domain.spec(), ttl=60)
                assert readonly.value.reason == "UNAVAILABLE"
                admin = redis.Redis(host="127.0.0.1", port=master.port)
                try:
                    admin.config_set("min-replicas-to-write", 2)  # it has one
                    with pytest.raises(Unavailable, match="NOREPLICAS"):
                        await on_master.register_node(domain.spec(), ttl=60)
                    admin.config_set("min-replicas-to-write", 1)
                    # The master counts its good replicas once a second: until then, NOREPLICAS.
                    await until_writable(lambda: on_master.register_node(domain.spec(), ttl=60))
                    put = await on_master.put_retention(
                        request_id="", parent=domain.CONV, retention=domain.retention(1), ttl=60
                    )
                    assert put.retention.generation == 1
                    assert admin.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
                finally:
                    admin.close()
                # Reads are served by a replica; writes once it is the master.
                assert (await on_replica.get_conversation(domain.CONV)).fence_generation == 1
                promote = redis.Redis(host="127.0.0.1", port=replica.port)
                try:
                    promote.replicaof("NO", "ONE")
                finally:
                    promote.close()
                again = await on_replica.put_retention(
                    request_id="", parent=domain.CONV, retention=domain.retention(2), ttl=60
                )
                assert again.replaced == put.retention.name
            finally:
                for registry in (on_replica, on_master):
                    registry.close()
                    assert isinstance(registry.store, RedisStore)
                    await registry.store.client.aclose()


class ReplyCutter:
    """A TCP proxy to Redis on 127.0.0.1 that, once `arm(sha)` is called, forwards the next
    EVALSHA of that script and closes the connection instead of forwarding its reply: the script
    ran, its reply was lost, as when a master dies or a client resets its connections."""

    def __init__(self, redis_port: int) -> None:
        self._redis_port = redis_port
        self._sha: bytes | None = None
        self.cut = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def arm(self, sha: str) -> None:
        self._sha = sha.encode()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self._redis_port)
        watched = asyncio.Event()  # this connection sent the armed script

        async def up() -> None:
            while data := await client_r.read(65536):
                if self._sha is not None and self._sha in data:
                    self._sha = None
                    watched.set()
                server_w.write(data)
                await server_w.drain()

        async def down() -> None:
            while data := await server_r.read(65536):
                if watched.is_set():
                    self.cut += 1
                    return  # the reply is dropped with the connection
                client_w.write(data)
                await client_w.drain()

        pumps = [asyncio.create_task(up()), asyncio.create_task(down())]
        with contextlib.suppress(OSError):
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        for writer in (client_w, server_w):
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def test_a_lost_reply_is_unavailable_and_the_put_ran_once(tmp_path: Path) -> None:
    """A put whose script ran but whose reply was lost: UNAVAILABLE (its outcome unknown), and
    redis-py sent it once. Sent again, the put would meet its own fence and answer ABORTED for a
    put that was stored. The caller's retry under its request id gets the first answer."""
    (tmp_path / "r").mkdir()
    with running_redis(tmp_path / "r") as server:
        cutter = ReplyCutter(server.port)
        port = await cutter.start()
        settings = RegistrySettings(store="redis", redis=RedisSettings(url=f"redis://127.0.0.1:{port}/0"))
        registry = build_registry(settings, FakeClock())
        store = registry.store
        assert isinstance(store, RedisStore)
        try:
            await registry.register_node(domain.spec(), ttl=60)
            await registry.put_retention(
                request_id="", parent=domain.CONV, retention=domain.retention(1), ttl=60
            )
            # Without a request id: sent again, it would answer ABORTED (FENCING_GENERATION_STALE).
            cutter.arm(store.scripts["put"].sha)
            with pytest.raises(Unavailable):
                await registry.put_retention(
                    request_id="", parent=domain.CONV, retention=domain.retention(2), ttl=60
                )
            assert cutter.cut == 1
            assert (await registry.get_conversation(domain.CONV)).fence_generation == 2  # it ran
            # With one: the caller's retry gets the first answer.
            cutter.arm(store.scripts["put"].sha)
            with pytest.raises(Unavailable):
                await registry.put_retention(
                    request_id="r3", parent=domain.CONV, retention=domain.retention(3), ttl=60
                )
            assert cutter.cut == 2
            again = await registry.put_retention(
                request_id="r3", parent=domain.CONV, retention=domain.retention(3), ttl=60
            )
            assert (again.retention.generation, again.replaced) == (3, f"{domain.CONV}/retentions/2")
        finally:
            registry.close()
            await store.client.aclose()
            await cutter.close()


@dataclass
class Writer:
    """One conversation before the kill (`before`) and one after it (`after`), so that what the
    promoted replica kept of `before` is what the master had replicated."""

    index: int
    acked: list[int] = field(default_factory=list)  # generations put OK on `before`
    unanswered: list[int] = field(default_factory=list)  # put on `before`, answered with an error
    after_ok: list[float] = field(default_factory=list)  # when each put on `after` succeeded
    gen_after: int = 0

    @property
    def before(self) -> str:
        return f"tenants/acme/conversations/before{self.index}"

    @property
    def after(self) -> str:
        return f"tenants/acme/conversations/after{self.index}"


async def write(client: Client, writer: Writer, killed: asyncio.Event, done: asyncio.Event) -> None:
    """Put ever newer generations: on `before` until the kill, then on `after`."""
    gen = 0
    while not killed.is_set():
        gen += 1
        try:
            await client.put(writer.before, gen)
            writer.acked.append(gen)
        except grpc.aio.AioRpcError as err:
            client.failed(err)
            writer.unanswered.append(gen)
    while not done.is_set():
        writer.gen_after += 1
        try:
            await client.put(writer.after, writer.gen_after)
            writer.after_ok.append(time.monotonic())
        except grpc.aio.AioRpcError as err:
            client.failed(err)
            await asyncio.sleep(0.05)


async def run_writers(client: Client, writers: list[Writer], kill: Callable[[], None]) -> float:
    """Write, kill the master with puts in flight, write until every writer has written 3 times
    since: the kill's time."""
    killed, done = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(write(client, w, killed, done)) for w in writers]
    try:
        await asyncio.sleep(1.5)
        kill()
        kill_time = time.monotonic()
        killed.set()
        while not all(len(w.after_ok) >= 3 for w in writers):
            late = time.monotonic() - kill_time
            assert late < RECOVERY_LIMIT, f"writes did not resume within {RECOVERY_LIMIT} s"
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
    return kill_time


async def check_what_survived(client: Client, w: Writer) -> tuple[int, int]:
    """The fence the new master kept of `w.before` holds, its retention and `w.after`'s can be
    claimed: (acknowledged puts lost, unanswered puts kept)."""
    conv = await client.conversation(w.before)
    fence = conv.fence_generation
    if fence:
        for stale in {fence, max(1, fence - 1)}:  # the same or an older generation is refused
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.put(w.before, stale)
            assert refused.value.code() == grpc.StatusCode.ABORTED
            assert error_info(refused.value).reason == "FENCING_GENERATION_STALE"
        assert conv.retention.generation == fence
        assert (await client.claim(conv.retention.name)).claim.claim_id
    newer = max([fence, *w.acked]) + 1  # newer than anything ever acknowledged: accepted
    assert (await client.put(w.before, newer)).retention.generation == newer
    current = await client.conversation(w.after)
    assert (await client.claim(current.retention.name)).claim.claim_id
    return sum(g > fence for g in w.acked), sum(g <= fence for g in w.unanswered)


@pytest.mark.parametrize(
    ("replicas", "min_replicas"), [(1, 0), (2, 1)], ids=["1-replica", "2-replicas-min-1"]
)
async def test_the_registry_rides_out_a_sentinel_failover(
    tmp_path: Path, replicas: int, min_replicas: int
) -> None:
    started = time.monotonic()
    guard = ("--min-replicas-to-write", str(min_replicas), "--min-replicas-max-lag", "10")
    down_after_ms = int(DOWN_AFTER_S * 1000)
    group_options = {"replicas": replicas, "sentinels": 3, "quorum": 2, "down_after_ms": down_after_ms}
    with sentinel_group(tmp_path / "redis", options=(*AOF, *guard), **group_options) as group:
        redis_env = {
            "REDIS__MODE": "sentinel",
            "REDIS__SENTINELS": json.dumps(group.addresses),
            "REDIS__SERVICE_NAME": SERVICE,
        }
        with registry_process(tmp_path, redis_env) as (service, addr, token):
            old_master = group.master
            async with client_to(addr, token, service.log_path) as client:
                await client.register()
                writers = [Writer(i) for i in range(WRITERS)]
                kill_time = await run_writers(client, writers, old_master.kill)
                errors = dict(client.errors)
                promoted = group.promoted_port(old_master.port)
                assert promoted in [r.port for r in group.replicas]
                assert info(promoted, "replication")["role"] == "master"
                service.check()  # the same registry process throughout
                lost, unanswered_kept = 0, 0
                for w in writers:
                    lost_here, kept_here = await check_what_survived(client, w)
                    lost, unanswered_kept = lost + lost_here, unanswered_kept + kept_here

                # The old master comes back (on its AOF): the Sentinels make it a replica of the
                # new one, and the registry keeps writing to the new master.
                old_master.start()
                wait_for(
                    "the old master to rejoin as a replica",
                    lambda: (
                        info(old_master.port, "replication")["role"] == "slave" and in_sync(old_master.port)
                    ),
                    timeout=REJOIN_LIMIT,
                )
                again = await client.put(writers[0].after, writers[0].gen_after + 1)
                assert again.retention.generation == writers[0].gen_after + 1
                assert group.master_port() == promoted
                service.check()

    acked = sum(len(w.acked) for w in writers)
    first_ok, every_ok = min(w.after_ok[0] for w in writers), max(w.after_ok[0] for w in writers)
    figures = {
        "topology": f"1 master + {replicas} replica(s), AOF everysec, 3 Sentinels, quorum 2",
        "min_replicas_to_write": min_replicas,
        "min_replicas_max_lag_s": 10,
        "down_after_ms": 1000,
        "failover_timeout_ms": 4000,
        "writers": WRITERS,
        "puts_acknowledged_before_kill": acked,
        "acknowledged_puts_lost": lost,
        "unanswered_puts_kept": unanswered_kept,
        "kill_to_first_write_s": round(first_ok - kill_time, 2),
        "kill_to_every_writer_writing_s": round(every_ok - kill_time, 2),
        "errors_during_failover": errors,
        "registry_restarted": False,
        "test_s": round(time.monotonic() - started, 1),
    }
    out = keep(f"sentinel-{replicas}r-min{min_replicas}", figures)
    print(
        f"\nredis_failover (sentinel, {replicas} replica(s), min-replicas-to-write {min_replicas}): "
        f"writes resumed {figures['kill_to_first_write_s']} s after the SIGKILL (every writer: "
        f"{figures['kill_to_every_writer_writing_s']} s); meanwhile {errors}; {lost} of {acked} "
        f"acknowledged puts lost; figures in {out}"
    )


async def test_a_redis_that_stops_answering_is_unavailable_after_the_socket_timeout(tmp_path: Path) -> None:
    """A Redis that keeps its connections open and answers nothing (SIGSTOP: as a partitioned or
    frozen host): a call fails UNAVAILABLE after REDIS__SOCKET_TIMEOUT_S instead of holding on
    until the caller's deadline; once it answers again, so does the registry."""
    (tmp_path / "r").mkdir()
    with running_redis(tmp_path / "r") as server:
        redis_settings = RedisSettings(url=f"redis://127.0.0.1:{server.port}/0", socket_timeout_s=1.5)
        registry = build_registry(RegistrySettings(store="redis", redis=redis_settings), FakeClock())
        store = registry.store
        assert isinstance(store, RedisStore)
        try:
            await registry.register_node(domain.spec(), ttl=60)
            os.kill(server.pid, signal.SIGSTOP)
            try:
                with pytest.raises(Unavailable) as stopped:
                    # Far past the socket timeout: only that ends the call.
                    await asyncio.wait_for(registry.get_conversation(domain.CONV), timeout=30)
                assert stopped.value.reason == "UNAVAILABLE"
            finally:
                os.kill(server.pid, signal.SIGCONT)
            put = await registry.put_retention(
                request_id="", parent=domain.CONV, retention=domain.retention(1), ttl=60
            )
            assert put.retention.generation == 1
        finally:
            registry.close()
            await store.client.aclose()
