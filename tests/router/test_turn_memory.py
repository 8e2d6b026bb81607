"""TurnMemory: bounded tables of one replica's turns, and the commits it is storing."""

from __future__ import annotations

import numpy as np
import pytest

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.nodes import NodeRole
from kvshuttle.router.model import (
    CommitRequest,
    CommitResult,
    Decision,
    Estimate,
    NodeInfo,
    Plan,
    PlanRequest,
    Reason,
    TurnTimings,
)
from kvshuttle.router.turn_memory import TurnMemory, commit_fingerprint, plan_fingerprint


def test_each_table_keeps_its_latest_entries() -> None:
    memory = TurnMemory(remembered_turns=2, hint_bytes=1 << 20)
    for turn in ("t1", "t2", "t3"):
        memory.finish(turn, "committed")
        memory.remember_commit(turn, "r", b"fp", CommitResult(f"{turn}-retention", 1.0))
    assert memory.finished("t1") is None and memory.finished("t3") == "committed"
    assert memory.earlier_commit("t1", "r", b"fp") is None
    assert memory.earlier_commit("t2", "r", b"fp") == CommitResult("t2-retention", 1.0)
    assert memory.earlier_commit("t2", "other request", b"fp") is None
    memory.placed("c", "nodes/p0", "nodes/d0")
    assert memory.last_nodes("c") == ("nodes/p0", "nodes/d0")
    assert memory.last_nodes("never planned") == ("", "")


async def test_a_commit_in_flight_is_marked_until_it_is_stored() -> None:
    memory = TurnMemory(remembered_turns=10, hint_bytes=1 << 20)
    assert memory.commit_in_flight("c") is None
    with memory.storing("c"):
        first = memory.commit_in_flight("c")
        assert first is not None and not first.done()
        with memory.storing("c"):  # a later commit of the same conversation takes the mark
            second = memory.commit_in_flight("c")
        assert second is not None and second.done()
        assert memory.commit_in_flight("c") is None
    assert first.done()
    with memory.storing(""):  # nothing to wait for without a conversation
        assert memory.commit_in_flight("") is None


async def test_the_mark_is_cleared_when_the_store_fails() -> None:
    memory = TurnMemory(remembered_turns=10, hint_bytes=1 << 20)
    with pytest.raises(RuntimeError), memory.storing("c"):
        waiting = memory.commit_in_flight("c")
        raise RuntimeError("registry down")
    assert waiting is not None and waiting.done() and memory.commit_in_flight("c") is None


def test_a_request_id_with_another_body_is_refused_not_answered() -> None:
    memory = TurnMemory(remembered_turns=10, hint_bytes=1 << 20)
    memory.remember_commit("t1", "r", b"first", CommitResult("t1-retention", 1.0))
    with pytest.raises(InvalidArgument) as caught:
        memory.earlier_commit("t1", "r", b"another")
    assert (caught.value.reason, caught.value.field) == ("REQUEST_ID_REUSED", "request_id")
    assert memory.earlier_commit("t1", "r", b"first") == CommitResult("t1-retention", 1.0)


def test_fingerprints_tell_every_field_apart() -> None:
    tokens = np.arange(100, dtype=np.uint32)
    plan = PlanRequest(model="m", prompt_token_ids=tokens, conversation="tenants/t/conversations/c")
    base = plan_fingerprint(plan, tokens)
    assert plan_fingerprint(plan, tokens.copy()) == base
    for other in (
        (plan, tokens[:-1]),
        (PlanRequest(model="m2", prompt_token_ids=tokens, conversation=plan.conversation), tokens),
        (
            PlanRequest(
                model="m", prompt_token_ids=tokens, conversation=plan.conversation, disable_reuse=True
            ),
            tokens,
        ),
        (
            PlanRequest(
                model="m", prompt_token_ids=tokens, conversation=plan.conversation, cache_salt_sha256=b"s"
            ),
            tokens,
        ),
        (
            PlanRequest(
                model="m", prompt_token_ids=tokens, conversation=plan.conversation, decode_endpoints=("d0",)
            ),
            tokens,
        ),
    ):
        assert plan_fingerprint(*other) != base
    commit = CommitRequest(turn="turns/x", token_ids=tokens, decode_kv_transfer_params={"remote_port": 1})
    first = commit_fingerprint(commit, tokens)
    assert commit_fingerprint(commit, tokens) == first
    assert commit_fingerprint(CommitRequest("turns/x", tokens, {"remote_port": 2}), tokens) != first
    assert commit_fingerprint(CommitRequest("turns/x", tokens, None), tokens) != first
    timed = CommitRequest("turns/x", tokens, {"remote_port": 1}, TurnTimings(ttft_ms=1.0))
    assert commit_fingerprint(timed, tokens) != first


def _plan(turn: str, block_ids: int) -> Plan:
    holder = NodeInfo(
        name="nodes/d0",
        role=NodeRole.DECODE,
        engine_id="e",
        http_endpoint="http://d0:8000",
        model="m",
        block_size=16,
        kv_bytes_per_token=1,
        healthy=True,
    )
    return Plan(
        turn=turn,
        generation=1,
        prefill=holder,
        decode=holder,
        prefill_kv_transfer_params={"do_remote_decode": True, "remote_block_ids": [list(range(block_ids))]},
        decision=Decision.REUSE,
        reason=Reason.REUSE_CHEAPER,
        reusable_tokens=16 * block_ids,
        tokens_to_compute=1,
        reuse_cost=None,
        recompute_cost=Estimate(0.0, 1.0),
        expire_at=1.0,
    )


def test_remembered_plans_are_bounded_by_bytes() -> None:
    """A plan holds prefill's block ids: 100k of large plans must not be kept by count alone."""
    memory = TurnMemory(remembered_turns=100_000, hint_bytes=1 << 20, plan_bytes=4 << 20)
    for i in range(100):
        memory.remember_plan("c", "m", f"r{i}", b"fp", _plan(f"turns/{i}", 16_384))  # ~590 KiB each
    assert memory.earlier_plan("c", "m", "r0", b"fp") is None
    assert memory.earlier_plan("c", "m", "r99", b"fp") is not None
    assert 0 < memory._plans.nbytes <= 4 << 20 and len(memory._plans) == (4 << 20) // (1024 + 8 + 36 * 16_384)


def test_held_prompts_are_bounded_by_bytes_and_let_go_when_the_turn_finishes() -> None:
    memory = TurnMemory(remembered_turns=100, hint_bytes=1 << 20, prompt_bytes=3 * (4000 + 100))
    for i in range(4):
        memory.hold_prompt(f"t{i}", np.full(1000, i, dtype=np.uint32))  # 4,000 bytes each

    assert memory.held_prompt("t0") is None  # the oldest out: three fit
    assert [int(memory.held_prompt(f"t{i}")[0]) for i in (1, 2, 3)] == [1, 2, 3]  # type: ignore[index]
    memory.finish("t2", "committed")
    assert memory.held_prompt("t2") is None
    assert (len(memory.prompts), memory.prompts.nbytes) == (2, 2 * (4000 + 100))
