"""Two registry processes over one Redis (issue 12 §2): each retention has exactly one reuser,
whichever replica the claims reach, and a retention one replica stored, the other serves and
expires. Real processes on loopback (deploy.local: RedisServer and `registry_service`, as the
stack runs them), clients balancing over both replicas' addresses; nothing left running.

Without a `redis-server` binary these tests skip, unless KVSHUTTLE_REQUIRE_REDIS is set (CI)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from deploy.local.processes import free_ports
from deploy.local.redis import RedisServer
from deploy.local.services import Service, grpc_ready, registry_service
from deploy.local.tokens import Tokens
from tests.support.registry_messages import CONV, node, retention, seconds

from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc

HOST = "127.0.0.1"
CONVERSATIONS = 12
READERS = 6  # claimers per retention, spread over both replicas

# Skips without a Redis-protocol server, fails under KVSHUTTLE_REQUIRE_REDIS (tests/deploy/conftest.py).
pytestmark = [pytest.mark.usefixtures("redis_installed"), pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[list[str], tuple[tuple[str, str], ...]]]:
    """Two registry processes on one RedisServer: their addresses and an admin's metadata."""
    ports = free_ports(3)
    redis = RedisServer(tmp_path / "redis", port=ports[0])
    tokens = Tokens(tmp_path / "tokens")
    auth = tokens.auth({"admin": {"role": "admin"}})
    addrs = [f"{HOST}:{p}" for p in ports[1:]]
    services: list[Service] = [
        registry_service(
            listen=addr, log_dir=tmp_path, auth=auth, redis_url=redis.url, name=f"registry-{i}",
            extra={"TELEMETRY__LOG_FORMAT": "json", "EXPIRY_MAX_SLEEP": "0.2"},
        )
        for i, addr in enumerate(addrs)
    ]  # fmt: skip
    try:
        redis.start()
        for service in services:
            service.start()
        deadline = time.monotonic() + 30
        while not all(grpc_ready(a) for a in addrs):
            for service in services:
                service.check()
            assert time.monotonic() < deadline, "registry replicas not serving"
        yield addrs, (("authorization", f"Bearer {tokens.token('admin')}"),)
    finally:
        codes = [service.stop() for service in services]
        redis.stop()
    assert codes == [0, 0], codes
    assert all(s.proc is not None and s.proc.poll() is not None for s in services)
    assert redis.proc is None or redis.proc.poll() is not None


def test_each_retention_has_exactly_one_reuser_across_replicas(
    replicas: tuple[list[str], tuple[tuple[str, str], ...]],
) -> None:
    addrs, metadata = replicas
    stubs = [pb_grpc.RegistryServiceStub(grpc.insecure_channel(a)) for a in addrs]
    stubs[0].RegisterNode(pb.RegisterNodeRequest(node=node(), ttl=seconds(300)), timeout=5, metadata=metadata)
    names = []
    for c in range(CONVERSATIONS):
        parent = f"{CONV}-{c}"
        put = pb.PutRetentionRequest(parent=parent, retention=retention(1), ttl=seconds(300))
        # Stored through one replica, claimed through both: the state is Redis's, not a process's.
        names.append(stubs[c % 2].PutRetention(put, timeout=5, metadata=metadata).retention.name)
    outcomes: Counter[tuple[str, str]] = Counter()
    lock = threading.Lock()
    start = threading.Barrier(CONVERSATIONS * READERS)

    def claim(name: str, reader: int) -> None:
        request = pb.ClaimRetentionRequest(name=name, holder=f"router:{reader}", claim_ttl=seconds(30))
        start.wait()
        try:
            stubs[reader % 2].ClaimRetention(request, timeout=10, metadata=metadata)
            outcome = "won"
        except grpc.RpcError as err:
            outcome = err.code().name
        with lock:
            outcomes[(name, outcome)] += 1

    threads = [
        threading.Thread(target=claim, args=(name, reader)) for name in names for reader in range(READERS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in names:
        assert outcomes[(name, "won")] == 1, outcomes
        assert outcomes[(name, "ABORTED")] == READERS - 1, outcomes  # RETENTION_ALREADY_CLAIMED


def test_a_retention_stored_on_one_replica_is_served_and_expired_by_the_other(
    replicas: tuple[list[str], tuple[tuple[str, str], ...]],
) -> None:
    addrs, metadata = replicas
    first, second = (pb_grpc.RegistryServiceStub(grpc.insecure_channel(a)) for a in addrs)
    first.RegisterNode(pb.RegisterNodeRequest(node=node(), ttl=seconds(300)), timeout=5, metadata=metadata)
    put = pb.PutRetentionRequest(parent=CONV, retention=retention(3), ttl=seconds(1))
    first.PutRetention(put, timeout=5, metadata=metadata)
    got = second.GetConversation(pb.GetConversationRequest(name=CONV), timeout=5, metadata=metadata)
    assert got.conversation.retention.generation == 3
    # An older turn's late commit is fenced by whichever replica it reaches.
    stale = pb.PutRetentionRequest(parent=CONV, retention=retention(2), ttl=seconds(60))
    with pytest.raises(grpc.RpcError) as fenced:
        second.PutRetention(stale, timeout=5, metadata=metadata)
    assert fenced.value.code() == grpc.StatusCode.ABORTED
    deadline = time.monotonic() + 10
    while True:  # both replicas sweep: the retention lapses once, on the server's state
        conversation = second.GetConversation(
            pb.GetConversationRequest(name=CONV), timeout=5, metadata=metadata
        ).conversation
        if not conversation.HasField("retention"):
            break
        assert time.monotonic() < deadline, "a 1 s retention still there after 10 s"
        time.sleep(0.2)
    assert conversation.fence_generation == 3
