"""Parking and prefetch on real vLLM (CPU build, tiny model), through the whole stack: the router
orders an agent to move a conversation's retained KV into its DRAM pool (one NIXL READ, whose
notification frees decode's blocks), re-points the retention at the agent's pool node in one
registry update, and the next turn's prefill reads from the agent through vLLM's own D->P path.

Every reuse turn's greedy output is compared with a single-server reference from scratch. The
stack's decode lease is short (the router's decoder_kv_blocks_ttl minus its margin: LEASE_S), so
a conversation idle past it recomputes without parking (tests/e2e/test_turns.py) and reuses with
it (here). The agent kill runs last: it takes decode's agent down and brings it back.
"""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from prometheus_client.parser import text_string_to_metric_families
from tests.e2e.stacks import running_stack
from tests.support.turns import post, reference, tokens, turn

from kvshuttle.agent.v1 import agent_service_pb2 as apb
from kvshuttle.agent.v1 import agent_service_pb2_grpc as apb_grpc
from kvshuttle.gateway.config import DEFAULT_TENANT as TENANT
from kvshuttle.registry.v1 import registry_service_pb2 as rpb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as rpb_grpc

pytestmark = pytest.mark.vllm
LEASE_S = 15  # a retention decode holds lapses 15 s after its commit (480 - margin 465)
POOL_BYTES = 64 * 2**20
DECODE_POOL, PREFILL_POOL = "nodes/decode-pool", "nodes/prefill-pool"


@pytest.fixture(scope="module")
def stack(vllm_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvshuttleStack]:
    env = {
        "router": {
            "POLICY__RETENTION_MARGIN_S": str(480 - LEASE_S),
            "POLICY__PARKING__ENABLED": "true",
            "POLICY__PARKING__PARK_AFTER_IDLE_S": "1",
            "POLICY__PARKING__MAX_IDLE_S": "120",
            "POLICY__PARKING__PREFETCH_ENABLED": "true",
            "POLICY__PARKING__TICK_S": "0.1",
        }
    }
    with running_stack(
        vllm_pair, tmp_path_factory.mktemp("kvshuttle"), extra_env=env, pool_bytes=POOL_BYTES
    ) as s:
        yield s


def _registry(stack: KvshuttleStack) -> rpb_grpc.RegistryServiceStub:
    return rpb_grpc.RegistryServiceStub(grpc.insecure_channel(stack.registry_addr))


def held_by(stack: KvshuttleStack, conversation: str) -> str:
    """The node holding the conversation's retention ("" when none)."""
    return stack.retention_holder(f"tenants/{TENANT}/conversations/{conversation}")


def live_nodes(stack: KvshuttleStack) -> set[str]:
    nodes = _registry(stack).ListNodes(rpb.ListNodesRequest(), timeout=5, metadata=stack.admin_metadata)
    return {n.name for n in nodes.nodes}


def pool_status(stack: KvshuttleStack, agent: int) -> apb.PoolStatus:
    stub = apb_grpc.AgentServiceStub(grpc.insecure_channel(stack.agent_addrs[agent]))
    return stub.GetStatus(apb.GetStatusRequest(), timeout=5, metadata=stack.admin_metadata).pool


def until(condition: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:.0f} s"
        time.sleep(0.2)


