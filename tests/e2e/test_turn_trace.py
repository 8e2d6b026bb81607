"""One trace per turn on real vLLM (CPU build, tiny model), engines included: a prefill/decode
pair of its own started with `--otlp-traces-endpoint`, kvshuttle's services with
TELEMETRY__OTLP_ENDPOINT, both pointed at an in-process OTLP receiver (deploy/local/otlp.py).
Each turn, a recompute and a reuse, must be one trace: the gateway's turn, the router's plan,
claim and commit, the registry's calls, and vLLM's own `llm_request` span on each engine, a
child of the gateway's prefill or decode call (the `traceparent` the gateway sent), with
vLLM's timings (time in queue, time to first token, time in model prefill). The trees are
printed and kept (.run/results, or $KVSHUTTLE_RESULTS_DIR).

The same behind an Envoy-based gateway: a client that speaks ext_proc as Envoy does to
kvshuttle-epp (in process, exporting too), the request then sent with the picker's headers to the
decode pod's sidecar (in process), which runs the turn. The EPP's request span is each trace's
root: its pick (PlanTurn) and the sidecar's turn (prefill, decode, CommitTurn) under it.

The pair is this module's own, not the session's (that one exports nothing): about a minute and
a half to start here, the session's pair running beside it when earlier tests started it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from deploy.local.launch import VllmPair
from deploy.local.otlp import OtlpReceiver, receiver_in_thread
from deploy.local.stack import KvshuttleStack
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from tests.e2e.stacks import running_stack
from tests.gateway.epp.envoy import Envoy, body_chunks, request_headers
from tests.support.turn_traces import (
    EPP,
    EPP_PROCESS,
    SIDECAR,
    check_one_trace_per_turn,
    keep_trees,
    turn_traces,
)
from tests.support.turns import reference, tokens, turn
from tests.support.vllm_session import E2E_BLOCKS

from kvshuttle.client.settings import ServiceConnection
from kvshuttle.epp.config import EppSettings
from kvshuttle.epp.main import EppServer
from kvshuttle.gateway.config import ModelSettings, RouterConnection
from kvshuttle.serving.settings import ServerSettings, TelemetrySettings
from kvshuttle.sidecar.config import SidecarSettings
from kvshuttle.sidecar.main import SidecarServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINES = ("vllm-prefill", "vllm-decode")


@pytest.fixture(scope="module")
def traced(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[OtlpReceiver, VllmPair, KvshuttleStack]]:
    with pytest.MonkeyPatch.context() as env, receiver_in_thread() as receiver:
        # Each process's batch exporter sends within 0.2 s instead of 5 s (read from the
        # environment the engines and services inherit).
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        pair = VllmPair(
            vllm_model,
            log_dir=tmp_path_factory.mktemp("vllm-traced-logs"),
            block_size=32,
            prefill_prefix_caching=False,
            otlp_traces_endpoint=receiver.endpoint,
            extra_args=("--num-gpu-blocks-override", str(E2E_BLOCKS)),
        )
        with (
            pair,
            running_stack(pair, tmp_path_factory.mktemp("kvshuttle"), otlp_endpoint=receiver.endpoint) as s,
        ):
            yield receiver, pair, s


def test_each_turn_is_one_trace_with_vllms_request_spans(
    traced: tuple[OtlpReceiver, VllmPair, KvshuttleStack],
) -> None:
    receiver, pair, stack = traced
    conv = f"c-{uuid.uuid4().hex[:8]}"
    first = tokens(600, 1)
    out1, h1 = turn(stack, conv, first)
    prompt = first + out1 + tokens(100, 2)
    out2, h2 = turn(stack, conv, prompt)
    assert (h1["X-Kvshuttle-Decision"], h2["X-Kvshuttle-Decision"]) == ("recompute", "reuse")
    assert out2 == reference(pair, prompt)  # traced or not, the answer is a clean recompute's

    traces = turn_traces(receiver, conv, 2, ENGINES)
    assert len({t[0].trace_id for t in traces}) == 2
    for trace in traces:
        check_one_trace_per_turn(trace, ENGINES)
        for span in trace:
            if span.name == "llm_request":  # vLLM's own timings, as it measures them
                for key in ("time_in_queue", "time_to_first_token", "time_in_model_prefill", "e2e"):
                    assert span.attributes[f"gen_ai.latency.{key}"] >= 0, (key, span.attributes)
    reuse = traces[1]
    assert {"claim", "/kvshuttle.registry.v1.RegistryService/ClaimRetention"} <= {s.name for s in reuse}
    keep_trees("tests/e2e/test_turn_trace.py", "trace-tree-vllm", traces)


async def test_behind_envoy_each_turn_is_one_trace_from_the_pick_to_both_engines(
    traced: tuple[OtlpReceiver, VllmPair, KvshuttleStack],
) -> None:
    receiver, pair, stack = traced
    telemetry = TelemetrySettings(otlp_endpoint=receiver.endpoint)
    models = {"m": ModelSettings(tokenizer=pair.model_dir)}
    router = RouterConnection(address=stack.router_addr, token_file=stack.token_file("gateway"), timeout=5.0)
    epp = EppServer(
        metrics_registry=CollectorRegistry(),
        settings=EppSettings(
            server=ServerSettings(listen="127.0.0.1:0", grace_seconds=1),
            router=router,
            models=models,
            cache_salt_key=SecretStr(stack.cache_salt_key),
            telemetry=telemetry,
        ),
    )
    sidecar = SidecarServer(
        metrics_registry=CollectorRegistry(),
        settings=SidecarSettings(
            listen="127.0.0.1:0",
            node=f"nodes/{pair.decode.name}",
            decode_endpoint=pair.decode.url,
            router=router,
            registry=ServiceConnection(address=stack.registry_addr, token_file=stack.token_file("admin")),
            models=models,
            cache_salt_key=SecretStr(stack.cache_salt_key),
            grace_seconds=2,
            telemetry=telemetry,
        ),
    )
    envoy = Envoy(f"127.0.0.1:{await epp.start()}")
    sidecar_url = f"http://127.0.0.1:{await sidecar.start()}/v1/completions"
    session = f"s-{uuid.uuid4().hex[:8]}"
    decisions = []
    try:
        async with aiohttp.ClientSession() as http:
            prompt = tokens(600, 3)
            for _ in range(2):
                body = {
                    "model": "m",
                    "prompt": prompt,
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                out, decision = await through_envoy(envoy, http, sidecar_url, body, session)
                decisions.append(decision)
                prompt = prompt + out + tokens(100, 4)
    finally:
        await envoy.close()
        await sidecar.stop()  # both export what they buffered
        await epp.stop()
    assert decisions == ["recompute", "reuse"]

    traces = turn_traces(receiver, session, 2, ENGINES, runner=SIDECAR)
    for trace in traces:
        check_one_trace_per_turn(trace, ENGINES, runner=SIDECAR, planner=EPP, root=(EPP, EPP_PROCESS))
        (pick,) = [s for s in trace if s.name == "pick"]
        (turn,) = [s for s in trace if s.name == "turn"]
        assert turn.parent_id == pick.span_id  # the picker's traceparent, set on the request
    keep_trees("tests/e2e/test_turn_trace.py", "trace-tree-vllm-epp", traces)


async def through_envoy(
    envoy: Envoy, http: aiohttp.ClientSession, sidecar_url: str, body: dict[str, Any], session: str
) -> tuple[list[int], str]:
    """One completions request as Envoy serves it behind the picker: its ext_proc exchange,
    then the request to the picked pod's sidecar with the headers the picker set; the output
    ids and the turn's decision."""
    raw = json.dumps({**body, "return_token_ids": True}).encode()
    answers = await envoy.exchange(
        [
            request_headers("/v1/completions", extra={"x-session-id": session}),
            *body_chunks(raw, [len(raw) // 2]),
        ]
    )
    assert answers.immediate is None, answers.request
    headers = {"Content-Type": "application/json", "x-session-id": session, **answers.set_headers}
    async with http.post(sidecar_url, data=answers.body() or raw, headers=headers) as response:
        got = await response.read()
        assert response.status == 200, got[:500]
        decision = response.headers.get("X-Kvshuttle-Decision", "")
    return list(json.loads(got)["choices"][0]["token_ids"]), decision
