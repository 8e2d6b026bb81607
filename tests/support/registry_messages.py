"""Builders of the registry's messages (nodes, retentions, durations) and helpers for its gRPC
errors, over a RegistryEnv (tests/support/registry_env.py)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2
from tests.support.registry_env import RegistryEnv

from kvshuttle.core.hashing import chain_hashes
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams

CONV = "tenants/acme/conversations/c1"


BLOCK = 16


def node(
    name: str = "nodes/d0", engine_id: str = "engine-d0", role: pb.NodeRole.ValueType = pb.NODE_ROLE_DECODE
) -> pb.Node:
    return pb.Node(
        name=name,
        role=role,
        engine_id=engine_id,
        http_endpoint="http://127.0.0.1:8001",
        side_channel_host="127.0.0.1",
        side_channel_port=5601,
        model="m",
        block_size=BLOCK,
        kv_bytes_per_token=1024,
    )


def retention(generation: int = 1, tokens: int = 100) -> pb.Retention:
    return pb.Retention(
        node="nodes/d0",
        generation=generation,
        model="m",
        block_size=BLOCK,
        num_tokens=tokens,
        block_hashes=chain_hashes(list(range(tokens)), BLOCK),
        kv_bytes=tokens * 1024,
        kv_transfer_params=KvTransferParams(
            do_remote_decode=True,
            remote_engine_id="engine-d0",
            remote_host="127.0.0.1",
            remote_port=5601,
            remote_block_ids=[BlockIdList(block_ids=[1, 2, 3])],
            remote_num_tokens=tokens,
        ),
    )


def seconds(s: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(s * 1e9))
    return d


def error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    for key, value in err.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info
    raise AssertionError("no ErrorInfo in the status")


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


async def register(env: RegistryEnv, n: pb.Node | None = None, ttl: float = 10) -> pb.Node:
    return (await env.stub.RegisterNode(pb.RegisterNodeRequest(node=n or node(), ttl=seconds(ttl)))).node


async def put(
    env: RegistryEnv, generation: int = 1, *, parent: str = CONV, ttl: float = 60, request_id: str = ""
) -> pb.Retention:
    response = await env.stub.PutRetention(
        pb.PutRetentionRequest(
            parent=parent, retention=retention(generation), ttl=seconds(ttl), request_id=request_id
        )
    )
    return response.retention
