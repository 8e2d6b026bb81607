"""What the gateway tests share: a cluster of a real registry and router (in process, over
gRPC) with two stand-in engines (bench/emulator, in process, scripted and recorded) and the
gateway in front."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import jinja2
import jinja2.ext
from bench.emulator.http.config import in_process_config
from bench.emulator.http.engine import StandinEngine
from bench.emulator.http.script import Script
from bench.emulator.http.tokenizer import CHAT_TEMPLATE, WORDS
from jinja2.sandbox import ImmutableSandboxedEnvironment
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from tests.router.helpers import BS, MODEL, RouterEnv, heartbeat, node, seconds, start_router
from tests.support.registry_env import RegistryEnv, start_registry
from tokenizers import Tokenizer

from kvshuttle.gateway.config import GatewaySettings, ModelSettings, RouterConnection
from kvshuttle.gateway.main import GatewayServer
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.serving.settings import TelemetrySettings
from kvshuttle.serving.tracing import configure_tracing, shutdown_tracing

# What decode answers (then EOS) unless a test scripts another answer.
ANSWER = " The cache block moves from decode to prefill and back."


def conversation_text(rnd: random.Random, words: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(words))


@dataclass
class Cluster:
    registry: RegistryEnv
    router: RouterEnv
    prefill: StandinEngine
    decode: StandinEngine
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


async def register(
    registry: RegistryEnv, name: str, role: reg_pb.NodeRole.ValueType, engine: StandinEngine
) -> None:
    """The engine's node, with its side channel: the registry and the router refuse retained KV
    whose params name another."""
    spec = node(name, role)
    spec.engine_id = engine.config.engine_id
    spec.http_endpoint = engine.url
    spec.side_channel_port = engine.side_channel_port
    registered = await registry.stub.RegisterNode(reg_pb.RegisterNodeRequest(node=spec, ttl=seconds(300)))
    await heartbeat(registry, name, registered.node.incarnation)


def standin(role: Literal["prefill", "decode"], model_dir: Path) -> StandinEngine:
    """engine-p0 or engine-d0, answering `ANSWER` at once. Prefill without a prefix cache, as
    the reuse benchmarks run vLLM: what it reports read (`remote_prefill_cached_tokens`) is
    then what it read of decode's retained KV."""
    config = in_process_config(
        role,
        f"engine-{role[0]}0",
        model_dir,
        served_model_name=MODEL,
        block_size=BS,
        num_blocks=16384,
        prefix_caching=role == "decode",
    )
    return StandinEngine(config, script=Script(answer=ANSWER), record=True)


async def start_cluster(
    model_dir: Path,
    tokenizer: ChatTokenizer,
    *,
    nodes: bool = True,
    router_timeout: float = 5.0,
    grace_seconds: float = 2.0,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    export: bool = True,
    **overrides: Any,
) -> Cluster:
    """`export` False: the services' provider has no exporter (production without an OTLP
    endpoint), so `exporter` stays empty."""
    exporter = InMemorySpanExporter()
    provider = configure_tracing(
        TelemetrySettings(), "kvshuttle-gateway-test", exporter=exporter if export else None
    )
    registry = await start_registry()
    router = await start_router(registry, tracer_provider=provider)
    prefill, decode = standin("prefill", model_dir), standin("decode", model_dir)
    await prefill.start()
    await decode.start()
    if nodes:
        await register(registry, "nodes/p0", reg_pb.NODE_ROLE_PREFILL, prefill)
        await register(registry, "nodes/d0", reg_pb.NODE_ROLE_DECODE, decode)
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
