"""A stand-in for one vLLM 0.32 engine with the NixlConnector (`kv_both`, bidirectional): no model,
the HTTP and KV-event surface kvshuttle uses, configurable latency, and KV whose content decides
the output (deploy/standin/kv.py), so reuse of the wrong blocks is visible in the answer.

    python -m deploy.standin.engine --role prefill|decode --port P --side-channel-port S \
        --kv-events-port E --kv-replay-port R --engine-id ID --model-dir .run/models/tiny \
        [--block-size 32] [--num-blocks 4096] [--prefill-us-per-token 20] [--decode-ms-per-token 0.5]
        [--read-us-per-block 50] [--kv-blocks-ttl 480] [--kv-lease-s 30] [--kv-recompute-threshold 64]

* `POST /v1/completions`: token-id prompts, `kv_transfer_params` in and out as vLLM's (turn 1's
  `do_remote_decode` to prefill: prefill keeps the prompt's blocks for decode and answers
  `do_remote_prefill`; those params to decode: decode reads prefill's blocks; decode that got
  params keeps prompt + output - 1 tokens for `--kv-blocks-ttl` s and answers `do_remote_decode`
  with them; the next turn's prefill gets them back, truncated, and reads them), streaming SSE
  whose finish chunk carries the params (0.32 with kvshuttle's plugin), `return_token_ids`,
  `stop`, usage, vLLM's error bodies. `GET /health`, `GET /metrics` (`vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, and `standin_*` counters),
  `GET /v1/models`.
* The NIXL side channel, stood in for by HTTP on `--side-channel-port`: `POST /kv/read`
  `{"holding": remote_request_id, "block_ids": [...]}` answers the blocks' contents and frees
  them (the READ and the notification in one); 404 for a holding it no longer has. A reader
  sleeps `--read-us-per-block` per block read; a failed read recomputes (vLLM's
  `kv_load_failure_policy: recompute`), counted in `standin_kv_load_failures_total`.
* KV events: ZMQ PUB on `--kv-events-port` (`[topic, seq, msgpack [ts, [events], 0]]`, one
  batch per request that changed the cache) and the replay ROUTER on `--kv-replay-port`, in
  vLLM's frame shapes (kvshuttle.vllm.kv_events decodes them).
* `GET /standin/timings?clear=1`: each request's own time in the engine (receipt to last byte),
  by X-Request-Id, bounded; what bench/load.py subtracts to get the control plane's time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import aiohttp
import msgpack
import zmq
import zmq.asyncio
from aiohttp import web
from tokenizers import Tokenizer

from deploy.standin import http
from deploy.standin.kv import CacheFull, KvCache, output_tokens, vllm_block_hashes

HOST: Final = "127.0.0.1"
TOPIC: Final = b"kv-events"
_END_SEQ: Final = b"\xff" * 8
_REPLAY_BUFFER: Final = 10_000  # vLLM's default buffer_steps
_MAX_TIMINGS: Final = 200_000


@dataclass(frozen=True)
class StandinConfig:
    role: Literal["prefill", "decode"]
    port: int
    side_channel_port: int
    kv_events_port: int
    kv_replay_port: int
    engine_id: str
    model_dir: Path
    served_model_name: str = "m"
    host: str = HOST
    block_size: int = 32
    num_blocks: int = 4096
    max_model_len: int = 8192
    prefix_caching: bool = True
    prefill_us_per_token: float = 20.0
    decode_ms_per_token: float = 0.5
    read_us_per_block: float = 50.0
    kv_blocks_ttl: float = 480.0
    kv_lease_s: float = 30.0
    kv_recompute_threshold: int = 64


class StandinEngine:
    def __init__(self, config: StandinConfig) -> None:
        self.config = config
        tokenizer = Tokenizer.from_file(str(config.model_dir / "tokenizer.json"))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocabulary, self.texts = http.plain_vocabulary(tokenizer)
        self.cache = KvCache(config.num_blocks, config.block_size, prefix_caching=config.prefix_caching)
        self.counters = {"requests": 0, "kv_reads": 0, "kv_blocks_read": 0, "kv_load_failures": 0,
                         "kv_reads_declined": 0, "holdings_expired": 0}  # fmt: skip
        self.running = 0
        self.timings: OrderedDict[str, float] = OrderedDict()
        self._seq = 0
        self._replay: deque[tuple[int, bytes]] = deque(maxlen=_REPLAY_BUFFER)
        self._zmq = zmq.asyncio.Context()
        self._pub = self._zmq.socket(zmq.PUB)
        self._router = self._zmq.socket(zmq.ROUTER)
        self._session: aiohttp.ClientSession | None = None

    # -- KV events ---------------------------------------------------------------------------

    def publish(self) -> None:
        """The cache's events since the last call, as one batch (none: nothing sent)."""
        events, self.cache.events = self.cache.events, []
        if not events:
            return
        payload = bytes(msgpack.packb([time.time(), events, 0]))
        seq, self._seq = self._seq, self._seq + 1
        self._replay.append((seq, payload))
        self._pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._replay):
                if seq >= start:
                    await self._router.send_multipart([identity, b"", TOPIC, seq.to_bytes(8, "big"), payload])
            await self._router.send_multipart([identity, b"", b"", _END_SEQ, b""])

    # -- the side channel (NIXL READ + notification) -----------------------------------------

    async def _kv_read(self, request: web.Request) -> web.Response:
        body = await request.json()
        contents = self.cache.take(str(body.get("holding")), [int(b) for b in body.get("block_ids", [])])
        if contents is None:
            return web.json_response({"error": "no such holding"}, status=404)
        return web.json_response({"blocks": [list(c) for c in contents]})

    async def _read_remote(self, params: dict[str, Any], skip_blocks: int, upto: int) -> list[int] | None:
        """Tokens [skip_blocks * bs, upto) of the remote holding `params` name, read and freed
        there; None when the read failed."""
        ids = (params.get("remote_block_ids") or [[]])[0]
        bs = self.config.block_size
        wanted = ids[skip_blocks : -(-upto // bs)]
        url = f"http://{params.get('remote_host')}:{params.get('remote_port')}/kv/read"
        assert self._session is not None
        try:
            async with self._session.post(
                url, json={"holding": params.get("remote_request_id"), "block_ids": wanted}
            ) as response:
                if response.status != 200:
                    return None
                blocks = (await response.json())["blocks"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return None
        if wanted:
            await asyncio.sleep(len(wanted) * self.config.read_us_per_block / 1e6)
            self.counters["kv_reads"] += 1
            self.counters["kv_blocks_read"] += len(wanted)
        tokens = [t for block in blocks for t in block]
        return tokens[: upto - skip_blocks * bs]

    async def _notify_only(self, params: dict[str, Any]) -> None:
        """Tell the holder its blocks are no longer wanted (vLLM notifies on every outcome)."""
        await self._read_remote(params, 0, 0)

    # -- a request's KV ----------------------------------------------------------------------

    async def _prompt_kv(
        self, prompt: list[int], params: dict[str, Any], salt: str | None
    ) -> tuple[list[int], int, int]:
        """The KV content of the prompt (local prefix hits, remote blocks, computed), the tokens
        found or read (prefill's `remote_prefill_cached_tokens`), and the tokens computed."""
        bs = self.config.block_size
        hashes = vllm_block_hashes(prompt, bs, salt)
        content: list[int] = [t for block in self.cache.local_hit(hashes) for t in block]
        remote = bool((params.get("remote_block_ids") or [[]])[0]) and bool(params.get("remote_request_id"))
        n = min(int(params.get("remote_num_tokens") or 0), len(prompt)) if remote else 0
        if remote:
            worth = n - len(content) >= (
                self.config.kv_recompute_threshold if self.config.role == "prefill" else 1
            )
            if not worth:
                self.counters["kv_reads_declined"] += 1
                await self._notify_only(params)
            else:
                read = await self._read_remote(params, len(content) // bs, n)
                if read is None:
                    self.counters["kv_load_failures"] += 1  # recompute
                else:
                    content = content[: len(content) // bs * bs] + read
        found = len(content)
        computed = len(prompt) - found
        await asyncio.sleep(computed * self.config.prefill_us_per_token / 1e6)
        return content + prompt[found:], found, computed

    def _keep(
        self, tokens: list[int], content: list[int], salt: str | None, ttl: float
    ) -> tuple[str, list[int]]:
        """Blocks for `tokens` (KV `content`) held for one remote reader for `ttl` s."""
        ids = self.cache.place(tokens, content, vllm_block_hashes(tokens, self.config.block_size, salt), salt)
        self.publish()
        holding = f"cmpl-{uuid.uuid4().hex}-0-{uuid.uuid4().hex[:8]}"
        self.cache.hold(holding, ids, time.monotonic() + ttl)
        return holding, ids

    def _cache_only(self, tokens: list[int], content: list[int], salt: str | None) -> None:
        ids = self.cache.place(tokens, content, vllm_block_hashes(tokens, self.config.block_size, salt), salt)
        self.publish()
        self.cache.release(ids)

    def _params(self, holding: str, ids: list[int], tokens: int, **extra: Any) -> dict[str, Any]:
        prefill = self.config.role == "prefill"
        return {
            "do_remote_prefill": prefill,
            "do_remote_decode": not prefill,
            "remote_block_ids": [ids],
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": holding,
            "remote_host": self.config.host,
            "remote_port": self.config.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": None if prefill else time.perf_counter() + self.config.kv_blocks_ttl,
            "transfer_mode": "pull",
            **extra,
        }

    # -- HTTP --------------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        self.running += 1
        self.counters["requests"] += 1
        cfg = self.config
        try:
            try:
                req = http.parse_completion(
                    await request.json(),
                    model=cfg.served_model_name,
                    vocab_size=self.vocab_size,
                    max_model_len=cfg.max_model_len,
                )
            except ValueError:
                return http.error_response("the body is not JSON", 400)
            except http.BadRequest as exc:
                return http.error_response(str(exc), exc.status)
            try:
                return await self._complete(request, request_id, req)
            except CacheFull as exc:
                return http.error_response(str(exc), 400)
        finally:
            self.running -= 1
            self.timings[request_id] = time.perf_counter() - started
            while len(self.timings) > _MAX_TIMINGS:
                self.timings.popitem(last=False)

    async def _complete(
        self, request: web.Request, request_id: str, req: http.CompletionRequest
    ) -> web.StreamResponse:
        prompt, salt = req.prompt, req.cache_salt
        content, found, _ = await self._prompt_kv(prompt, req.kv_transfer_params, salt)
        cfg = self.config
        max_tokens = 1 if cfg.role == "prefill" else req.max_tokens  # prefill answers one token
        ids = output_tokens(content, max_tokens, self.vocabulary)
        answer = http.apply_stops(ids, [self.texts[i] for i in ids], req.stops)
        out_params = (
            None
            if answer.aborted
            else self._retain(prompt, content, answer.ids, found, req.kv_transfer_params, salt)
        )
        used = http.usage(prompt, answer.ids, found)
        top = http.head(request_id, cfg.served_model_name)
        if req.stream:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for chunk in http.sse_chunks(req, top, answer, out_params):
                await asyncio.sleep(self._per_token_s)
                await response.write(chunk)
            await response.write(http.sse_tail(req, top, used))
            await response.write_eof()
            return response
        await asyncio.sleep(self._per_token_s * len(answer.ids))
        return web.json_response(http.completion_body(req, top, answer, out_params, used))

    @property
    def _per_token_s(self) -> float:
        return self.config.decode_ms_per_token / 1e3 if self.config.role == "decode" else 0.0

    def _retain(
        self,
        prompt: list[int],
        content: list[int],
        ids: list[int],
        found: int,
        params: dict[str, Any],
        salt: str | None,
    ) -> dict[str, Any] | None:
        """Cache the request's blocks; with params, hold them for the remote reader and answer
        the params that name them (None: nothing held)."""
        cfg = self.config
        if params and cfg.role == "prefill":
            holding, blocks = self._keep(prompt, content, salt, cfg.kv_lease_s)
            return self._params(holding, blocks, len(prompt), remote_prefill_cached_tokens=found)
        if params:  # decode: prompt + output - 1 tokens (the last sampled token has no KV)
            holding, blocks = self._keep(prompt + ids[:-1], content + ids[:-1], salt, cfg.kv_blocks_ttl)
            return self._params(holding, blocks, len(prompt) + len(ids) - 1)
        self._cache_only(prompt, content, salt)
        return None

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, _: web.Request) -> web.Response:
        model, usage = self.config.served_model_name, self.cache.usage()
        text = http.metrics_text(model, self.running, usage, self.stats())
        return web.Response(text=text, content_type="text/plain")

    def stats(self) -> dict[str, int]:
        return {**{f"{k}_total": v for k, v in self.counters.items()},
                "holdings": self.cache.holdings(), "evicted_blocks_total": self.cache.evicted_blocks,
                "dropped_holdings_total": self.cache.dropped_holdings}  # fmt: skip

    async def _models(self, _: web.Request) -> web.Response:
        cfg = self.config
        return web.json_response(http.models_body(cfg.served_model_name, cfg.model_dir, cfg.max_model_len))

    async def _timings(self, request: web.Request) -> web.Response:
        got = dict(self.timings)
        if request.query.get("clear"):
            self.timings.clear()
        return web.json_response({"timings": got, "stats": self.stats()})

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.counters["holdings_expired"] += self.cache.expire(time.monotonic())

    # -- lifecycle ---------------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event) -> None:
        cfg = self.config
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.LINGER, 0)
        self._pub.bind(f"tcp://{cfg.host}:{cfg.kv_events_port}")
        self._router.bind(f"tcp://{cfg.host}:{cfg.kv_replay_port}")
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        side = web.Application()
        side.router.add_post("/kv/read", self._kv_read)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/standin/timings", self._timings)
        runners = [web.AppRunner(side, access_log=None), web.AppRunner(app, access_log=None)]
        tasks = [asyncio.create_task(self._serve_replay()), asyncio.create_task(self._expire())]
        try:
            for runner, port in zip(runners, (cfg.side_channel_port, cfg.port), strict=True):
                await runner.setup()
                await web.TCPSite(runner, cfg.host, port).start()
            print(f"standin {cfg.role} {cfg.engine_id} ready on http://{cfg.host}:{cfg.port}", flush=True)
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for runner in reversed(runners):
                await runner.cleanup()
            await self._session.close()
            self._pub.close(0)
            self._router.close(0)
            self._zmq.term()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m deploy.standin.engine", description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    for name in ("port", "side-channel-port", "kv-events-port", "kv-replay-port"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--model-dir", type=Path, required=True, help="its tokenizer.json: the output vocabulary")
    ap.add_argument("--served-model-name", default="m")
    ap.add_argument("--host", default=HOST)
    ap.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    for name, kind, default in (
        ("block-size", int, 32), ("num-blocks", int, 4096), ("max-model-len", int, 8192),
        ("prefill-us-per-token", float, 20.0), ("decode-ms-per-token", float, 0.5),
        ("read-us-per-block", float, 50.0), ("kv-blocks-ttl", float, 480.0), ("kv-lease-s", float, 30.0),
        ("kv-recompute-threshold", int, 64),
    ):  # fmt: skip
        ap.add_argument(f"--{name}", type=kind, default=default)
    return ap


def main() -> None:
    args = vars(_parser().parse_args())
    config = StandinConfig(**args)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await StandinEngine(config).serve(stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
