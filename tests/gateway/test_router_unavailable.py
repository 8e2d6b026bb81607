"""The gateway over HTTP with its router gone (the router's server stopped: connections refused,
as after a SIGKILL): turns are still served, plain P->D on the last placement, and say so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from structlog.testing import capture_logs
from tests.gateway.helpers import Cluster, cluster_fixture
from tests.router.helpers import MODEL

from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer

CHAT = "/v1/chat/completions"
FIRST_TURN_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def chat(content: str, conversation: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "conversation_id": conversation,
    }


async def post(c: Cluster, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with c.http.post(c.url + CHAT, json=body) as response:
        answer = response.status, await response.json(), dict(response.headers)
    await c.gateway.gateway.settle()
    return answer


async def test_a_stopped_router_leaves_turns_served_plain_pd_with_the_reason_said(c: Cluster) -> None:
    status, _, headers = await post(c, chat("hello there", "conv-r"))
    assert status == 200 and headers["X-Kvshuttle-Reason"] == "no_retention"
    retained = await c.retentions()

    await c.router.server.stop()
    with capture_logs() as logs:
        status, body, headers = await post(c, chat("and again", "conv-r"))

    assert status == 200, body
    assert body["choices"][0]["message"]["content"]
    assert (headers["X-Kvshuttle-Decision"], headers["X-Kvshuttle-Reason"]) == (
        "recompute",
        "router_unavailable",
    )
    assert c.prefill.transcript.requests[-1].body["kv_transfer_params"] == FIRST_TURN_PARAMS
    assert len(c.decode.transcript.requests) == 2
    (done,) = [e for e in logs if e["event"] == "request.done"]
    assert (done["status"], done["decision"], done["reason"], done["outcome"]) == (
        200,
        "recompute",
        "router_unavailable",
        "ok",
    )
    # Nothing was committed (no router to commit to): the registry holds what turn 1 left.
    assert not [e for e in logs if e["event"] in ("turn.commit_failed", "turn.abort_failed")]
    assert [r.name for r in await c.retentions()] == [r.name for r in retained]


async def test_a_router_never_reached_is_503(model_dir: Path, chat_tokenizer: ChatTokenizer) -> None:
    async for c in cluster_fixture(model_dir, chat_tokenizer):
        await c.router.server.stop()
        status, body, _ = await post(c, chat("hello", "conv-n"))
        assert status == 503 and body["error"]["type"] == "server_error"
        assert c.prefill.transcript.requests == []
