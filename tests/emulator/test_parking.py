"""Parking and prefetch over stand-in engines (bench/emulator/http/pool_plane.py): kvshuttle's real
services, each agent `bench.emulator.http.agent` (kvshuttle's agent, its pool's KV moved over the
stand-ins' side channel instead of NIXL). The router parks an idle conversation's retention from
decode into decode's agent, the next turn's prefill reads it from that pool node as it reads
decode's; a think-time hint prefetches into prefill's agent, and the turn after reads from
there. Every answer is a clean recompute's (`StandinPair.expected`): a read of the wrong
blocks would answer otherwise.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from bench.emulator.http.launcher import StandinPair
from bench.emulator.http.tokenizer import make_tokenizer
from deploy.local.stack import KvshuttleStack
from tests.e2e.stacks import PROFILE
from tests.support.turns import turn

from kvshuttle.agent.v1 import agent_service_pb2 as apb
from kvshuttle.agent.v1 import agent_service_pb2_grpc as apb_grpc
from kvshuttle.gateway.config import DEFAULT_TENANT as TENANT

pytestmark = pytest.mark.slow  # real processes: the engines and kvshuttle's services
DECODE_POOL, PREFILL_POOL = "nodes/decode-pool", "nodes/prefill-pool"
ROUTER = {
    "POLICY__PARKING__ENABLED": "true",
    "POLICY__PARKING__PARK_AFTER_IDLE_S": "1",
    "POLICY__PARKING__MAX_IDLE_S": "120",
    "POLICY__PARKING__PREFETCH_ENABLED": "true",
    "POLICY__PARKING__TICK_S": "0.1",
}


def tokens(n: int, seed: int) -> list[int]:
    """Ids within the stand-in tokenizer's vocabulary (past its special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[StandinPair, KvshuttleStack]]:
    # A tokenizer only (no model): the engines are stand-ins. Prefix caching off on prefill:
    # every reuse turn reads its KV over a side channel.
    model_dir = make_tokenizer(tmp_path / "model")
    with StandinPair(model_dir, log_dir=tmp_path / "engines", prefill_prefix_caching=False) as pair:
        stack = KvshuttleStack(
            pair,
            work_dir=tmp_path / "kvshuttle",
            profile=PROFILE,
            kv_bytes_per_token=PROFILE["kv_bytes_per_token"],
            extra_env={"router": ROUTER},
            pool_bytes=64 * 2**20,
            pool_regions=1,
            agent_module="bench.emulator.http.agent",
        )
        stack.start()
        try:
            yield pair, stack
        finally:
            codes = stack.stop()
        assert all(code == 0 for code in codes.values()), (codes, stack.work_dir)


def until(condition: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:.0f} s"
        time.sleep(0.1)


def pool_status(stack: KvshuttleStack, agent: int) -> apb.PoolStatus:
    with grpc.insecure_channel(stack.agent_addrs[agent]) as channel:
        stub = apb_grpc.AgentServiceStub(channel)
        return stub.GetStatus(apb.GetStatusRequest(), timeout=5, metadata=stack.admin_metadata).pool


def test_parked_and_prefetched_kv_is_read_from_the_agents_pools(
    stack: tuple[StandinPair, KvshuttleStack],
) -> None:
    pair, services = stack
    conv = f"c-{uuid.uuid4().hex[:8]}"
    name = f"tenants/{TENANT}/conversations/{conv}"
    prompt = tokens(600, 41)
    out, _ = turn(services, conv, prompt)
    assert out == pair.expected(prompt, 24)

    # Idle: parked into decode's agent, whose READ freed decode's holding.
    until(lambda: services.retention_holder(name) == DECODE_POOL, what="the retention parked")
    status = pool_status(services, 1)
    assert status.parked_retentions == 1 and status.used_bytes > 0
    assert pair.decode.get_json("/standin/timings")["stats"]["holdings"] == 0

    history = prompt + out
    prompt = history + tokens(80, 42)
    reads = pair.prefill.get_json("/standin/timings")["stats"]["kv_reads_total"]
    out, headers = turn(services, conv, prompt, headers={"X-Kvshuttle-Expected-Think-Time": "30"})
    assert headers["X-Kvshuttle-Decision"] == "reuse"
    assert int(headers["X-Kvshuttle-Reused-Tokens"]) == len(history) - 1
    assert out == pair.expected(prompt, 24)
    assert pair.prefill.get_json("/standin/timings")["stats"]["kv_reads_total"] == reads + 1
    # Prefill's read released the parked slots.
    until(lambda: pool_status(services, 1).parked_retentions == 0, what="the pool's slots released")

    # The think-time hint: turn 2's retention prefetched into prefill's agent, read from there.
    until(lambda: services.retention_holder(name) == PREFILL_POOL, what="the retention prefetched")
    history = prompt + out
    prompt = history + tokens(80, 43)
    out, headers = turn(services, conv, prompt)
    assert headers["X-Kvshuttle-Decision"] == "reuse"
    assert int(headers["X-Kvshuttle-Reused-Tokens"]) == len(history) - 1
    assert out == pair.expected(prompt, 24)
    assert pair.decode.get_json("/standin/timings")["stats"]["kv_load_failures_total"] == 0
    assert pair.prefill.get_json("/standin/timings")["stats"]["kv_load_failures_total"] == 0
