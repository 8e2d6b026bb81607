"""One trace per turn on real vLLM (CPU build, tiny model), engines included: a prefill/decode
pair of its own started with `--otlp-traces-endpoint`, kvshuttle's services with
TELEMETRY__OTLP_ENDPOINT, both pointed at an in-process OTLP receiver (deploy/local/otlp.py).
Each turn, a recompute and a reuse, must be one trace: the gateway's turn, the router's plan,
claim and commit, the registry's calls, and vLLM's own `llm_request` span on each engine, a
child of the gateway's prefill or decode call (the `traceparent` the gateway sent), with
vLLM's timings (time in queue, time to first token, time in model prefill). The trees are
printed and kept (.run/results, or $KVSHUTTLE_RESULTS_DIR).

The pair is this module's own, not the session's (that one exports nothing): about a minute and
a half to start here, the session's pair running beside it when earlier tests started it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy.local.launch import VllmPair
from deploy.local.otlp import OtlpReceiver, receiver_in_thread
from deploy.local.stack import KvshuttleStack
from tests.e2e.stacks import running_stack
from tests.support.turn_traces import check_one_trace_per_turn, keep_trees, turn_traces
from tests.support.turns import reference, tokens, turn
from tests.support.vllm_session import E2E_BLOCKS

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
