"""Extend on the holder, on real vLLM (CPU build, tiny model): the router sends a short turn on a
long history to the decode engine that holds the conversation's KV, which computes only the new
tokens (its prefix cache serves the rest: vLLM reports them as cached), answers what a clean
recompute answers, and keeps the turn's KV for the next turn, which prefill then reads over NIXL.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from tests.e2e.stacks import DEAR_LINK, EXTEND_ENV, running_stack
from tests.support.turns import post, reference, tokens

pytestmark = pytest.mark.vllm
BS = 32
OUT = 24


@pytest.fixture(scope="module")
def stack(vllm_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvshuttleStack]:
    work = tmp_path_factory.mktemp("kvshuttle-extend")
    with running_stack(vllm_pair, work, extra_env={"router": EXTEND_ENV}, profile=DEAR_LINK) as s:
        yield s


def gateway_turn(stack: KvshuttleStack, conversation: str, prompt: list[int]) -> tuple[list[int], Any, Any]:
    """One greedy turn through the gateway: output ids, usage and the response's headers."""
    body, headers = post(
        f"{stack.gateway_url}/v1/completions",
        {"model": "m", "prompt": prompt, "max_tokens": OUT, "temperature": 0, "ignore_eos": True,
         "return_token_ids": True, "conversation_id": conversation},
    )  # fmt: skip
    return list(body["choices"][0]["token_ids"]), body["usage"], headers


def test_a_short_turn_extends_on_its_holder_computing_only_the_new_tokens(
    stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    conv = f"c-{uuid.uuid4().hex[:8]}"
    first = tokens(600, 11)
    out1, _, h1 = gateway_turn(stack, conv, first)
    assert (h1["X-Kvshuttle-Decision"], h1["X-Kvshuttle-Reason"]) == ("recompute", "no_retention")

    prompt = first + out1 + tokens(40, 12)
    out2, usage, h2 = gateway_turn(stack, conv, prompt)
    assert (h2["X-Kvshuttle-Decision"], h2["X-Kvshuttle-Reason"]) == ("extend", "extend_cheaper")
    held = (len(first) + len(out1) - 1) // BS * BS  # decode's full blocks of the last turn
    assert int(h2["X-Kvshuttle-Reused-Tokens"]) == held
    # Decode ran the turn and found the history in its own prefix cache: it computed the rest.
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["prompt_tokens_details"]["cached_tokens"] == held
    assert "X-Kvshuttle-Prefill-Cached-Tokens" not in h2  # no prefill request at all
    assert out2 == reference(vllm_pair, prompt, OUT)

    # The extend turn's KV is the conversation's retention: a long next turn (too long to
    # prefill on the holder) reads it from decode over NIXL, and answers right.
    prompt3 = prompt + out2 + tokens(400, 13)
    out3, _, h3 = gateway_turn(stack, conv, prompt3)
    assert (h3["X-Kvshuttle-Decision"], h3["X-Kvshuttle-Reason"]) == ("reuse", "reuse_cheaper")
    assert int(h3["X-Kvshuttle-Reused-Tokens"]) == len(prompt) + len(out2) - 1
    assert int(h3["X-Kvshuttle-Prefill-Cached-Tokens"]) > 0
    assert out3 == reference(vllm_pair, prompt3, OUT)


def test_an_edited_history_extends_only_over_what_verifies(
    stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    conv = f"c-{uuid.uuid4().hex[:8]}"
    first = tokens(640, 14)
    out1, _, _ = gateway_turn(stack, conv, first)
    edited = first.copy()
    edited[500] = (edited[500] + 1) % 2000 + 10
    prompt = edited + out1 + tokens(20, 15)
    out2, usage, h2 = gateway_turn(stack, conv, prompt)
    # The holder's cache holds the unedited blocks too; vLLM's block hashes stop matching at
    # the edit's block, and so does the router's verified prefix.
    assert h2["X-Kvshuttle-Decision"] == "extend"
    assert int(h2["X-Kvshuttle-Reused-Tokens"]) == 500 // BS * BS
    assert usage["prompt_tokens_details"]["cached_tokens"] == 500 // BS * BS
    assert out2 == reference(vllm_pair, prompt, OUT)
