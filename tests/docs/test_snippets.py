"""What the docs tell a reader to run runs: every marked block of README.md and docs/
(tests/docs/snippets.py). The OpenAI SDK snippets and the curl line run against a real gateway
over a real router and registry with stand-in engines; the CLI session against a real registry;
the kustomize renders with the venv's kubectl. The only changes made to a snippet are the
addresses and model name it documents, swapped for the test stack's (and each must be there)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from bench.emulator.http.tokenizer import make_tokenizer
from deploy.kubernetes.check import kubectl
from tests.docs.snippets import KINDS, ROOT, Snippet, snippets
from tests.gateway.helpers import Cluster, start_cluster, stop_cluster
from tests.router.helpers import MODEL
from tests.support.cli_runner import arun_cli
from tests.support.registry_env import start_registry

from kvshuttle.gateway.config import ModelSettings
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer

# What the docs name: make up's gateway and model, the registry's default address.
DOC_BASE_URL = "http://127.0.0.1:8080/v1"
DOC_MODEL = '"m"'
DOC_REGISTRY = "127.0.0.1:50051"


def test_every_mark_is_known_and_every_kind_is_used() -> None:
    found = snippets()
    assert {s.kind for s in found} == set(KINDS), [(s.kind, s.source) for s in found]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    model_dir = make_tokenizer(tmp_path / "model")
    tokenizer = ChatTokenizer.load(MODEL, ModelSettings(tokenizer=model_dir), verify_fraction=1.0)
    c = await start_cluster(model_dir, tokenizer)
    try:
        yield c
    finally:
        await stop_cluster(c)


def _for_the_stack(code: str, cluster: Cluster) -> str:
    assert DOC_BASE_URL in code and DOC_MODEL in code, "the snippet names make up's gateway and model"
    return code.replace(DOC_BASE_URL, cluster.url + "/v1").replace(DOC_MODEL, json.dumps(MODEL))


@pytest.mark.parametrize("snippet", snippets("sdk"), ids=lambda s: s.source)
async def test_sdk_snippet_runs_and_its_conversation_is_retained(cluster: Cluster, snippet: Snippet) -> None:
    code = _for_the_stack(snippet.code, cluster)
    printed: list[tuple[Any, ...]] = []
    namespace = {"print": lambda *args: printed.append(args), "__name__": "__snippet__"}
    # The SDK is synchronous: it runs on a thread while this loop serves the stack. From the
    # repository's root, as the docs say (a snippet may read README.md).
    await asyncio.to_thread(exec, compile(code, snippet.source, "exec"), namespace)
    await cluster.gateway.gateway.settle()
    assert printed, "the snippet prints what the gateway answered"
    conversations = set(re.findall(r'"conversation_id": "([^"]+)"', snippet.code))
    assert conversations
    retained = {r.name.split("/")[3] for r in await cluster.retentions()}
    assert conversations <= retained
    # A snippet that runs turns in a loop prints (turn, prompt_tokens, cached_tokens) per turn:
    # the first reads nothing, the second reads the first turn's KV from decode.
    turns = [p for p in printed if len(p) == 3 and all(isinstance(x, int) for x in p)]
    assert bool(turns) == ("for turn in" in snippet.code), printed
    if turns:
        assert [t[0] for t in turns] == [1, 2]
        assert turns[0][2] == 0
        assert 0 < turns[1][2] < turns[1][1]


@pytest.mark.parametrize("snippet", snippets("curl"), ids=lambda s: s.source)
async def test_curl_line_is_a_turn(cluster: Cluster, snippet: Snippet) -> None:
    """The curl line's request, sent as curl would send it (its URL, header and body), answers
    with the turn's headers."""
    (argv,) = snippet.commands()
    assert argv[0] == "curl" and "-sD" in argv, argv
    url = next(a for a in argv if a.startswith(DOC_BASE_URL))
    header = argv[argv.index("-H") + 1]
    body = argv[argv.index("-d") + 1]
    name, value = (part.strip() for part in header.split(":", 1))
    request = json.loads(body)
    assert request["model"] == "m"
    request["model"] = MODEL
    path = url.removeprefix(DOC_BASE_URL.removesuffix("/v1"))
    async with cluster.http.post(
        cluster.url + path, data=json.dumps(request), headers={name: value}
    ) as response:
        assert response.status == 200, await response.text()
        assert response.headers["X-Kvshuttle-Decision"] == "recompute"  # a first turn
        answer = await response.json()
    assert answer["choices"][0]["message"]["content"]
    await cluster.gateway.gateway.settle()
    assert request["conversation_id"] in {r.name.split("/")[3] for r in await cluster.retentions()}


@pytest.mark.parametrize("snippet", snippets("cli"), ids=lambda s: s.source)
async def test_cli_session_runs_against_a_registry(snippet: Snippet) -> None:
    env = await start_registry()
    try:
        for argv in snippet.commands():
            assert argv[0] == "kvshuttle", argv
            assert DOC_REGISTRY in argv, "each command names the registry's default address"
            args = [env.address if a == DOC_REGISTRY else a for a in argv[1:]]
            result = await arun_cli(args)
            assert result.exit_code == 0, (argv, result.stderr)
            assert result.stdout.strip(), argv
            assert "Traceback" not in result.stdout + result.stderr
    finally:
        await env.channel.close()
        env.registry.close()
        await env.server.stop()


@pytest.mark.k8s
@pytest.mark.parametrize("snippet", snippets("kustomize"), ids=lambda s: s.source)
def test_kustomize_commands_render(snippet: Snippet) -> None:
    for argv in snippet.commands():
        assert argv[:2] == ["kubectl", "kustomize"], argv
        done = subprocess.run(
            [kubectl(), *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
        assert "kind: Deployment" in done.stdout or "kind: StatefulSet" in done.stdout
