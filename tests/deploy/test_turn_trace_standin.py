"""One trace per turn over stand-in engines (no vLLM): kvshuttle's real services and the
stand-ins (which send vLLM's `llm_request` span, bench/emulator/http/tracing.py) all export to an
in-process OTLP receiver; each turn, a recompute and a reuse, is one trace whose engine spans
are children of the gateway's prefill and decode calls, so the `traceparent` reached the
engines. The real-vLLM counterpart is tests/e2e/test_turn_trace.py."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench.emulator.http.launcher import StandinPair
from bench.emulator.http.tokenizer import make_tokenizer
from deploy.local.otlp import OtlpReceiver, receiver_in_thread
from deploy.local.stack import KvshuttleStack
from tests.e2e.stacks import PROFILE
from tests.support.turn_traces import check_one_trace_per_turn, keep_trees, turn_traces
from tests.support.turns import turn

pytestmark = pytest.mark.slow  # real processes: the engines and kvshuttle's services
ENGINES = ("standin-prefill", "standin-decode")


def tokens(n: int, seed: int) -> list[int]:
    """Ids within the stand-in tokenizer's vocabulary (past its special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


@pytest.fixture
def traced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[OtlpReceiver, KvshuttleStack]]:
    # Every process's batch exporter sends within 0.2 s instead of 5 s (the SDK reads it from
    # the environment the stack's processes inherit).
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    model_dir = make_tokenizer(tmp_path / "model")
    with receiver_in_thread() as receiver:
        pair = StandinPair(
            model_dir,
            log_dir=tmp_path / "engines",
            prefill_prefix_caching=False,
            otlp_traces_endpoint=receiver.endpoint,
        )
        with pair:
            stack = KvshuttleStack(
                pair,
                work_dir=tmp_path / "kvshuttle",
                profile=PROFILE,
                kv_bytes_per_token=PROFILE["kv_bytes_per_token"],
                otlp_endpoint=receiver.endpoint,
            )
            stack.start()
            try:
                yield receiver, stack
            finally:
                codes = stack.stop()
            assert all(code == 0 for code in codes.values()), (codes, stack.work_dir)


def test_each_turn_is_one_trace_with_the_engines_spans(traced: tuple[OtlpReceiver, KvshuttleStack]) -> None:
    receiver, stack = traced
    conv = f"c-{uuid.uuid4().hex[:8]}"
    first = tokens(600, 1)
    out, h1 = turn(stack, conv, first)
    _, h2 = turn(stack, conv, first + out + tokens(80, 2))
    assert (h1["X-Kvshuttle-Decision"], h2["X-Kvshuttle-Decision"]) == ("recompute", "reuse")

    traces = turn_traces(receiver, conv, 2, ENGINES)
    assert len({t[0].trace_id for t in traces}) == 2  # a trace per turn, not one per conversation
    for trace in traces:
        check_one_trace_per_turn(trace, ENGINES)
    # The reuse turn's router claimed the retention in the registry, inside the same trace.
    assert {"claim", "/kvshuttle.registry.v1.RegistryService/ClaimRetention"} <= {s.name for s in traces[1]}
    keep_trees("tests/deploy/test_turn_trace_standin.py", "trace-tree-standin", traces)
