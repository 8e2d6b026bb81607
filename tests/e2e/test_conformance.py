"""The emulator (bench/emulator, profile-timed by cpu-small) against real vLLM: the same scripted
conversations (bench/conformance.py's) through kvshuttle on the session's real pair and on a
stand-in pair configured like it (its model's tokenizer, block size 32, prefix caching off on P).
Equal: the `kv_transfer_params` shapes, the KV events each engine publishes (as kvshuttle's
agent decodes them), kvshuttle's decision, reason and token counts per turn; each answer equals
its own engines' clean recompute. TTFT is bench/conformance.py's (not timed here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from bench.conformance import (
    CPU_SMALL,
    MAX_TOKENS,
    Turn,
    event_sequence,
    event_tap,
    exchange_params,
    run_script,
    shape,
)
from bench.emulator.http.launcher import StandinPair
from deploy.local.engine_pair import EnginePair
from deploy.local.launch import VllmPair
from tests.e2e.stacks import running_stack
from tests.support.turns import reference

pytestmark = pytest.mark.vllm
BS = 32


@dataclass
class Observed:
    turns: list[Turn]
    events: dict[str, list[tuple[Any, ...]]]
    params: dict[str, dict[str, Any]]


def _observe(pair: EnginePair, work: Path, recompute: Callable[[list[int]], list[int]]) -> Observed:
    """The script through a fresh stack on `pair` with its engines' events tapped; then the clean
    recomputes (after the tap: a reference on real vLLM publishes events too) and a direct P/D
    exchange of params."""
    with running_stack(pair, work) as stack, event_tap(pair) as tap:
        turns = run_script(stack)
        events = {name: event_sequence(got) for name, got in tap.drain().items()}
    for t in turns:
        t.answer_ok = t.answer == recompute(t.prompt)
    return Observed(turns, events, exchange_params(pair))


@pytest.fixture(scope="module")
def real(vllm_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> Observed:
    assert vllm_pair.prefill.spec.block_size == BS and not vllm_pair.prefill.spec.prefix_caching
    return _observe(
        vllm_pair,
        tmp_path_factory.mktemp("conformance-real"),
        lambda prompt: reference(vllm_pair, prompt, MAX_TOKENS),
    )


@pytest.fixture(scope="module")
def emulated(vllm_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    work = tmp_path_factory.mktemp("conformance-emulated")
    pair = StandinPair(
        vllm_pair.model_dir, log_dir=work / "engines", block_size=BS, profile=CPU_SMALL,
        prefill_prefix_caching=False,
    )  # fmt: skip
    with pair:
        yield _observe(pair, work / "stack", lambda prompt: pair.expected(prompt, MAX_TOKENS))


def test_kv_transfer_params_have_the_same_shapes(real: Observed, emulated: Observed) -> None:
    assert {k: shape(v) for k, v in emulated.params.items()} == {k: shape(v) for k, v in real.params.items()}
    for params in (*real.params.values(), *emulated.params.values()):
        # One list of block ids (one KV-cache group), a block per started 32 tokens.
        (blocks,) = params["remote_block_ids"]
        assert len(blocks) == -(-params["remote_num_tokens"] // BS), params


def test_kv_events_are_the_same_sequence(real: Observed, emulated: Observed) -> None:
    assert emulated.events == real.events
    assert real.events["decode"], "decode published no events: the tap saw nothing"


def test_kvshuttle_decides_the_same_per_turn(real: Observed, emulated: Observed) -> None:
    got = [(t.conversation, t.index, t.decisions()) for t in emulated.turns]
    assert got == [(t.conversation, t.index, t.decisions()) for t in real.turns]
    decisions = {(t.decision, t.reason) for t in real.turns}
    assert ("reuse", "reuse_cheaper") in decisions and ("recompute", "no_retention") in decisions


def test_each_answer_equals_its_own_clean_recompute(real: Observed, emulated: Observed) -> None:
    for observed in (real, emulated):
        assert [t.answer_ok for t in observed.turns] == [True] * len(observed.turns)
