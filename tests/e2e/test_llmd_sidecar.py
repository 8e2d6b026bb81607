"""kvshuttle behind an Envoy-based gateway with llm-d's P/D protocol, on real vLLM (CPU build,
tiny model with a Hermes-style template): a client that speaks ext_proc to kvshuttle-epp as
Envoy does (tests.gateway.epp.envoy: FULL_DUPLEX_STREAMED, the body in chunks), the request
then sent where the pick says with the headers the picker set, to kvshuttle-sidecar in front of
the decode engine, which runs the planned turn on prefill and decode and commits it.

A 10-turn agent session with tool calls (half of them streamed): every later turn reuses
decode's KV on prefill (D->P), and every answer equals the same request on one vLLM server from
a clean cache (a fresh cache salt: a recompute). Then llm-d's own protocol on the same pair: a
request with only `x-prefiller-host-port` served P->D as llm-d's sidecar serves it, and a request
with no header served by decode alone, both answering as vLLM does.

The figures (reuse per turn) are printed; run with -s to see them.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from tests.e2e.agent_loop import TOOLS, calls, no_free_whitespace, streamed_message
from tests.e2e.stacks import running_stack
from tests.gateway.epp.envoy import Envoy, body_chunks, request_headers
from tests.support.turns import reference

from kvshuttle.client.settings import ServiceConnection
from kvshuttle.core.endpoints import endpoint_host_port
from kvshuttle.epp.config import EppSettings
from kvshuttle.epp.main import EppServer
from kvshuttle.gateway.config import ModelSettings, RouterConnection
from kvshuttle.gateway.pd_headers import PREFILLER_HOST_PORT_HEADER
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.serving.settings import ServerSettings
from kvshuttle.sidecar.config import SidecarSettings
from kvshuttle.sidecar.main import SidecarServer

pytestmark = pytest.mark.vllm

CHAT = "/v1/chat/completions"
TURNS = 10


@pytest.fixture(scope="module")
def stack(vllm_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvshuttleStack]:
    with running_stack(vllm_pair, tmp_path_factory.mktemp("kvshuttle-llmd")) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(vllm_model: Path) -> ChatTokenizer:
    return ChatTokenizer.load("m", ModelSettings(tokenizer=vllm_model), verify_fraction=0.0)


class Front:
    """The EPP and the decode pod's sidecar, in process, as an InferencePool runs them."""

    def __init__(self, stack: KvshuttleStack, pair: VllmPair) -> None:
        model = {"m": ModelSettings(tokenizer=pair.model_dir, tool_call_parser="hermes")}
        router = RouterConnection(
            address=stack.router_addr, token_file=stack.token_file("gateway"), timeout=5.0
        )
        self.metrics = CollectorRegistry()
        self.epp = EppServer(
            metrics_registry=CollectorRegistry(),
            settings=EppSettings(
                server=ServerSettings(listen="127.0.0.1:0", grace_seconds=1),
                router=router,
                models=model,
                cache_salt_key=SecretStr(stack.cache_salt_key),
            ),
        )
        self.sidecar = SidecarServer(
            metrics_registry=self.metrics,
            settings=SidecarSettings(
                listen="127.0.0.1:0",
                node=f"nodes/{pair.decode.name}",
                decode_endpoint=pair.decode.url,
                router=router,
                # ListNodes needs nodes.read: the stack's admin identity (a viewer in production).
                registry=ServiceConnection(address=stack.registry_addr, token_file=stack.token_file("admin")),
                models=model,
                cache_salt_key=SecretStr(stack.cache_salt_key),
                grace_seconds=2,
            ),
        )
        self.decode_endpoint = endpoint_host_port(pair.decode.url)
        self.envoy: Envoy | None = None
        self.sidecar_url = ""

    async def start(self) -> None:
        self.envoy = Envoy(f"127.0.0.1:{await self.epp.start()}")
        self.sidecar_url = f"http://127.0.0.1:{await self.sidecar.start()}"

    async def stop(self) -> None:
        if self.envoy is not None:
            await self.envoy.close()
        await self.sidecar.stop()
        await self.epp.stop()

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.get_sample_value(name, labels) or 0.0

    async def route(self, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, dict[str, str], bytes]:
        """What Envoy does with the picker's answer: the sidecar of the picked decode pod, the
        request's headers with the picker's set and removed, the body as it streamed back."""
        assert self.envoy is not None
        raw = json.dumps(body).encode()
        answers = await self.envoy.exchange(
            [request_headers(CHAT, extra=headers), *body_chunks(raw, [len(raw) // 3, 2 * len(raw) // 3])]
        )
        assert answers.immediate is None, answers.request
        # The pick is the decode node; its pod's sidecar serves it (the pool's target port).
        assert answers.endpoint == self.decode_endpoint, answers.endpoint
        sent = {k: v for k, v in headers.items() if k.lower() not in answers.removed}
        sent.update(answers.set_headers)
        return self.sidecar_url + CHAT, sent, answers.body() or raw


@pytest.fixture
async def front(stack: KvshuttleStack, vllm_pair: VllmPair) -> AsyncIterator[Front]:
    f = Front(stack, vllm_pair)
    await f.start()
    try:
        yield f
    finally:
        await f.stop()


async def post(
    http: aiohttp.ClientSession, url: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[dict[str, Any], str | None, dict[str, str]]:
    """A chat request, streamed or not: the assistant message, finish reason and headers."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    stream = json.loads(data).get("stream", False)
    async with http.post(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    ) as r:
        raw = await r.read()
        assert r.status == 200, (url, r.status, raw[:800])
        got = {k.lower(): v for k, v in r.headers.items()}
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["message"], choice["finish_reason"], got
    events = [
        json.loads(line[6:])
        for line in raw.decode().splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert raw.decode().rstrip().endswith("data: [DONE]")
    message, finish = streamed_message(events)
    return message, finish, got


async def test_an_agent_session_through_epp_and_sidecar_reuses_every_later_turn_and_answers_as_a_recompute(
    front: Front, vllm_pair: VllmPair, tokenizer: ChatTokenizer
) -> None:
    session = f"agent-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Call one tool at a time."},
        {"role": "user", "content": "The cache tests fail after the block-size change; find out why."},
    ]
    choices: list[Any] = [
        {"type": "function", "function": {"name": "read_file"}},
        "required",
        {"type": "function", "function": {"name": "run_tests"}},
    ]
    no_whitespace = no_free_whitespace(tokenizer)
    figures: list[dict[str, Any]] = []
    previous_prompt = 0
    async with aiohttp.ClientSession() as http:
        for turn in range(1, TURNS + 1):
            body = {
                "model": "m",
                "messages": messages,
                "tools": TOOLS,
                "tool_choice": choices[(turn - 1) % len(choices)],
                "parallel_tool_calls": False,
                "max_tokens": 96,
                "temperature": 0,
                "logit_bias": no_whitespace,
                "stream": turn % 2 == 0,
            }
            # The reference: decode alone, from a clean cache (a fresh salt), as vLLM answers.
            reference = {**body, "cache_salt": uuid.uuid4().hex}
            ref_message, ref_finish, _ = await post(http, vllm_pair.decode.url + CHAT, reference)
            # llm-d's session affinity header names the conversation for the EPP and the sidecar.
            url, headers, forwarded = await front.route(body, {"x-session-id": session})
            message, finish, got = await post(http, url, forwarded, headers)

            assert calls(message) == calls(ref_message), (turn, message, ref_message)
            assert len(calls(message)) == 1, (turn, message)
            assert (message.get("content") or "") == (ref_message.get("content") or ""), turn
            assert finish == ref_finish, turn
            prompt = int(got["x-kvshuttle-prompt-tokens"])
            reused = int(got["x-kvshuttle-reused-tokens"])
            figures.append(
                {
                    "turn": turn,
                    "stream": body["stream"],
                    "decision": got["x-kvshuttle-decision"],
                    "prompt_tokens": prompt,
                    "reused_tokens": reused,
                    "prefill_cached_tokens": int(got.get("x-kvshuttle-prefill-cached-tokens", "0")),
                    "equal_to_recompute": True,
                }
            )
            if turn > 1:
                # The history verifies against decode's KV up to where the previous answer's
                # re-rendered call departs from decode's text, past the previous prompt's end.
                assert got["x-kvshuttle-decision"] == "reuse", (turn, got)
                assert reused >= previous_prompt - 1, (turn, reused, previous_prompt)
            previous_prompt = prompt
            call = message["tool_calls"][0]
            messages.append(
                {
                    "role": "assistant",
                    "content": message.get("content") or None,
                    "tool_calls": [{"id": call["id"], "type": "function", "function": call["function"]}],
                }
            )
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": f"result {turn}: " + "ok " * 40}
            )
    print("\nllm-d sidecar session:", json.dumps(figures, indent=1))
    later = figures[1:]
    reused, prompts = sum(f["reused_tokens"] for f in later), sum(f["prompt_tokens"] for f in later)
    reuse_turns = sum(f["decision"] == "reuse" for f in later)
    print(f"reuse on {reuse_turns}/{len(later)} later turns; {reused}/{prompts} prompt tokens reused")


@pytest.mark.parametrize("stream", [False, True])
async def test_llmd_plain_p_to_d_and_pass_through_answer_as_vllm_does(
    front: Front, vllm_pair: VllmPair, stream: bool
) -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "Explain how a KV cache block moves between two engines. " * 6}
        ],
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    prefill = endpoint_host_port(vllm_pair.prefill.url)
    assert prefill is not None
    async with aiohttp.ClientSession() as http:
        ref, ref_finish, _ = await post(
            http, vllm_pair.decode.url + CHAT, {**body, "cache_salt": uuid.uuid4().hex}
        )
        llmd, llmd_finish, _ = await post(
            http, front.sidecar_url + CHAT, body, {PREFILLER_HOST_PORT_HEADER: prefill}
        )
        local, local_finish, _ = await post(
            http, front.sidecar_url + CHAT, {**body, "cache_salt": uuid.uuid4().hex}
        )
    assert (llmd["content"], llmd_finish) == (ref["content"], ref_finish)
    assert (local["content"], local_finish) == (ref["content"], ref_finish)
    assert front.metric("kvshuttle_sidecar_requests_total", mode="llmd") == 1
    assert front.metric("kvshuttle_sidecar_requests_total", mode="local") == 1
    assert front.metric("kvshuttle_sidecar_ssrf_refused_total", target="prefill") == 0


@pytest.mark.parametrize("session", [True, False], ids=["x-session-id", "no-id"])
async def test_a_chat_through_epp_and_sidecar_reuses_through_the_previous_answer(
    front: Front, vllm_pair: VllmPair, session: bool
) -> None:
    """A plain chat, its history sent back as text, with llm-d's session header or none at all:
    the picker and the sidecar both start each prompt with the previous turn's transcript
    (decode's own ids, from the registry), so every later turn reuses the previous prompt and
    answer but the last token, and answers as the same ids computed from scratch."""
    headers = {"x-session-id": f"chat-{uuid.uuid4().hex[:8]}"} if session else {}
    messages: list[dict[str, Any]] = [
        {
            "role": "system",
            "content": "You are a careful assistant for a team that runs inference servers. " * 8,
        },
        {"role": "user", "content": f"Why does reusing KV shorten the time to first token? ({session})"},
    ]
    figures: list[tuple[int, int, int]] = []
    async with aiohttp.ClientSession() as http:
        for turn in range(4):
            body = {
                "model": "m",
                "messages": messages,
                "max_tokens": 24,
                "temperature": 0,
                "return_token_ids": True,
            }
            url, sent, forwarded = await front.route(body, headers)
            async with http.post(
                url, data=forwarded, headers={"Content-Type": "application/json", **sent}
            ) as r:
                assert r.status == 200, await r.text()
                answer = json.loads(await r.read())
                reused = int(r.headers["x-kvshuttle-reused-tokens"])
            prompt, output = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
            ref = reference(vllm_pair, prompt, max_tokens=len(output))
            assert ref[: len(output)] == output, turn  # the same ids computed from scratch
            figures.append((len(prompt), len(output), reused))
            messages += [
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"Say it again, shorter ({turn})."},
            ]
    print(f"\npicker + sidecar, {'x-session-id' if session else 'no id'} (prompt, answer, reused):", figures)
    assert front.metric("kvshuttle_sidecar_plain_total", why="prompt_mismatch") == 0
    for (prompt, answer, _), (_, _, reused) in itertools.pairwise(figures):
        # Decode holds the KV of the prompt and the answer but its last token.
        assert reused >= prompt + answer - 1 - 32, figures
