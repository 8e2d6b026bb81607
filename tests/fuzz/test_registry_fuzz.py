"""Every RegistryService RPC with near-valid and hostile requests against a real server: never
INTERNAL or UNKNOWN, the server stays up, and a rejected request leaves the whole state (every
record and field of the store and the block index) as it was."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import assume, given
from hypothesis import strategies as st
from tests.fuzz.harness import (
    FUZZ,
    INT32,
    NAME,
    NANOS,
    SECONDS,
    TEXT,
    UINT32,
    UINT64,
    outcome,
)
from tests.fuzz.served import BS, CONV, Served, build

from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def checked(served: Served, call: Callable[[], Any]) -> grpc.StatusCode:
    before = served.state()
    code = outcome(call)
    if code != grpc.StatusCode.OK:
        assert served.state() == before, f"a rejected call ({code.name}) changed the state"
    served.alive()
    return code


durations = st.builds(lambda s, n: build(lambda: Duration(seconds=s, nanos=n)), SECONDS, NANOS)
timestamps = st.builds(lambda s, n: build(lambda: Timestamp(seconds=s, nanos=n)), SECONDS, NANOS)
block_ids = st.lists(st.lists(UINT32, max_size=8), max_size=3)


@st.composite
def params(draw: st.DrawFn) -> KvTransferParams:
    return build(
        lambda: KvTransferParams(
            do_remote_decode=draw(st.booleans()),
            remote_engine_id=draw(st.sampled_from(["engine-d0", "engine-x", ""])),
            remote_host=draw(st.sampled_from(["127.0.0.1", "10.0.0.9", ""])),
            remote_port=draw(st.sampled_from([5601, 1, 0, 65535])),
            remote_block_ids=[BlockIdList(block_ids=g) for g in draw(block_ids)],
            remote_num_tokens=draw(UINT32),
        )
    )


@st.composite
def retentions(draw: st.DrawFn) -> pb.Retention:
    return build(
        lambda: pb.Retention(
            node=draw(st.sampled_from(["nodes/d0", "nodes/zz", ""])),
            generation=draw(UINT64),
            model=draw(st.sampled_from(["m", "other", ""])),
            block_size=draw(st.sampled_from([BS, 0, 7, 2**32 - 1])),
            num_tokens=draw(UINT32),
            block_hashes=draw(st.lists(UINT64, max_size=6)),
            kv_transfer_params=draw(params()),
            kv_bytes=draw(UINT64),
            pin_expire_time=draw(timestamps),
        )
    )


@FUZZ
@given(parent=NAME, kept=retentions(), ttl=durations, request_id=st.sampled_from(["", "r1", "r2", "x" * 200]))
def test_put_retention(
    served: Served, parent: str, kept: pb.Retention, ttl: Duration, request_id: str
) -> None:
    request = pb.PutRetentionRequest(parent=parent, retention=kept, ttl=ttl, request_id=request_id)
    checked(served, lambda: served.stub.PutRetention(request))


@FUZZ
@given(name=NAME, holder=TEXT, ttl=durations, request_id=st.sampled_from(["", "c1", "c2"]))
def test_claim_retention(served: Served, name: str, holder: str, ttl: Duration, request_id: str) -> None:
    request = pb.ClaimRetentionRequest(name=name, holder=holder, claim_ttl=ttl, request_id=request_id)
    checked(served, lambda: served.stub.ClaimRetention(request))


@FUZZ
@given(name=NAME, ttl=durations)
def test_renew_and_read(served: Served, name: str, ttl: Duration) -> None:
    checked(served, lambda: served.stub.RenewRetention(pb.RenewRetentionRequest(name=name, ttl=ttl)))
    checked(served, lambda: served.stub.GetRetention(pb.GetRetentionRequest(name=name)))
    checked(served, lambda: served.stub.GetConversation(pb.GetConversationRequest(name=name)))


@FUZZ
@given(name=NAME, claim_id=TEXT, force=st.booleans())
def test_release_retention(served: Served, name: str, claim_id: str, force: bool) -> None:
    assume(name != f"{CONV}/retentions/1" or not force)  # keep the seeded retention for the others
    request = pb.ReleaseRetentionRequest(name=name, claim_id=claim_id, force=force)
    checked(served, lambda: served.stub.ReleaseRetention(request))


@FUZZ
@given(parent=NAME, node=NAME, size=INT32, token=TEXT)
def test_list_retentions(served: Served, parent: str, node: str, size: int, token: str) -> None:
    request = pb.ListRetentionsRequest(parent=parent, node=node, page_size=size, page_token=token)
    checked(served, lambda: served.stub.ListRetentions(request))
    checked(served, lambda: served.stub.ListNodes(pb.ListNodesRequest(page_size=size, page_token=token)))


@st.composite
def nodes(draw: st.DrawFn) -> pb.Node:
    return build(
        lambda: pb.Node(
            name=draw(st.sampled_from(["nodes/d0", "nodes/d1"]) | NAME),
            role=cast(Any, draw(st.integers(0, 5))),
            engine_id=draw(TEXT),
            http_endpoint=draw(TEXT),
            side_channel_host=draw(TEXT),
            side_channel_port=draw(UINT32),
            agent_endpoint=draw(TEXT),
            model=draw(st.sampled_from(["m", ""]) | TEXT),
            block_size=draw(UINT32),
            kv_bytes_per_token=draw(UINT64),
            labels=draw(st.dictionaries(TEXT, TEXT, max_size=20)),
        )
    )


@FUZZ
@given(node=nodes(), ttl=durations)
def test_register_node(served: Served, node: pb.Node, ttl: Duration) -> None:
    assume(node.name != "nodes/d0")  # re-registering the seeded node would drop its retention
    checked(served, lambda: served.stub.RegisterNode(pb.RegisterNodeRequest(node=node, ttl=ttl)))


@FUZZ
@given(name=NAME, incarnation=UINT64, ttl=durations, running=UINT32, usage=st.floats(allow_nan=True))
def test_heartbeat_node(
    served: Served, name: str, incarnation: int, ttl: Duration, running: int, usage: float
) -> None:
    load = pb.NodeLoad(running_requests=running, kv_cache_usage=usage, engine_healthy=True)
    request = pb.HeartbeatNodeRequest(name=name, incarnation=incarnation, ttl=ttl, load=load)
    checked(served, lambda: served.stub.HeartbeatNode(request))


@st.composite
def batches(draw: st.DrawFn) -> list[pb.BlockEventBatch]:
    def event() -> pb.BlockEvent:
        kind = draw(st.sampled_from(["stored", "removed", "cleared", "none"]))
        if kind == "stored":
            return pb.BlockEvent(
                stored=pb.BlockStored(
                    block_hashes=draw(st.lists(UINT64, max_size=4)),
                    parent_block_hash=draw(UINT64),
                    token_ids=draw(st.lists(UINT32, max_size=40)),
                    block_size=draw(st.sampled_from([BS, 0, 3])),
                    medium=draw(st.sampled_from(["GPU", ""])),
                    cache_salt_sha256=draw(st.sampled_from([b"", b"\x01" * 32, b"short"])),
                )
            )
        if kind == "removed":
            return pb.BlockEvent(removed=pb.BlockRemoved(block_hashes=draw(st.lists(UINT64, max_size=4))))
        return pb.BlockEvent(cleared=pb.AllBlocksCleared()) if kind == "cleared" else pb.BlockEvent()

    return [
        build(lambda: pb.BlockEventBatch(seq=draw(UINT64), engine_time=draw(st.floats()), events=[event()]))
        for _ in range(draw(st.integers(0, 3)))
    ]


@FUZZ
@given(node=st.sampled_from(["nodes/d0", "nodes/x"]) | NAME, incarnation=UINT64, sent=batches())
def test_report_block_events(
    served: Served, node: str, incarnation: int, sent: list[pb.BlockEventBatch]
) -> None:
    if node == "nodes/d0" and incarnation % 2:
        incarnation = served.incarnation  # often the live incarnation: the batches get applied
    request = pb.ReportBlockEventsRequest(node=node, incarnation=incarnation, batches=sent)
    checked(served, lambda: served.stub.ReportBlockEvents(request))


@FUZZ
@given(hashes=st.lists(UINT64, max_size=30), model=TEXT, role=st.integers(0, 5))
def test_lookup_blocks(served: Served, hashes: list[int], model: str, role: int) -> None:
    request = build(lambda: pb.LookupBlocksRequest(block_hashes=hashes, model=model, role=cast(Any, role)))
    checked(served, lambda: served.stub.LookupBlocks(request))


METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["RegistryService"].methods]


@FUZZ
@given(method=st.sampled_from(METHODS), body=st.binary(max_size=200))
def test_any_bytes(served: Served, method: str, body: bytes) -> None:
    """Raw bytes to every method: whatever parses is a request like any other; what does not is
    INVALID_ARGUMENT, never INTERNAL."""
    if method == "WatchRetentions":
        call: Any = served.channel.unary_stream(f"/kvshuttle.registry.v1.RegistryService/{method}")

        def watch() -> None:
            stream = call(body, timeout=0.2)
            try:
                next(iter(stream))
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
            except StopIteration:
                pass

        checked(served, watch)
        return
    rpc: Any = served.channel.unary_unary(f"/kvshuttle.registry.v1.RegistryService/{method}")
    assume(method != "DeregisterNode" or b"d0" not in body)
    checked(served, lambda: rpc(body, timeout=5))
