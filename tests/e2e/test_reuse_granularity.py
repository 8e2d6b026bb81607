"""Reuse to the token on real vLLM (CPU build, tiny model), every answer compared with a clean
recompute of the same ids on one server:

- a chat whose previous answer comes back unchanged is spliced onto decode's generated ids
  (exact-token history), so decode's whole KV verifies and is reused up to its last token;
- a verified prefix that ends inside a block is cut there: prefill reads that block whole and
  computes from `remote_num_tokens` on, overwriting the block's unverified slots;
- a history that departs from the previous answer inside one of its full blocks (a re-rendered
  tool call) is cut at the departure too: that block's later slots hold KV of decode's tokens.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from tests.e2e.stacks import running_stack

pytestmark = pytest.mark.vllm
BS = 32


@pytest.fixture(scope="module")
def stack(vllm_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvshuttleStack]:
    with running_stack(vllm_pair, tmp_path_factory.mktemp("kvshuttle")) as s:
        yield s


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            return json.loads(response.read()), response.headers
    except urllib.error.HTTPError as err:
        raise AssertionError(f"{url}: {err.code} {err.read()[:500]!r}") from None


GREEDY = {"model": "m", "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def reference(pair: VllmPair, prompt: list[int], max_tokens: int) -> list[int]:
    """The same ids on one server, computed from scratch (a fresh cache salt: no cache hit)."""
    body, _ = post(
        f"{pair.decode.url}/v1/completions",
        {**GREEDY, "prompt": prompt, "max_tokens": max_tokens, "cache_salt": uuid.uuid4().hex},
    )
    return list(body["choices"][0]["token_ids"])


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["cache", "block", "token", "decode", "prefill", "lease"]) for _ in range(n))


def test_an_unchanged_answer_is_spliced_and_its_kv_reused_to_the_last_token(
    stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    conv = f"c-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": words(400, 1)}]
    url = f"{stack.gateway_url}/v1/chat/completions"
    first, _ = post(url, {**GREEDY, "messages": messages, "max_tokens": 40, "conversation_id": conv})
    answer = first["choices"][0]
    prompt1, out1 = first["prompt_token_ids"], answer["token_ids"]
    assert out1 == reference(vllm_pair, prompt1, 40)

    messages += [{"role": "assistant", "content": answer["message"]["content"]}]
    messages += [{"role": "user", "content": words(80, 2)}]
    second, headers = post(url, {**GREEDY, "messages": messages, "max_tokens": 24, "conversation_id": conv})
    prompt2 = second["prompt_token_ids"]
    # The prompt carries decode's generated ids, not a re-tokenization of their text...
    assert prompt2[: len(prompt1) + len(out1)] == prompt1 + out1
    # ...so the whole retention verifies: reused up to decode's last sampled token.
    assert (headers["X-Kvshuttle-Decision"], headers["X-Kvshuttle-Reason"]) == ("reuse", "reuse_cheaper")
    reused = int(headers["X-Kvshuttle-Reused-Tokens"])
    assert reused == len(prompt1) + len(out1) - 1
    assert reused % BS  # not a block boundary here: the last block is partly verified
    assert second["choices"][0]["token_ids"] == reference(vllm_pair, prompt2, 24)

    # An answer edited by one byte is never spliced: tokenized from its text as usual.
    content = answer["message"]["content"]
    edited = [
        *messages[:-2],
        {"role": "assistant", "content": content[:-1] + ("x" if content[-1:] != "x" else "y")},
    ]
    other = f"c-{uuid.uuid4().hex[:8]}"
    post(url, {**GREEDY, "messages": messages[:1], "max_tokens": 40, "conversation_id": other})
    third, _ = post(url, {**GREEDY, "messages": edited, "max_tokens": 8, "conversation_id": other})
    plain, _ = post(url, {**GREEDY, "messages": edited, "max_tokens": 8})
    assert third["prompt_token_ids"] == plain["prompt_token_ids"]  # the chat's own tokenization


@pytest.mark.parametrize("cut", [1010, 1000, 993], ids=["mid-block", "near-block-start", "one-past-block"])
def test_a_prefix_verified_inside_a_block_is_cut_at_its_last_token(
    stack: KvshuttleStack, vllm_pair: VllmPair, cut: int
) -> None:
    rng = random.Random(cut)
    first = [rng.randrange(10, 2000) for _ in range(1000)]
    conv = f"c-{uuid.uuid4().hex[:8]}"
    url = f"{stack.gateway_url}/v1/completions"
    body, _ = post(url, {**GREEDY, "prompt": first, "max_tokens": 24, "conversation_id": conv})
    held = first + body["choices"][0]["token_ids"]  # decode holds KV of held[:-1]: 1023 tokens
    # The history diverges at `cut`, inside decode's partly filled last block (992..1023) or
    # just past its start: the block's slots from `cut` on hold KV of other tokens.
    prompt = held[:cut] + [rng.randrange(10, 2000) for _ in range(100)]
    assert prompt[cut] != held[cut]
    body, headers = post(url, {**GREEDY, "prompt": prompt, "max_tokens": 24, "conversation_id": conv})
    assert headers["X-Kvshuttle-Decision"] == "reuse"
    assert int(headers["X-Kvshuttle-Reused-Tokens"]) == cut
    assert int(headers["X-Kvshuttle-Prefill-Cached-Tokens"]) == cut  # prefill read exactly that
    assert body["choices"][0]["token_ids"] == reference(vllm_pair, prompt, 24)


@pytest.mark.parametrize(
    "at", [1003, 1040, 1056], ids=["prompt-end-block", "mid-full-answer-block", "full-block-start"]
)
def test_a_history_departing_inside_a_full_answer_block_is_cut_at_the_departure(
    stack: KvshuttleStack, vllm_pair: VllmPair, at: int
) -> None:
    rng = random.Random(at)
    first = [rng.randrange(10, 2000) for _ in range(1000)]
    conv = f"c-{uuid.uuid4().hex[:8]}"
    url = f"{stack.gateway_url}/v1/completions"
    body, _ = post(url, {**GREEDY, "prompt": first, "max_tokens": 100, "conversation_id": conv})
    held = first + body["choices"][0]["token_ids"]  # decode holds KV of held[:-1]: 1099 tokens
    # Blocks 992..1023, 1024..1055 and 1056..1087 are full, and hold the answer (the first of
    # them also the prompt's end): one token of the answer edited there, the rest as it was.
    edit = held[at] + 1 if held[at] < 2000 else held[at] - 1
    prompt = [*held[:at], edit, *held[at + 1 :], *(rng.randrange(10, 2000) for _ in range(40))]
    body, headers = post(url, {**GREEDY, "prompt": prompt, "max_tokens": 24, "conversation_id": conv})
    assert headers["X-Kvshuttle-Decision"] == "reuse"
    assert int(headers["X-Kvshuttle-Reused-Tokens"]) == at
    assert int(headers["X-Kvshuttle-Prefill-Cached-Tokens"]) == at  # prefill read exactly that
    assert body["choices"][0]["token_ids"] == reference(vllm_pair, prompt, 24)
