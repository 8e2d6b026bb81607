"""Degrade, never fail, over real gRPC servers on 127.0.0.1: a router whose registry went away
(its server stopped: connections refused, as after a SIGKILL) still answers every call."""

from __future__ import annotations

from tests.router.helpers import CONV, MODEL, Tokens, add_node, start_router
from tests.support.registry_env import start_registry

from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams


async def test_a_stopped_registry_leaves_plain_pd_plans_unstored_commits_and_aborts_that_succeed() -> None:
    registry = await start_registry()
    router = await start_router(registry)
    tokens = Tokens()
    try:
        await add_node(registry, "nodes/p0", reg_pb.NODE_ROLE_PREFILL)
        await add_node(registry, "nodes/d0", reg_pb.NODE_ROLE_DECODE)
        prompt = tokens(4000)
        first = await router.client.plan_turn(MODEL, prompt, conversation=CONV)
        sequence = prompt + tokens(70)
        stored = await router.client.commit_turn(
            first.turn,
            token_ids=sequence,
            decode_kv_transfer_params=tokens.decode_params(first, len(sequence)),
        )
        assert stored.retention
        # A turn that claims turn 1's retention, and will be aborted while the registry is away.
        claimed = await router.client.plan_turn(MODEL, sequence + tokens(100), conversation=CONV)
        assert claimed.decision == pb.DECISION_REUSE

        await registry.server.stop()

        prompt2 = sequence + tokens(120)
        plan = await router.client.plan_turn(MODEL, prompt2, conversation=CONV)
        assert (plan.decision, plan.reason) == (
            pb.DECISION_RECOMPUTE,
            pb.DECISION_REASON_REGISTRY_UNAVAILABLE,
        )
        assert plan.prefill_kv_transfer_params == KvTransferParams(
            do_remote_decode=True, do_remote_prefill=False
        )
        assert (plan.prefill.node, plan.decode.node) == ("nodes/p0", "nodes/d0")
        assert plan.reusable_tokens == 0
        sequence2 = prompt2 + tokens(70)
        committed = await router.client.commit_turn(
            plan.turn,
            token_ids=sequence2,
            decode_kv_transfer_params=tokens.decode_params(plan, len(sequence2)),
        )
        assert committed.retention == "" and not committed.HasField("expire_time")
        await router.client.abort_turn(claimed.turn, reason="engine failed")  # OK: best effort
        outcome = {"outcome": "registry_unavailable"}
        assert router.metrics.get_sample_value("kvshuttle_router_commits_total", outcome) == 1
    finally:
        await router.close()
        await registry.channel.close()
        registry.registry.close()
        await registry.server.stop()
