"""What the gateway tests share: a tiny tokenizer made on the spot, and a cluster of a real
registry and router (in process, over gRPC) with two fake engines and the gateway in front."""

from __future__ import annotations

import json
import random
import string
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from tests.gateway.fake_engine import FakeEngine
from tests.router.helpers import MODEL, RouterEnv, heartbeat, node, seconds, start_router
from tests.support.registry_env import RegistryEnv, start_registry
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvshuttle.gateway.config import GatewaySettings, ModelSettings, RouterConnection
from kvshuttle.gateway.main import GatewayServer
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.serving.settings import TelemetrySettings
from kvshuttle.serving.tracing import configure_tracing, shutdown_tracing

# ChatML, as the reference model's template (shared/reference/make_model.py), with the block
# tags on lines of their own so trim_blocks / lstrip_blocks matter.
CHAT_TEMPLATE = """{% for m in messages %}
    {% if m['role'] == 'system' and not loop.first %}
        {{ raise_exception('the system message must come first') }}
    {% endif %}
<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
WORDS = [
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "an",
    "be", "are", "have", "it", "not", "this", "which", "or", "prefill", "decode", "cache", "block", "token",
    "request", "model", "server", "router", "memory", "latency", "transfer", "remote", "local",
]  # fmt: skip


def make_tokenizer(
    directory: Path, *, vocab: int = 1024, bos_post_processor: bool = True, added_tokens: Sequence[str] = ()
) -> Path:
    """A byte-level BPE trained on a small corpus, with the ChatML template, saved as a model
    directory (tokenizer.json + tokenizer_config.json) the way transformers saves one;
    `added_tokens` are appended as plain (not special) added tokens, as Qwen's <think>."""
    rnd = random.Random(0)
    corpus = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(5, 40))) for _ in range(2000)]
    corpus += ["".join(rnd.choice(string.printable[:95]) for _ in range(200)) for _ in range(500)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    if bos_post_processor:  # a text prompt with add_special_tokens=True starts with <s>
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def conversation_text(rnd: random.Random, words: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(words))


@dataclass
class Cluster:
    registry: RegistryEnv
    router: RouterEnv
    prefill: FakeEngine
    decode: FakeEngine
    gateway: GatewayServer
    url: str
    http: aiohttp.ClientSession
    exporter: InMemorySpanExporter
    provider: TracerProvider
    tokenizer: ChatTokenizer
    metrics: CollectorRegistry

    async def post(self, path: str, body: dict[str, Any], **headers: str) -> tuple[int, dict[str, Any]]:
        """The response, once the turn's background commit (or abort) has landed too."""
        async with self.http.post(self.url + path, json=body, headers=headers) as response:
            answer = response.status, await response.json()
        await self.gateway.gateway.settle()
        return answer

    async def stream(self, path: str, body: dict[str, Any], **headers: str) -> tuple[int, list[Any]]:
        """Every SSE event's data, JSON-decoded ("[DONE]" as the string), once the turn's
        background commit (or abort) has landed too."""
        async with self.http.post(
            self.url + path, json={**body, "stream": True}, headers=headers
        ) as response:
            raw = (await response.read()).decode()
        await self.gateway.gateway.settle()
        if response.status != 200:
            return response.status, [json.loads(raw)]
        assert raw.endswith("\n\n")
        events: list[Any] = []
        for event in raw.split("\n\n")[:-1]:
            assert event.startswith("data: "), event
            data = event[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        return 200, events

    async def retentions(self, tenant: str = "default") -> list[reg_pb.Retention]:
        request = reg_pb.ListRetentionsRequest(parent=f"tenants/{tenant}", page_size=100)
        return list((await self.registry.stub.ListRetentions(request)).retentions)


async def register(registry: RegistryEnv, name: str, role: reg_pb.NodeRole.ValueType, url: str) -> None:
    spec = node(name, role)
    spec.http_endpoint = url
    registered = await registry.stub.RegisterNode(reg_pb.RegisterNodeRequest(node=spec, ttl=seconds(300)))
    await heartbeat(registry, name, registered.node.incarnation)


async def start_cluster(
    model_dir: Path,
    tokenizer: ChatTokenizer,
    *,
    nodes: bool = True,
    router_timeout: float = 5.0,
    grace_seconds: float = 2.0,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    **overrides: Any,
) -> Cluster:
    exporter = InMemorySpanExporter()
    provider = configure_tracing(TelemetrySettings(), "kvshuttle-gateway-test", exporter=exporter)
    registry = await start_registry()
    router = await start_router(registry, tracer_provider=provider)
    engine_tok = tokenizer.tokenizer
    eos = engine_tok.token_to_id("</s>")
    assert eos is not None
    prefill = FakeEngine("prefill", "engine-p0", engine_tok, eos, side_channel_port=5600)
    # Each engine's side channel is its node's as registered (node(): 5600): the registry and
    # the router refuse retained KV whose params name another.
    decode = FakeEngine("decode", "engine-d0", engine_tok, eos, side_channel_port=5600)
    await prefill.start()
    await decode.start()
    if nodes:
        await register(registry, "nodes/p0", reg_pb.NODE_ROLE_PREFILL, prefill.url)
        await register(registry, "nodes/d0", reg_pb.NODE_ROLE_DECODE, decode.url)
    settings = GatewaySettings(
        listen="127.0.0.1:0",
        router=RouterConnection(address=f"127.0.0.1:{router.server.port}", timeout=router_timeout),
        models={
            MODEL: ModelSettings(
                tokenizer=model_dir, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser
            )
        },
        grace_seconds=grace_seconds,
        **overrides,
    )
    metrics = CollectorRegistry()
    gateway = GatewayServer(
        settings, tracer_provider=provider, metrics_registry=metrics, tokenizers={MODEL: tokenizer}
    )
    port = await gateway.start()
    http = aiohttp.ClientSession()
    url = f"http://127.0.0.1:{port}"
    return Cluster(
        registry, router, prefill, decode, gateway, url, http, exporter, provider, tokenizer, metrics
    )


async def stop_cluster(c: Cluster) -> None:
    await c.http.close()
    await c.gateway.stop()
    await c.prefill.stop()
    await c.decode.stop()
    await c.router.close()
    await c.registry.channel.close()
    c.registry.registry.close()
    await c.registry.server.stop()
    shutdown_tracing(c.provider)


async def cluster_fixture(model_dir: Path, tokenizer: ChatTokenizer, **kw: Any) -> AsyncIterator[Cluster]:
    c = await start_cluster(model_dir, tokenizer, **kw)
    try:
        yield c
    finally:
        await stop_cluster(c)


CHAT = "/v1/chat/completions"


def reference_ids(model_dir: Path, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt's ids computed independently: jinja set up as transformers' apply_chat_template
    does, then the tokenizer.json with add_special_tokens=False (vLLM's chat default)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    text = env.from_string(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
    )
    return list(
        Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    )


def first_messages(seed: int = 1) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    return [
        {"role": "system", "content": conversation_text(rnd, SYSTEM_WORDS)},
        {"role": "user", "content": "What does the router do with a retention?"},
    ]


def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, **extra}


SYSTEM_WORDS = 2500  # ~2.5k tokens: long enough that reading the KV beats recomputing it
