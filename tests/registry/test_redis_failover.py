"""The registry process through a real Redis failover, with the registry never restarted.

Sentinel: a master and a replica (AOF on both) watched by three Sentinels (quorum 2,
down-after 1 s). Writers put retentions through the registry's gRPC API; the master is SIGKILLed;
the Sentinels promote the replica and the registry's client (redis-py's Sentinel `master_for`)
finds it. Meanwhile every failed call is UNAVAILABLE with ErrorInfo (UNAVAILABLE, the registry's
domain), never INTERNAL; afterwards puts and claims succeed, every fence that survived still
refuses a put at or below it, and the old master, started again, comes back as a replica.

Replication is asynchronous: a put the master acknowledged but had not yet sent to the replica is
lost with the master. The test counts them (acknowledged puts whose generation is above the fence
the promoted replica has) and, with the time until writes succeed again and the failed calls by
code, prints them and keeps them in .run/results/redis_failover-<utc>.json, or under
$KVSHUTTLE_RESULTS_DIR (bench/results to keep a run's figures with the benchmarks'). No timed
assertion: the figures are for the README. Without a `redis-server` these skip, unless
KVSHUTTLE_REQUIRE_REDIS is set."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from deploy.local.launch import free_ports
from deploy.local.stack import Service, _grpc_ready, _Tokens, registry_service
from tests.clock import FakeClock
from tests.registry import test_registry_domain as domain
from tests.registry.redis_server import NO_PERSISTENCE, running_redis
from tests.registry.redis_topology import SERVICE, SentinelGroup, in_sync, info, sentinel_group, wait_for
from tests.registry.test_registry_grpc import error_info, node, retention, seconds

from kvshuttle.core.errors import Unavailable
from kvshuttle.registry.config import RedisSettings, RegistrySettings
from kvshuttle.registry.main import ERROR_DOMAIN, build_registry
from kvshuttle.registry.redis_store import RedisStore
from kvshuttle.registry.registry import Registry
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("KVSHUTTLE_RESULTS_DIR") or ROOT / ".run" / "results")
WRITERS = 8
CALL_TIMEOUT = 3.0  # each RPC's deadline: a call the registry does not answer by then fails the test
RECOVERY_LIMIT = 30.0  # seconds after the kill within which every writer must be writing again


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
                    await on_master.register_node(domain.spec(), ttl=60)
                    put = await on_master.put_retention(
                        request_id="", parent=domain.CONV, retention=domain.retention(1), ttl=60
                    )
                    assert put.retention.generation == 1
                finally:
                    admin.close()
                # Reads are served by a replica; writes once it is the master.
                wait_for("the put replicated", lambda: info(replica.port, "keyspace"))
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
                    assert isinstance(registry._store, RedisStore)
                    await registry._store._redis.aclose()


def keep(figures: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"redis_failover-{figures['time']}.json"
    out.write_text(json.dumps(figures, indent=2) + "\n")
    return out


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


class Client:
    """An admin's async stub to the registry process, and every failed call's code and reason."""

    def __init__(self, addr: str, token: str) -> None:
        self.channel = grpc.aio.insecure_channel(addr)
        self.stub = pb_grpc.RegistryServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.errors: Counter[str] = Counter()

    async def put(self, conversation: str, generation: int) -> pb.Retention:
        request = pb.PutRetentionRequest(
            parent=conversation, retention=retention(generation), ttl=seconds(300)
        )
        response = await self.stub.PutRetention(request, timeout=CALL_TIMEOUT, metadata=self.metadata)
        return response.retention

    async def claim(self, name: str) -> pb.Retention:
        request = pb.ClaimRetentionRequest(name=name, holder="turns/t1", claim_ttl=seconds(10))
        response = await self.stub.ClaimRetention(request, timeout=CALL_TIMEOUT, metadata=self.metadata)
        return response.retention

    async def conversation(self, name: str) -> pb.Conversation:
        request = pb.GetConversationRequest(name=name)
        response = await self.stub.GetConversation(request, timeout=CALL_TIMEOUT, metadata=self.metadata)
        return response.conversation

    def failed(self, err: grpc.aio.AioRpcError) -> None:
        """A call that failed during the failover: it must be UNAVAILABLE, with ErrorInfo."""
        info_ = error_info(err)
        self.errors[f"{err.code().name}/{info_.reason}"] += 1
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
        assert (info_.reason, info_.domain) == ("UNAVAILABLE", ERROR_DOMAIN)


@contextlib.contextmanager
def registry_process(tmp: Path, group: SentinelGroup) -> Iterator[tuple[Service, str, str]]:
    """The registry as the stack runs it, on the Sentinel group: (service, address, admin token)."""
    (port,) = free_ports(1)
    addr = f"127.0.0.1:{port}"
    tokens = _Tokens(tmp / "tokens")
    sentinel_env = {
        "STORE": "redis",
        "REDIS__MODE": "sentinel",
        "REDIS__SENTINELS": json.dumps(group.addresses),
        "REDIS__SERVICE_NAME": SERVICE,
        "TELEMETRY__LOG_FORMAT": "json",
    }
    service = registry_service(
        listen=addr, log_dir=tmp, auth=tokens.auth({"admin": {"role": "admin"}}), extra=sentinel_env
    )
    service.start()
    try:

        def serving() -> bool:
            service.check()
            return _grpc_ready(addr)

        wait_for("the registry to serve", serving)
        yield service, addr, tokens.token("admin")
    finally:
        service.stop()


@contextlib.asynccontextmanager
async def client_to(addr: str, token: str) -> AsyncIterator[Client]:
    client = Client(addr, token)
    try:
        yield client
    finally:
        await client.channel.close()


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


async def test_the_registry_rides_out_a_sentinel_failover(tmp_path: Path) -> None:
    started = time.monotonic()
    with (
        sentinel_group(tmp_path / "redis", replicas=1, sentinels=3, quorum=2, down_after_ms=1000) as group,
        registry_process(tmp_path, group) as (service, addr, token),
    ):
        old_master = group.master
        async with client_to(addr, token) as client:
            await client.stub.RegisterNode(
                pb.RegisterNodeRequest(node=node(), ttl=seconds(300)),
                timeout=CALL_TIMEOUT,
                metadata=client.metadata,
            )
            writers = [Writer(i) for i in range(WRITERS)]
            killed, done = asyncio.Event(), asyncio.Event()
            tasks = [asyncio.create_task(write(client, w, killed, done)) for w in writers]
            try:
                await asyncio.sleep(1.5)
                # The master dies with puts in flight: what it acknowledged but had not
                # replicated yet is lost with it.
                old_master.kill()
                kill_time = time.monotonic()
                killed.set()
                deadline = kill_time + RECOVERY_LIMIT
                while not all(len(w.after_ok) >= 3 for w in writers):
                    assert time.monotonic() < deadline, "writes did not resume within 30 s"
                    await asyncio.sleep(0.1)
                done.set()
                await asyncio.gather(*tasks)
            finally:
                done.set()
                killed.set()
                for task in tasks:
                    task.cancel()
            errors_during_failover = dict(client.errors)
            promoted = group.master_port()
            assert promoted == group.replicas[0].port
            assert info(promoted, "replication")["role"] == "master"
            service.check()  # the same registry process throughout

            # What the promoted replica kept of each `before` conversation.
            lost, unacked_kept = 0, 0
            for w in writers:
                conv = await client.conversation(w.before)
                fence = conv.fence_generation
                last_acked = max(w.acked, default=0)
                lost += sum(1 for g in w.acked if g > fence)
                unacked_kept += sum(1 for g in w.unanswered if g <= fence)
                if fence:
                    # The fence that survived holds: the same or an older generation is refused.
                    for stale in {fence, max(1, fence - 1)}:
                        with pytest.raises(grpc.aio.AioRpcError) as refused:
                            await client.put(w.before, stale)
                        assert refused.value.code() == grpc.StatusCode.ABORTED
                        assert error_info(refused.value).reason == "FENCING_GENERATION_STALE"
                    assert conv.retention.generation == fence
                    claimed = await client.claim(conv.retention.name)
                    assert claimed.claim.claim_id
                # A newer generation than anything ever acknowledged is accepted.
                put = await client.put(w.before, max(last_acked, fence) + 1)
                assert put.generation == max(last_acked, fence) + 1
                current = await client.conversation(w.after)
                claimed = await client.claim(current.retention.name)  # claims work on the new master
                assert claimed.claim.claim_id

            # The old master comes back (on its AOF): the Sentinels make it a replica of the new
            # one, and the registry keeps writing to the new master.
            old_master.start()
            wait_for(
                "the old master to rejoin as a replica",
                lambda: info(old_master.port, "replication")["role"] == "slave" and in_sync(old_master.port),
            )
            again = await client.put(writers[0].after, writers[0].gen_after + 1)
            assert again.generation == writers[0].gen_after + 1
            assert group.master_port() == promoted
            service.check()

    acked = sum(len(w.acked) for w in writers)
    first_ok = min(w.after_ok[0] for w in writers)
    all_ok = max(w.after_ok[0] for w in writers)
    figures: dict[str, Any] = {
        "test": "redis_failover",
        "time": datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "sentinel": {
            "topology": "1 master + 1 replica (AOF everysec), 3 Sentinels, quorum 2",
            "down_after_ms": 1000,
            "failover_timeout_ms": 4000,
            "writers": WRITERS,
            "puts_acknowledged_before_kill": acked,
            "acknowledged_puts_lost": lost,
            "unanswered_puts_kept": unacked_kept,
            "kill_to_first_write_s": round(first_ok - kill_time, 2),
            "kill_to_every_writer_writing_s": round(all_ok - kill_time, 2),
            "errors_during_failover": errors_during_failover,
            "registry_restarted": False,
        },
        "test_s": round(time.monotonic() - started, 1),
    }
    out = keep(figures)
    s = figures["sentinel"]
    print(
        f"\nredis_failover (sentinel): writes resumed {s['kill_to_first_write_s']} s after the SIGKILL "
        f"(every writer: {s['kill_to_every_writer_writing_s']} s); meanwhile {errors_during_failover}; "
        f"{lost} of {acked} acknowledged puts lost; figures in {out}"
    )
