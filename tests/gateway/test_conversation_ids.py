"""Where a request's conversation comes from: kvshuttle's own id (the body's `conversation_id`
or X-Conversation-ID), else the session id vLLM and llm-d read (the body's `session_id` or
X-Session-ID), in one precedence, with the same validation for each."""

from __future__ import annotations

from typing import Any

import pytest
from tests.gateway.helpers import Cluster, chat, first_messages
from tests.router.helpers import MODEL

from kvshuttle.gateway.errors import GatewayError
from kvshuttle.gateway.openai.protocol import conversation_id

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("body", "conversation_header", "session_header", "expected"),
    [
        ({}, None, None, None),
        ({"conversation_id": "c"}, None, None, "c"),
        ({}, "c", None, "c"),
        ({"conversation_id": "c"}, "c", None, "c"),
        ({"session_id": "s"}, None, None, "s"),
        ({}, None, "s", "s"),
        ({"session_id": "s"}, None, "s", "s"),
        # kvshuttle's own id wins over a session id sent for another hop.
        ({"conversation_id": "c", "session_id": "s"}, None, "s", "c"),
        ({}, "c", "s", "c"),
        ({"conversation_id": 42}, None, None, "42"),
        ({"session_id": 7}, None, None, "7"),
        ({"vllm_xargs": {"session_id": "x"}}, None, None, "x"),
        ({"vllm_xargs": {"session_id": "x"}}, None, "s", "s"),
        ({"vllm_xargs": {"other": 1}}, None, None, None),
        # Empty is absent.
        ({"conversation_id": ""}, None, "s", "s"),
        ({}, "", "", None),
    ],
)
def test_the_conversation_comes_from_one_precedence(
    body: dict[str, Any], conversation_header: str | None, session_header: str | None, expected: str | None
) -> None:
    assert conversation_id(body, conversation_header, session_header) == expected


@pytest.mark.parametrize(
    ("body", "conversation_header", "session_header", "field"),
    [
        ({"conversation_id": "a"}, "b", None, "conversation_id"),
        ({"session_id": "a"}, None, "b", "session_id"),
        ({"session_id": ["a"]}, None, None, "session_id"),
        ({"conversation_id": True}, None, None, "conversation_id"),
        ({}, None, "bad id!", "session_id"),
        ({"session_id": "x" * 129}, None, None, "session_id"),
        ({}, "bad/id", "fine", "conversation_id"),
        ({"vllm_xargs": {"session_id": "no way"}}, None, None, "vllm_xargs.session_id"),
    ],
)
def test_a_bad_or_contradicting_id_is_refused_naming_its_field(
    body: dict[str, Any], conversation_header: str | None, session_header: str | None, field: str
) -> None:
    with pytest.raises(GatewayError) as caught:
        conversation_id(body, conversation_header, session_header)
    assert (caught.value.status, caught.value.param) == (400, field)


@pytest.mark.parametrize(
    ("extra", "headers"),
    [({"session_id": "sess-1"}, {}), ({}, {"X-Session-ID": "sess-1"}), ({}, {"x-session-id": "sess-1"})],
)
async def test_a_session_id_alone_makes_the_request_a_conversation_turn(
    c: Cluster, extra: dict[str, Any], headers: dict[str, str]
) -> None:
    messages = first_messages()
    status, body = await c.post(CHAT, chat(messages, **extra), **headers)
    assert status == 200, body
    (stored,) = await c.retentions()
    assert stored.name.startswith("tenants/default/conversations/sess-1/retentions/")
    # Neither the gateway's own field nor vLLM's is forwarded to the engines.
    for request in (*c.prefill.transcript.requests, *c.decode.transcript.requests):
        assert "session_id" not in request.body and request.body["model"] == MODEL
