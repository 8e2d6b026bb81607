"""Tenants never share KV: the gateway sends prefill and decode a cache salt of the tenant's own
(vLLM's prefix cache never shares blocks across salts), and the router a digest of it, from which
kvshuttle's chains start (a retention verifies only for the same tenant and salt). And no log
line of a turn, in the gateway, the router or the registry, names a conversation id."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from pydantic import SecretStr, ValidationError
from tests.gateway.helpers import (
    CHAT,
    Cluster,
    chat,
    cluster_fixture,
    first_messages,
    reference_ids,
    start_cluster,
    stop_cluster,
)
from tests.router.helpers import BS, MODEL
from tests.serving.echo import JsonLog

from kvshuttle.core.digest import log_digest, log_name
from kvshuttle.core.hashing import cache_salt_digest, chain_hashes, salted_root
from kvshuttle.gateway.config import GatewaySettings, ModelSettings
from kvshuttle.gateway.prompts.salts import CacheSalts
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.serving.logging import configure_logging
from kvshuttle.serving.settings import TelemetrySettings

COMPLETIONS = "/v1/completions"
SALT_KEY = "gateway-salt-key-0123456789abcdef"
ACME = {"Authorization": "Bearer sk-acme-0123456789"}
GLOBEX = {"Authorization": "Bearer sk-globex-0123456789"}
SALTS = CacheSalts(SALT_KEY.encode())


def keyed_settings() -> dict[str, Any]:
    keys = {"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"}
    return {"api_keys": SecretStr(json.dumps(keys)), "cache_salt_key": SecretStr(SALT_KEY)}


@pytest.fixture
async def keyed(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[Cluster]:
    async for cluster in cluster_fixture(model_dir, chat_tokenizer, **keyed_settings()):
        yield cluster


def completion(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": text, "max_tokens": 16, **extra}


async def first_block_hash(c: Cluster, tenant: str) -> int:
    (retention,) = await c.retentions(tenant)
    return int(retention.block_hashes[0])


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_and_decode_get_the_tenants_salt_and_the_router_its_digest(
    keyed: Cluster, path: str, stream: bool
) -> None:
    words = " ".join(["the cache block moves"] * 40)
    body = (
        chat(first_messages(), conversation_id="c-1")
        if path == CHAT
        else completion(words, conversation_id="c-1")
    )
    send = keyed.stream if stream else keyed.post
    for n, headers in enumerate((ACME, GLOBEX)):
        status, _ = await send(path, body, **headers)
        assert status == 200
        p, d = keyed.prefill.transcript.requests[n].body, keyed.decode.transcript.requests[n].body
        tenant = "acme" if headers is ACME else "globex"
        salt = SALTS.salt(tenant)
        assert p["cache_salt"] == d["cache_salt"] == salt
        assert len(salt) == 43 and not set(salt) & set("@/\\\x00")  # what vLLM accepts
        # The retention chains from the salt's root: the router got the salt's SHA-256.
        root = salted_root(cache_salt_digest(salt))
        assert await first_block_hash(keyed, tenant) == chain_hashes(p["prompt"][:BS], BS, parent=root)[0]
    # The same tokens, two tenants: two salts, two chains.
    assert (
        keyed.prefill.transcript.requests[0].body["prompt"]
        == keyed.prefill.transcript.requests[1].body["prompt"]
    )
    assert (
        keyed.prefill.transcript.requests[0].body["cache_salt"]
        != keyed.prefill.transcript.requests[1].body["cache_salt"]
    )
    assert await first_block_hash(keyed, "acme") != await first_block_hash(keyed, "globex")


async def test_a_clients_salt_partitions_its_tenants_cache_and_is_never_forwarded(
    keyed: Cluster, model_dir: Path
) -> None:
    messages = first_messages()
    status, body = await keyed.post(CHAT, chat(messages, conversation_id="c-2", cache_salt="user-7"), **ACME)
    assert status == 200
    salt = keyed.prefill.transcript.requests[0].body["cache_salt"]
    assert salt == keyed.decode.transcript.requests[0].body["cache_salt"] == SALTS.salt("acme", "user-7")
    assert salt not in (SALTS.salt("acme"), "user-7") and "user-7" not in json.dumps(
        keyed.prefill.transcript.requests[0].body
    )
    following = [*messages, body["choices"][0]["message"], {"role": "user", "content": "And then?"}]

    # Another client salt in the same conversation: the retained KV was computed under another
    # salt, and kvshuttle's chain says so (no reuse; vLLM's own cache would miss too).
    async with keyed.http.post(
        keyed.url + CHAT, json=chat(following, conversation_id="c-2", cache_salt="user-8"), headers=ACME
    ) as response:
        assert response.status == 200
        assert (response.headers["X-Kvshuttle-Decision"], response.headers["X-Kvshuttle-Reason"]) == (
            "recompute",
            "prefix_mismatch",
        )
    await keyed.gateway.gateway.settle()
    # Superseded, the retention is released: prefill is told to read none of it (its holder
    # frees the blocks); nothing computed under the other salt reaches this turn.
    params = keyed.prefill.transcript.requests[1].body["kv_transfer_params"]
    assert (params["do_remote_decode"], params["do_remote_prefill"], params["remote_num_tokens"]) == (
        True,
        False,
        0,
    )
    # The same salt again: the next turn reuses.
    second = keyed.decode.transcript.answers[1]
    again = [
        *following,
        {"role": "assistant", "content": keyed.decode.script.answer},
        {"role": "user", "content": "Ok?"},
    ]
    async with keyed.http.post(
        keyed.url + CHAT, json=chat(again, conversation_id="c-2", cache_salt="user-8"), headers=ACME
    ) as response:
        assert response.status == 200
        assert response.headers["X-Kvshuttle-Decision"] == "reuse", dict(response.headers)
    await keyed.gateway.gateway.settle()
    assert reference_ids(model_dir, again)[:BS] == keyed.prefill.transcript.requests[2].body["prompt"][:BS]
    assert second["kv_transfer_params"]["remote_engine_id"] == "engine-d0"


@pytest.mark.parametrize("bad", ["", "a/b", "tenant@x", "x" * 129, 7, ["s"]])
async def test_a_salt_vllm_would_refuse_is_a_400(keyed: Cluster, bad: Any) -> None:
    status, body = await keyed.post(CHAT, chat(first_messages(), cache_salt=bad), **ACME)
    assert status == 400 and body["error"]["param"] == "cache_salt"
    assert keyed.prefill.transcript.requests == []


def test_salts_are_per_tenant_per_key_and_per_client_salt() -> None:
    other = CacheSalts(b"another-key-0123456789")
    salts = {
        SALTS.salt("acme"),
        SALTS.salt("globex"),
        SALTS.salt("acme", "u1"),
        SALTS.salt("acme", "u2"),
        other.salt("acme"),
    }
    assert len(salts) == 5
    assert SALTS.salt("acme") == CacheSalts(SALT_KEY.encode()).salt("acme")  # the same on every replica
    with pytest.raises(ValueError):
        CacheSalts(b"short")


def test_the_salt_key_is_a_secret_of_at_least_16_bytes(model_dir: Path) -> None:
    models = {MODEL: ModelSettings(tokenizer=model_dir)}
    settings = GatewaySettings(models=models, cache_salt_key=SecretStr(SALT_KEY))
    assert SALT_KEY not in repr(settings) and SALT_KEY not in str(settings.model_dump())
    with pytest.raises(ValidationError) as err:
        GatewaySettings(models=models, cache_salt_key=SecretStr("short-key"))
    assert "short-key" not in str(err.value)
    assert GatewaySettings(models=models).cache_salt_key is None  # a random key per process, warned


# ---- conversation ids stay out of the logs ----------------------------------------------------

CONVERSATION_ID = "conv-7f3e-very-private"


class DebugJsonLog(JsonLog):
    """Every process's log (structlog and stdlib) as JSON lines, debug level included."""

    def __init__(self) -> None:
        self._buffer = io.StringIO()
        configure_logging(TelemetrySettings(log_format="json", log_level="debug"), stream=self._buffer)

    def text(self) -> str:
        return self._buffer.getvalue()


