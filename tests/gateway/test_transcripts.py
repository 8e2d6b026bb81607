"""One exact history for every gateway replica: a turn's transcript (its prompt and answer ids)
is kept with its retention in the registry, so the next request of the conversation, on another
replica, with or without a conversation id, starts with decode's own ids and reuses through the
answer; another tenant sending the same history finds nothing. Real registry and router over
gRPC, stand-in engines, two gateway servers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs
from tests.gateway.helpers import CHAT, Cluster, chat, cluster_fixture, first_messages

from kvshuttle.gateway.main import GatewayServer
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer


class Replica:
    """A second gateway server over the cluster's router, with the same settings."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.server = GatewayServer(
            c.gateway.settings,
            tracer_provider=c.provider,
            metrics_registry=CollectorRegistry(),
            tokenizers={name: c.tokenizer for name in c.gateway.settings.models},
        )
        self.url = ""

    async def start(self) -> None:
        self.url = f"http://127.0.0.1:{await self.server.start()}"

    async def post(self, url: str, body: dict[str, Any], **headers: str) -> dict[str, Any]:
        """The answer as a client gets it: no waiting for anything after its end."""
        async with self.c.http.post(url + CHAT, json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            return dict(await response.json())


@pytest.fixture
async def salted(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[Cluster]:
    """Replicas share their cache salt key, as a deployment's do (else each salts its own)."""
    async for cluster in cluster_fixture(model_dir, chat_tokenizer, cache_salt_key="k" * 32):
        yield cluster


@pytest.fixture
async def replica(salted: Cluster) -> AsyncIterator[Replica]:
    r = Replica(salted)
    await r.start()
    try:
        yield r
    finally:
        await r.server.stop()


def lines(logs: list[Any]) -> list[Any]:
    return [entry for entry in logs if entry.get("event") == "request.done"]


@pytest.mark.parametrize("conversation", [{}, {"conversation_id": "conv-r"}])
async def test_another_replica_reuses_through_the_answer(
    salted: Cluster, replica: Replica, conversation: dict[str, str]
) -> None:
    c = salted
    messages = first_messages()
    body = await replica.post(c.url, chat(messages, **conversation))  # replica A: c's own gateway
    first_prompt = c.prefill.transcript.requests[0].body["prompt"]
    answer_ids = c.decode.transcript.answers[0]["token_ids"][:-1]  # EOS: not in the answer's text
    following = [*messages, body["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    with capture_logs() as logs:
        await replica.post(replica.url, chat(following, **conversation))  # replica B, at once
    await replica.server.gateway.settle()
    (line,) = lines(logs)
    assert line["decision"] == "reuse", json.dumps(dict(line))
    assert line["reused_tokens"] >= (len(first_prompt) + len(answer_ids)) // 16 * 16
    prompt = c.prefill.transcript.requests[1].body["prompt"]
    assert prompt[: len(first_prompt) + len(answer_ids)] == [*first_prompt, *answer_ids]


@pytest.fixture
async def keyed(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[Cluster]:
    keys = json.dumps({"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"})
    async for cluster in cluster_fixture(model_dir, chat_tokenizer, api_keys=keys):
        yield cluster


async def test_no_tenant_finds_another_tenants_history(keyed: Cluster) -> None:
    c = keyed
    acme, globex = (
        {"Authorization": "Bearer sk-acme-0123456789"},
        {"Authorization": "Bearer sk-globex-0123456789"},
    )
    messages = first_messages()
    status, body = await c.post(CHAT, chat(messages), **acme)
    assert status == 200
    following = [*messages, body["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    with capture_logs() as logs:
        status, _ = await c.post(CHAT, chat(following), **globex)
    assert status == 200
    (line,) = lines(logs)
    # Globex's history is its own: a new conversation of its own, nothing found, nothing read.
    assert (line["decision"], line["reason"], line["reused_tokens"]) == ("recompute", "no_retention", 0)
    (mine,) = await c.retentions("acme")
    assert mine.generation == 1 and mine.state != 2  # acme's retention: unclaimed, untouched
    (theirs,) = await c.retentions("globex")
    assert theirs.name.split("/")[3] != mine.name.split("/")[3]
    # Acme's own next turn still finds it.
    with capture_logs() as logs:
        status, _ = await c.post(CHAT, chat(following), **acme)
    (line,) = lines(logs)
    assert line["decision"] == "reuse"
