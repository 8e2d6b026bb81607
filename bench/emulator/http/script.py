"""What a test scripts on a stand-in engine it runs in its own process (bench/emulator/http/engine.py),
and what the engine records for it to read back. A stand-in run as a process (bench, the local
stack) has the default script, which changes nothing, and records nothing.

    engine = StandinEngine(in_process_config("decode", "engine-d0", model_dir),
                           script=Script(answer="The block moves."), record=True)
    await engine.start()
    engine.script.fail_status = 503          # the next request fails
    engine.transcript.requests[-1].body      # what the last request sent
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from bench.emulator.http.completions import Answer, apply_stops


@dataclass
class Script:
    """Answers and faults, read on every request (so a test may change them between requests)."""

    # Answer this text's tokens, then EOS, instead of the KV-derived tokens (the text is cut only
    # at an explicit `max_tokens`; prefill answers its first token). The KV is kept as usual.
    answer: str | None = None
    # Answer every request with this HTTP status and vLLM's error body.
    fail_status: int | None = None
    # Stream: an error event (then `[DONE]`) in place of the output piece of this index.
    fail_after_tokens: int | None = None
    # Seconds before answering at all.
    delay: float = 0.0
    # Stream: seconds between chunks, on top of the configured per-token time.
    token_delay: float = 0.0
    # Stream: the finish chunk carries kv_transfer_params (vLLM 0.33, or 0.32 with kvshuttle's
    # plugin); False: vLLM 0.32 without it (the blocks are still held).
    stream_params: bool = True
    # False: an engine without the NIXL connector (kv_transfer_params ignored, none answered).
    kv_connector: bool = True


@dataclass
class Recorded:
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class Transcript:
    """What the engine was asked and answered, in order, when `recording`; and whether a client
    went away before the end of its answer (vLLM then aborts the request)."""

    recording: bool = False
    requests: list[Recorded] = field(default_factory=list)
    # Per answered completion: the output `token_ids` and the `kv_transfer_params` (None: none).
    answers: list[dict[str, Any]] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    finished_streams: int = 0

    def request(self, body: dict[str, Any], headers: dict[str, str]) -> None:
        if self.recording:
            self.requests.append(Recorded(body, headers))

    def answer(self, token_ids: list[int], params: dict[str, Any] | None) -> None:
        if self.recording:
            self.answers.append({"token_ids": token_ids, "kv_transfer_params": params})


def eos_id(model_dir: Path, tokenizer: Tokenizer) -> int | None:
    """The model's EOS token id (tokenizer_config.json's `eos_token`), if it names one."""
    path = model_dir / "tokenizer_config.json"
    eos = json.loads(path.read_text()).get("eos_token") if path.exists() else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return tokenizer.token_to_id(eos) if isinstance(eos, str) else None


def scripted_answer(
    text: str, tokenizer: Tokenizer, eos: int | None, limit: int | None, stops: list[str]
) -> Answer:
    """What a model that says exactly `text` answers: its tokens (each piece's text as the
    detokenizer adds it) then EOS, cut at `limit` tokens ("length") or ended by EOS ("stop"),
    and vLLM's stop strings."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    texts = [tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])) :] for i in range(len(ids))]
    if eos is not None:
        ids, texts = [*ids, eos], [*texts, ""]
    ends = eos is not None and (limit is None or limit >= len(ids))
    return apply_stops(ids[:limit], texts[:limit], stops, "stop" if ends else "length")
