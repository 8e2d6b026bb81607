"""A decode node that registers right after a plan found none, over real gRPC servers on
127.0.0.1 (registry and router, wired as in production): the next plan places on it at once,
though the router's background refresh of its node list is an hour away."""

from __future__ import annotations

import grpc
import pytest
from tests.router.helpers import CONV, MODEL, Tokens, add_node, start_router
from tests.support.registry_env import start_registry

from kvshuttle.client.errors import KvshuttleRpcError
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb


async def test_a_node_registered_right_after_a_plan_found_none_gets_the_next_plan() -> None:
    registry = await start_registry()
    # Every miss rereads (no interval: the test does not wait on the wall clock).
    router = await start_router(
        registry, node_refresh_s=3600.0, node_max_age_s=3600.0, node_miss_refresh_s=0.0
    )
    tokens = Tokens()
    try:
        await add_node(registry, "nodes/p0", reg_pb.NODE_ROLE_PREFILL)
        with pytest.raises(KvshuttleRpcError) as err:
            await router.client.plan_turn(MODEL, tokens(100), conversation=CONV)
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.UNAVAILABLE, "NO_DECODE_NODE")

        await add_node(registry, "nodes/d0", reg_pb.NODE_ROLE_DECODE)  # the agent back

        plan = await router.client.plan_turn(MODEL, tokens(100), conversation=CONV)
        assert (plan.prefill.node, plan.decode.node) == ("nodes/p0", "nodes/d0")
    finally:
        await router.close()
        await registry.channel.close()
        registry.registry.close()
        await registry.server.stop()
