"""The in-process registry the fuzz tests drive, and the retention and message builders they share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.duration_pb2 import Duration
from hypothesis import assume
from prometheus_client import CollectorRegistry
from tests.fuzz.harness import (
    LoopThread,
    state_of,
)
from tests.support.clock import FakeClock

from kvshuttle.core.hashing import chain_hashes
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RegistrySettings
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.main import build_server
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc
from kvshuttle.serving.settings import ServerSettings
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams


class Served:
    def __init__(self) -> None:
        self.thread = LoopThread()
        self.registry = Registry(InMemoryStore(), FakeClock(), BlockIndex(10_000), RegistryLimits())
        settings = RegistrySettings(server=ServerSettings(listen="127.0.0.1:0"))
        self.server = build_server(settings, self.registry, CollectorRegistry())
        port = self.thread.run(self.server.start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.RegistryServiceStub(self.channel)
        self.seed()

    def seed(self) -> None:
        """A live node with a retention, so that writes have something to get wrong."""
        node = pb.Node(
            name="nodes/d0",
            role=pb.NODE_ROLE_DECODE,
            engine_id="engine-d0",
            http_endpoint="http://127.0.0.1:8001",
            side_channel_host="127.0.0.1",
            side_channel_port=5601,
            model="m",
            block_size=BS,
            kv_bytes_per_token=1024,
        )
        registered = self.stub.RegisterNode(pb.RegisterNodeRequest(node=node, ttl=Duration(seconds=300)))
        self.incarnation = registered.node.incarnation
        self.stub.PutRetention(
            pb.PutRetentionRequest(parent=CONV, retention=retention(1, 64), ttl=Duration(seconds=300))
        )

    def state(self) -> Any:
        return self.thread.call(lambda: (state_of(self.registry.store), state_of(self.registry.index)))

    def alive(self) -> None:
        self.stub.ListNodes(pb.ListNodesRequest(), timeout=5)

    def close(self) -> None:
        self.channel.close()
        self.thread.run(self.server.stop())
        self.registry.close()
        self.thread.close()


def build(make: Callable[[], T]) -> T:
    """The message, or the example is skipped when protobuf itself refuses a field's value."""
    try:
        return make()
    except (ValueError, TypeError, OverflowError):
        assume(False)
        raise


T = TypeVar("T")


CONV = "tenants/acme/conversations/c1"


BS = 16


def retention(generation: int, tokens: int) -> pb.Retention:
    return pb.Retention(
        node="nodes/d0",
        generation=generation,
        model="m",
        block_size=BS,
        num_tokens=tokens,
        block_hashes=chain_hashes(list(range(tokens)), BS),
        kv_bytes=tokens * 1024,
        kv_transfer_params=KvTransferParams(
            do_remote_decode=True,
            remote_engine_id="engine-d0",
            remote_host="127.0.0.1",
            remote_port=5601,
            remote_block_ids=[BlockIdList(block_ids=list(range(1, tokens // BS + 1)))],
            remote_num_tokens=tokens,
        ),
    )
