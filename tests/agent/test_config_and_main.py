"""The agent's settings from the environment, its metrics parsing, and the `kvshuttle-agent`
process itself: it registers, and on SIGTERM deregisters and exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import grpc
import pytest
from pydantic import ValidationError
from tests.agent.engine_fakes import VLLM_METRICS, FakeEngineHttp
from tests.agent.helpers import NODE, eventually
from tests.support.registry_env import RegistryEnv

from kvshuttle.agent.config import AgentSettings
from kvshuttle.agent.engine import parse_vllm_metrics
from kvshuttle.registry.v1 import registry_service_pb2 as rpb

NODE_ENV = {
    "KVSHUTTLE_AGENT_NODE__NAME": "agent-0",
    "KVSHUTTLE_AGENT_NODE__ROLE": "decode",
    "KVSHUTTLE_AGENT_NODE__ENGINE_ID": "engine-a",
    "KVSHUTTLE_AGENT_NODE__HTTP_ENDPOINT": "http://127.0.0.1:8000/",
    "KVSHUTTLE_AGENT_NODE__MODEL": "tiny-llama",
    "KVSHUTTLE_AGENT_NODE__BLOCK_SIZE": "32",
    "KVSHUTTLE_AGENT_NODE__KV_BYTES_PER_TOKEN": "4096",
}


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        **NODE_ENV,
        "KVSHUTTLE_AGENT_NODE__LABELS": '{"zone": "a"}',
        "KVSHUTTLE_AGENT_REGISTRY__ADDRESS": "registry:50051",
        "KVSHUTTLE_AGENT_EVENTS__ENDPOINT": "tcp://127.0.0.1:5557",
        "KVSHUTTLE_AGENT_EVENTS__TOPIC": "kv-events",
        "KVSHUTTLE_AGENT_LEASE__TTL": "30",
        "KVSHUTTLE_AGENT_SERVER__GRACE_SECONDS": "2",
    }.items():
        monkeypatch.setenv(key, value)
    settings = AgentSettings()  # type: ignore[call-arg]
    assert settings.node.name == NODE  # "nodes/" added
    assert settings.node.http_endpoint == "http://127.0.0.1:8000"
    assert settings.node.labels == {"zone": "a"}
    assert settings.registry.address == "registry:50051"
    assert (settings.events.endpoint, settings.events.replay_endpoint) == ("tcp://127.0.0.1:5557", None)
    assert (settings.lease.ttl, settings.lease.heartbeat_interval) == (30.0, 2.0)
    assert settings.server.listen == "127.0.0.1:50071"  # kept under a partial override
    assert settings.server.grace_seconds == 2.0
    assert settings.advertised_endpoint(50071) == "127.0.0.1:50071"
    monkeypatch.setenv("KVSHUTTLE_AGENT_SERVER__LISTEN", "0.0.0.0:50071")
    assert AgentSettings().advertised_endpoint(50071) == ""  # type: ignore[call-arg]
    monkeypatch.setenv("KVSHUTTLE_AGENT_NODE__AGENT_ENDPOINT", "10.0.0.7:50071")
    assert AgentSettings().advertised_endpoint(50071) == "10.0.0.7:50071"  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("KVSHUTTLE_AGENT_NODE__NAME", "bad name"),
        ("KVSHUTTLE_AGENT_NODE__ROLE", "router"),
        ("KVSHUTTLE_AGENT_NODE__HTTP_ENDPOINT", "127.0.0.1:8000"),
        ("KVSHUTTLE_AGENT_NODE__BLOCK_SIZE", "0"),
        ("KVSHUTTLE_AGENT_LEASE__HEARTBEAT_INTERVAL", "4"),  # not under ttl / 3
        ("KVSHUTTLE_AGENT_EVENTS__MAX_BATCHES_PER_REPORT", "1000"),  # over the registry's limit
    ],
)
def test_bad_settings_fail_at_startup(monkeypatch: pytest.MonkeyPatch, key: str, value: str) -> None:
    for k, v in NODE_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError):
        AgentSettings()  # type: ignore[call-arg]


def test_node_settings_are_required(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError):
        AgentSettings()  # type: ignore[call-arg]


def test_vllm_metrics_parsing() -> None:
    metrics = parse_vllm_metrics(VLLM_METRICS)
    assert (metrics.running_requests, metrics.waiting_requests) == (3, 5)
    assert metrics.kv_cache_usage == pytest.approx(0.4583333333333333)
    # A data-parallel server: one label set per engine; counts add up, usage is the mean.
    dp = VLLM_METRICS + "\n".join(
        [
            'vllm:num_requests_running{engine="1",model_name="tiny-llama"} 1.0',
            'vllm:num_requests_waiting{engine="1",model_name="tiny-llama"} 0.0',
            'vllm:kv_cache_usage_perc{engine="1",model_name="tiny-llama"} 0.0416666666666667',
            "",
        ]
    )
    dp = dp.replace("# HELP python_gc", "# HELP python_gc")  # families may interleave: still parsed
    both = parse_vllm_metrics(dp)
    assert (both.running_requests, both.waiting_requests) == (4, 5)
    assert both.kv_cache_usage == pytest.approx(0.25)
    # vLLM before the V1 rename; out-of-range values are clamped (the registry wants 0..1).
    old = parse_vllm_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 1.5\n')
    assert (old.running_requests, old.waiting_requests, old.kv_cache_usage) == (None, None, 1.0)
    assert parse_vllm_metrics("") == parse_vllm_metrics("# nothing here\n")
    nan = parse_vllm_metrics('vllm:kv_cache_usage_perc{engine="0"} NaN\n')
    assert nan.kv_cache_usage is None
    with pytest.raises(ValueError):
        parse_vllm_metrics("vllm:num_requests_running{engine= 3\n")
    with pytest.raises(ValueError):  # no load family in it: the whole text is parsed
        parse_vllm_metrics("this is { not prometheus")
    # With them, only their lines are parsed: a broken line of another family goes unseen.
    assert parse_vllm_metrics(VLLM_METRICS + "vllm:other_total{engine= 3\n") == metrics


async def test_the_process_registers_and_deregisters_on_sigterm(registry_env: RegistryEnv) -> None:
    engine = FakeEngineHttp()
    await engine.start()
    env = {
        **os.environ,
        **NODE_ENV,
        "KVSHUTTLE_AGENT_NODE__HTTP_ENDPOINT": engine.url,
        "KVSHUTTLE_AGENT_SERVER__LISTEN": "127.0.0.1:0",
        "KVSHUTTLE_AGENT_REGISTRY__ADDRESS": registry_env.address,
        "KVSHUTTLE_AGENT_LEASE__HEARTBEAT_INTERVAL": "0.1",
        "KVSHUTTLE_AGENT_ENGINE__POLL_INTERVAL": "0.1",
        "KVSHUTTLE_AGENT_TELEMETRY__LOG_FORMAT": "json",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvshuttle.agent.main",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:

        async def healthy_node() -> bool:
            try:
                node = (await registry_env.stub.GetNode(rpb.GetNodeRequest(name=NODE))).node
            except grpc.aio.AioRpcError:
                return False
            return node.load.engine_healthy and node.load.running_requests == 3

        await eventually(healthy_node, within=60, what="the agent process's registration")
        process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), 20)
        assert process.returncode == 0, output.decode()
        events = [json.loads(line).get("event") for line in output.splitlines() if line.startswith(b"{")]
        assert "lease.deregistered" in events
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await registry_env.stub.GetNode(rpb.GetNodeRequest(name=NODE))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await engine.stop()


def test_an_agent_without_a_pool_needs_no_nixl() -> None:
    """NIXL's wheels are installed apart (--no-deps); an agent that parks nothing must not
    need them: NIXL is imported only where a pool is configured."""
    code = (
        "import sys; sys.modules['nixl'] = sys.modules['nixl._api'] = None\n"
        "import kvshuttle.agent.main, kvshuttle.agent.agent, kvshuttle.agent.servicer\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
