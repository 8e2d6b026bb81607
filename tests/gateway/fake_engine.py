"""A stand-in for one vLLM engine's `/v1/completions`, for the HTTP protocol only: it records
every request and answers the way vLLM 0.32 with the NixlConnector does (see the research
notes): prefill answers `kv_transfer_params` with `do_remote_prefill: true`, decode keeps its
blocks (`do_remote_decode: true`, `remote_num_tokens = prompt + output - 1`) when it got
params, a text stop string aborts the request (no params), the streamed finish chunk carries
the params only where the engine sends them (0.33, or 0.32 with the kvshuttle plugin), and
`return_token_ids` puts the ids on every choice. Real-vLLM tests live with the launcher.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from tokenizers import Tokenizer

BS = 16


@dataclass
class Recorded:
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakeEngine:
    role: str  # "prefill" or "decode"
    engine_id: str
    tokenizer: Tokenizer
    eos_id: int
    answer: str = " The cache block moves from decode to prefill and back."
    # Stream: the finish chunk carries kv_transfer_params (vLLM 0.33 / the 0.32 plugin).
    stream_params: bool = True
    # Answer every request with this HTTP status and a vLLM error body.
    fail_status: int | None = None
    # Stream: an error event after this many tokens.
    fail_after_tokens: int | None = None
    # Stream: seconds between chunks.
    token_delay: float = 0.0
    # Seconds before answering at all.
    delay: float = 0.0
    side_channel_port: int = 5600
    # False: answer kv_transfer_params null (an engine without the NIXL connector).
    return_params: bool = True
    requests: list[Recorded] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    # Set when a streaming client (the gateway) went away before the end.
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    finished_streams: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None
    _next_block: int = 1

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def blocks(self, tokens: int) -> list[list[int]]:
        count = -(-tokens // BS)
        ids = list(range(self._next_block, self._next_block + count))
        self._next_block += count
        return [ids]

    def _params(self, prompt: list[int], output: int, request_id: str, got: dict[str, Any]) -> dict[str, Any]:
        if self.role == "prefill":
            remote = got.get("remote_num_tokens") if got.get("remote_block_ids") else None
            return {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": self.blocks(len(prompt)),
                "remote_engine_id": self.engine_id,
                "remote_request_id": f"cmpl-{request_id}-0-0a1b2c3d",
                "remote_host": "127.0.0.1",
                "remote_port": self.side_channel_port,
                "tp_size": 1,
                "dcp_size": 1,
                "pp_size": 1,
                "remote_num_tokens": len(prompt),
                "remote_blocks_expiry_time": None,
                "transfer_mode": "pull",
                "remote_prefill_cached_tokens": min(remote, len(prompt)) if isinstance(remote, int) else 0,
            }
        held = len(prompt) + output - 1  # the last sampled token has no KV
        return {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": self.blocks(held),
            "remote_engine_id": self.engine_id,
            "remote_request_id": f"cmpl-{request_id}-0-4e5f6a7b",
            "remote_host": "127.0.0.1",
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": held,
            "remote_blocks_expiry_time": time.perf_counter() + 480.0,
            "transfer_mode": "pull",
        }

    def output(self, body: dict[str, Any]) -> tuple[list[int], list[str], str, Any, bool]:
        """(token ids, their texts, finish_reason, stop_reason, aborted by a stop string)."""
        if self.role == "prefill":
            ids = self.tokenizer.encode(self.answer, add_special_tokens=False).ids[:1]
            return ids, [self.tokenizer.decode(ids)], "length", None, False
        ids = self.tokenizer.encode(self.answer, add_special_tokens=False).ids
        texts = [
            self.tokenizer.decode(ids[: i + 1])[len(self.tokenizer.decode(ids[:i])) :]
            for i in range(len(ids))
        ]
        max_tokens = body.get("max_tokens")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        for i in range(len(ids)):
            done = "".join(texts[: i + 1])
            hit = next((s for s in stops if s in done), None)
            if hit is not None:  # vLLM: detokenizer match, then an abort in the engine core
                keep = done[: done.index(hit)]
                return ids[: i + 1], [keep], "stop", hit, True
            if isinstance(max_tokens, int) and i + 1 >= max_tokens:
                return ids[: i + 1], texts[: i + 1], "length", None, False
        return [*ids, self.eos_id], [*texts, ""], "stop", None, False

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(Recorded(body, dict(request.headers)))
        if self.delay:
            try:
                await asyncio.sleep(self.delay)
            finally:
                if request.transport is None or request.transport.is_closing():
                    self.cancelled.set()  # the caller went away while we "computed"
        if self.fail_status is not None:
            error = {"message": "Internal server error", "type": "InternalServerError", "param": None}
            return web.json_response({"error": {**error, "code": self.fail_status}}, status=self.fail_status)
        prompt = body["prompt"]
        assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt), "token-id prompts only"
        got = body.get("kv_transfer_params") or {}
        ids, texts, finish, stop_reason, aborted = self.output(body)
        request_id = request.headers.get("X-Request-Id", "x")
        keeps = got and not aborted and self.return_params
        params = self._params(prompt, len(ids), request_id, got) if keeps else None
        self.answers.append({"token_ids": ids, "kv_transfer_params": params})
        token_ids = bool(body.get("return_token_ids"))
        usage = {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": None,
        }
        head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time())}
        head["model"] = body["model"]
        if not body.get("stream"):
            choice: dict[str, Any] = {
                "index": 0,
                "text": "".join(texts),
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "prompt_logprobs": None,
            }
            if token_ids:
                choice.update(token_ids=ids, prompt_token_ids=prompt)
            return web.json_response(
                {**head, "choices": [choice], "usage": usage, "kv_transfer_params": params}
            )
        return await self._stream(request, body, head, prompt, ids, texts, finish, stop_reason, params, usage)

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        head: dict[str, Any],
        prompt: list[int],
        ids: list[int],
        texts: list[str],
        finish: str,
        stop_reason: Any,
        params: dict[str, Any] | None,
        usage: dict[str, Any],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        token_ids = bool(body.get("return_token_ids"))

        async def send(obj: Any) -> None:
            await response.write(
                b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            )

        try:
            pieces = list(zip(ids, texts, strict=False)) if len(texts) == len(ids) else [(ids, texts[0])]
            for i, (token, text) in enumerate(pieces):
                if self.fail_after_tokens is not None and i == self.fail_after_tokens:
                    error = {
                        "message": "EngineCore died",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                    await send({"error": error})
                    await send(b"[DONE]")
                    return response
                last = i == len(pieces) - 1
                choice: dict[str, Any] = {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish if last else None,
                    "stop_reason": stop_reason if last else None,
                }
                if token_ids:
                    choice["token_ids"] = token if isinstance(token, list) else [token]
                    if i == 0:
                        choice["prompt_token_ids"] = prompt
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if last and self.stream_params and params is not None:
                    chunk["kv_transfer_params"] = params
                await send(chunk)
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
            if (body.get("stream_options") or {}).get("include_usage"):
                await send({**head, "choices": [], "usage": usage})
            await send(b"[DONE]")
            await response.write_eof()
            self.finished_streams += 1
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        except ConnectionResetError:  # the gateway closed the connection: vLLM aborts the request
            self.cancelled.set()
        return response


def main() -> None:
    """`python tests/gateway/fake_engine.py TOKENIZER_JSON PREFILL_PORT DECODE_PORT`: both fakes
    in one process until killed (for bench/gateway_added_latency.py; engine ids engine-p0 /
    engine-d0)."""
    tokenizer = Tokenizer.from_file(sys.argv[1])
    eos = tokenizer.token_to_id("</s>") or 0

    async def serve() -> None:
        engines = [
            FakeEngine("prefill", "engine-p0", tokenizer, eos),
            FakeEngine("decode", "engine-d0", tokenizer, eos),
        ]
        for engine, port in zip(engines, (int(sys.argv[2]), int(sys.argv[3])), strict=True):
            app = web.Application()
            app.router.add_post("/v1/completions", engine._handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        print("ready", flush=True)
        while True:
            await asyncio.sleep(3600)
            for engine in engines:  # unbounded records would grow for the whole run
                engine.requests.clear()
                engine.answers.clear()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
