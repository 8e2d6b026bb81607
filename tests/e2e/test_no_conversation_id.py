"""The official OpenAI SDK as a user writes it, no `extra_body`: no conversation id, the whole
history sent as text every turn. On real vLLM (CPU build, tiny model) behind the gateway: from turn
2 on, the router finds the conversation the history continues, the gateway starts the prompt with
the previous turn's exact ids (its transcript, kept in the registry), and the turn reuses the
previous prompt and answer to the token. Every answer is compared with the same prompt ids
computed from scratch on one vLLM server."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from openai import OpenAI
from tests.e2e.stacks import running_stack
from tests.support.turns import reference

from kvshuttle.registry.v1 import registry_service_pb2 as rpb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as rpb_grpc

pytestmark = pytest.mark.vllm
TURNS = 5
SYSTEM = "You are a careful assistant for a team that runs inference servers. " * 12


@pytest.fixture(scope="module")
def stack(vllm_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvshuttleStack]:
    with running_stack(vllm_pair, tmp_path_factory.mktemp("kvshuttle")) as s:
        yield s


def test_the_sdk_without_extra_body_reuses_the_previous_prompt_and_answer(
    stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    client = OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=300)
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": "Why does reusing a conversation's KV cache shorten the time to first token?",
        },
    ]
    turns: list[tuple[int, int, str, int]] = []  # prompt tokens, answer tokens, finish, reused
    for i in range(TURNS):
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=24, temperature=0
        )
        reply = raw.parse()
        assert reply.usage is not None
        choice = reply.choices[0]
        reused = int(raw.headers["x-kvshuttle-reused-tokens"])
        turns.append((reply.usage.prompt_tokens, reply.usage.completion_tokens, choice.finish_reason, reused))
        messages += [
            {"role": "assistant", "content": choice.message.content},
            {"role": "user", "content": f"Say it again, shorter ({i})."},
        ]
    print("turns (prompt, answer, finish, reused):", turns)
    assert turns[0][3] == 0
    for (prompt, answer, _, _), (_, _, _, reused) in itertools.pairwise(turns):
        # Decode holds the KV of the prompt and the answer but its last token.
        assert reused >= 0.95 * (prompt + answer) - 32, turns

    # The conversations the router started: the last retention's transcript is the last turn's
    # prompt and answer, and every turn's prompt is a prefix of it (each spliced onto the one
    # before).
    registry = rpb_grpc.RegistryServiceStub(grpc.insecure_channel(stack.registry_addr))
    listed = registry.ListRetentions(
        rpb.ListRetentionsRequest(parent="tenants/default", page_size=100), metadata=stack.admin_metadata
    )
    # Each turn forked a conversation of its own from the one before (kvshuttle.router.fork_reads):
    # the last turn's retention is the longest.
    retention = max(listed.retentions, key=lambda r: r.num_tokens)
    assert "/conversations/anon-" in retention.name
    got = registry.GetRetention(rpb.GetRetentionRequest(name=retention.name), metadata=stack.admin_metadata)
    transcript = list(got.retention.transcript.token_ids)
    last_prompt, last_answer, last_finish, _ = turns[-1]
    assert len(transcript) == last_prompt + last_answer - (last_finish == "stop")
    for prompt, answer, finish, _ in turns:
        kept = answer - (finish == "stop")  # an EOS the answer's text lacks is not kept
        ids = transcript[:prompt]
        assert reference(vllm_pair, ids, max_tokens=answer)[:kept] == transcript[prompt : prompt + kept]