async def test_no_log_line_of_a_turn_names_its_conversation(
    model_dir: Path, chat_tokenizer: ChatTokenizer
) -> None:
    """A full conversation through the real registry and router and the gateway (stand-in engines):
    a recompute, a reuse (claim, release, put), a streamed turn and an aborted one."""
    log = DebugJsonLog()
    c = await start_cluster(model_dir, chat_tokenizer, **keyed_settings())
    try:
        messages = first_messages()
        status, body = await c.post(CHAT, chat(messages, conversation_id=CONVERSATION_ID), **ACME)
        assert status == 200
        messages += [body["choices"][0]["message"], {"role": "user", "content": "And then?"}]
        status, _ = await c.stream(CHAT, chat(messages, conversation_id=CONVERSATION_ID), **ACME)
        assert status == 200
        messages += [
            {"role": "assistant", "content": c.decode.script.answer},
            {"role": "user", "content": "Ok."},
        ]
        c.decode.script.fail_status = 500  # this turn aborts, releasing its claim
        status, _ = await c.post(CHAT, chat(messages, conversation_id=CONVERSATION_ID), **ACME)
        assert status == 502
    finally:
        await stop_cluster(c)
        text = log.text()
        lines = log.events()
        log.close()
        structlog.reset_defaults()

    conversation = f"tenants/acme/conversations/{CONVERSATION_ID}"
    assert CONVERSATION_ID not in text
    for salt in {r.body["cache_salt"] for r in c.prefill.transcript.requests}:
        assert salt not in text  # nor the engines' salts
    # The lines still join: the gateway's digest is the one inside the names the router and the
    # registry log.
    done = [e for e in lines if e.get("event") == "request.done"]
    assert [e["reason"] for e in done] == ["no_retention", "reuse_cheaper", "reuse_cheaper"]
    assert {e["conversation"] for e in done} == {log_digest(conversation)}
    rpcs = {
        (e.get("method"), e.get("conversation") or e.get("retention"))
        for e in lines
        if e.get("event") == "rpc.done"
    }
    assert ("PlanTurn", log_name(conversation)) in rpcs
    assert ("ClaimRetention", log_name(f"{conversation}/retentions/1")) in rpcs
    assert ("PutRetention", log_name(f"{conversation}/retentions/2")) in rpcs
    assert ("CommitTurn", log_name(f"{conversation}/retentions/2")) in rpcs
    committed = [e for e in lines if e.get("event") == "turn.committed"]
    assert [e["retention"] for e in committed] == [log_name(f"{conversation}/retentions/{g}") for g in (1, 2)]
    assert any(
        e.get("event") == "turn.aborted" and e["claimed"] == log_name(f"{conversation}/retentions/2")
        for e in lines
    )