def test_an_idle_conversation_is_parked_and_reused_from_the_agent_past_decodes_lease(
    stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    conv = f"c-{uuid.uuid4().hex[:8]}"
    first = tokens(600, 31)
    out1, _ = turn(stack, conv, first)
    committed = time.monotonic()
    held = vllm_pair.decode.kv_cache_usage()
    until(lambda: held_by(stack, conv) == DECODE_POOL, what="the retention parked in decode's agent")
    # The READ's notification freed decode's copy at once, long before its lease would end.
    retained_blocks = (len(first) + len(out1) - 1 + 31) // 32
    until(
        lambda: vllm_pair.decode.kv_cache_usage() <= held - 0.9 * retained_blocks / 1024,
        what="decode's blocks freed",
    )
    assert pool_status(stack, 1).parked_retentions >= 1

    # Idle past the lease decode's copy would have had: the parked one still serves.
    time.sleep(max(0.0, committed + LEASE_S + 2 - time.monotonic()))
    prompt = first + out1 + tokens(100, 32)
    out2, h2 = turn(stack, conv, prompt)
    assert (h2["X-Kvshuttle-Decision"], h2["X-Kvshuttle-Reason"]) == ("reuse", "reuse_cheaper")
    assert int(h2["X-Kvshuttle-Reused-Tokens"]) == len(first) + len(out1) - 1
    assert int(h2["X-Kvshuttle-Prefill-Cached-Tokens"]) > 0  # prefill read them from the agent
    assert out2 == reference(vllm_pair, prompt)
    # Prefill's read-done notification released the slots; turn 2's own KV is parked in turn.
    until(lambda: held_by(stack, conv) == DECODE_POOL, what="turn 2's retention parked")


def test_a_think_time_hint_prefetches_into_the_prefill_side_agent(
    stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    conv = f"c-{uuid.uuid4().hex[:8]}"
    first = tokens(500, 33)
    out1, _ = turn(stack, conv, first, headers={"X-Kvshuttle-Expected-Think-Time": "10"})
    until(lambda: held_by(stack, conv) == PREFILL_POOL, what="the retention prefetched to prefill's agent")
    prompt = first + out1 + tokens(80, 34)
    out2, h2 = turn(stack, conv, prompt)
    assert h2["X-Kvshuttle-Decision"] == "reuse"
    assert int(h2["X-Kvshuttle-Reused-Tokens"]) == len(first) + len(out1) - 1
    assert out2 == reference(vllm_pair, prompt)


def test_forks_of_one_history_all_read_it_from_the_pool(stack: KvshuttleStack, vllm_pair: VllmPair) -> None:
    """Three requests of no conversation id continue one history at once (a fork's children):
    each reads the history's KV from decode's agent under a shared claim (the pool's read-done of
    a shared read frees nothing), and each answers as a clean recompute of its prompt does."""
    parent = tokens(600, 41)
    body, _ = post(f"{stack.gateway_url}/v1/completions", completion(parent))
    answer = list(body["choices"][0]["token_ids"])
    history = parent + answer
    shared_before = agent_metric(stack, 1, "kvshuttle_agent_pool_reads_total", kind="shared")
    prompts = [history + tokens(40, 42 + i) for i in range(3)]
    got: list[tuple[dict[str, Any], Any]] = [({}, None)] * len(prompts)

    def child(i: int) -> None:
        got[i] = post(f"{stack.gateway_url}/v1/completions", completion(prompts[i]))

    threads = [threading.Thread(target=child, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for prompt, (body, headers) in zip(prompts, got, strict=True):
        assert (headers["X-Kvshuttle-Decision"], headers["X-Kvshuttle-Reason"]) == ("reuse", "reuse_cheaper")
        assert int(headers["X-Kvshuttle-Reused-Tokens"]) == len(history) - 1
        assert list(body["choices"][0]["token_ids"]) == reference(vllm_pair, prompt)
    shared = agent_metric(stack, 1, "kvshuttle_agent_pool_reads_total", kind="shared")
    assert shared - shared_before == len(prompts)


def completion(prompt: list[int]) -> dict[str, Any]:
    """A completions request of no conversation id, greedy, as tests.support.turns.turn's."""
    return {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip


def agent_metric(stack: KvshuttleStack, agent: int, name: str, **labels: str) -> float:
    """A sample of the agent's /metrics (0 when absent)."""
    url = f"http://127.0.0.1:{stack.agent_metrics_ports[agent]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_an_agent_killed_with_parked_kv_degrades_to_recompute_and_its_retentions_go(
    stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    """Runs last in the module: decode's agent is killed, then started again."""
    conv = f"c-{uuid.uuid4().hex[:8]}"
    first = tokens(500, 35)
    out1, _ = turn(stack, conv, first)
    until(lambda: held_by(stack, conv) == DECODE_POOL, what="the retention parked")
    stack.kill("agent-decode")
    # The registry still lists the pool (its lease has not lapsed): the plan reads from it,
    # prefill's read fails, kv_load_failure_policy=recompute computes the prompt instead.
    prompt = first + out1 + tokens(60, 36)
    out2, _ = turn(stack, conv, prompt)
    assert out2 == reference(vllm_pair, prompt)
    # With the pool node's lease, the registry drops the pool node and what it held.
    until(lambda: DECODE_POOL not in live_nodes(stack), timeout=30, what="the dead pool's lease lapsed")
    assert held_by(stack, conv) != DECODE_POOL
    stack.service("agent-decode").start()
    stack.wait_ready(60)
