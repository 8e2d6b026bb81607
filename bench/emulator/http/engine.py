"""A stand-in for one vLLM 0.32 engine with the NixlConnector (`kv_both`, bidirectional): no model,
the HTTP and KV-event surface kvshuttle uses, configurable latency, and KV whose content decides
the output (bench/emulator/http/kv.py), so reuse of the wrong blocks is visible in the answer.

    python -m bench.emulator.http.engine --role prefill|decode --port P --side-channel-port S \
        --kv-events-port E --kv-replay-port R --engine-id ID --model-dir .run/models/tiny \
        [--block-size 32] [--num-blocks 4096] [--prefill-us-per-token 20] [--decode-ms-per-token 0.5]
        [--read-us-per-block 50] [--kv-blocks-ttl 480] [--kv-lease-s 30] [--kv-recompute-threshold 64]
        [--kv-load-failure-policy recompute|fail] [--profile deploy/profiles/F.toml [--profile-model M]]
        [--time-scale 1.0] [--otlp-traces-endpoint http://HOST:4317]

With `--profile` it emulates the profile's engine (bench/emulator/core/timing.py): one forward at a
time, chunked prefill under the token budget, batched decode, requests queued for blocks of its
pool (the profile's size; bench/emulator/core/pool.py), and reads over a shared link
(bench/emulator/core/link.py); `--time-scale` runs it faster than the profile's hardware. Without one
it takes the flat per-token costs, each request on its own.

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
  sleeps `--read-us-per-block` per block read (profile-timed: its link's time for the bytes); a
  failed read recomputes, or with `--kv-load-failure-policy fail` fails the request with a 500
  (vLLM's `kv_load_failure_policy`), counted in `standin_kv_load_failures_total`. `"notify":
  false` reads without freeing. `GET /kv/handshake`: what NIXL's handshake tells a reader
  (engine id, block size, blocks, the side channel's URL, the engine's clock and its link), for
  kvshuttle's agent beside it (bench/emulator/http/pool_plane.py).
* KV events: ZMQ PUB on `--kv-events-port` (`[topic, seq, msgpack [ts, [events], 0]]`, one
  batch per request that changed the cache) and the replay ROUTER on `--kv-replay-port`, in
  vLLM's frame shapes (bench/emulator/http/events.py; kvshuttle.vllm.kv_events decodes them).
* `--otlp-traces-endpoint`: each answered request's `llm_request` span, as vLLM exports it
  (bench/emulator/http/tracing.py), a child of the request's `traceparent`.
* `GET /standin/timings?clear=1`: each request's own time in the engine (receipt to last byte),
  by X-Request-Id, bounded; what bench/load.py subtracts to get the control plane's time.

In a test's own process (`config.in_process_config`: ports picked at start, no simulated time),
`await engine.start()` / `await engine.stop()`, with a `Script` of answers and faults and a
`Transcript` of what was asked (bench/emulator/http/script.py).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections import OrderedDict
from typing import Any, Final

from aiohttp import web
from tokenizers import Tokenizer

from bench.emulator.core.engine import CacheFull, EngineCore, KvLoadFailed
from bench.emulator.core.link import Link
from bench.emulator.core.timing import Run
from bench.emulator.http import completions as http
from bench.emulator.http.config import StandinConfig, config_from_argv
from bench.emulator.http.events import EventPublisher
from bench.emulator.http.kv import output_tokens, removed_event, stored_events, vllm_block_hashes
from bench.emulator.http.reads import Block, RemoteReader, side_channel_handshake
from bench.emulator.http.script import Script, Transcript, eos_id, scripted_answer
from bench.emulator.http.tracing import RequestSpans

_MAX_TIMINGS: Final = 200_000
_SHUTDOWN_S: Final = 5.0

# What `keep` hands to the KV-event publisher: the sequence's tokens, their block hashes, the
# cache salt and how many of the tokens are the prompt.
_Sequence = tuple[list[int], list[bytes], "str | None", int]


class StandinEngine:
    """`script`: answers and faults (none by default); `record`: keep a transcript of every
    request and answer (in-process tests; a long run would grow it without bound). Profile-timed,
    its reads go over `link` (default: a link of its own, the profile's)."""

    def __init__(
        self,
        config: StandinConfig,
        *,
        script: Script | None = None,
        record: bool = False,
        link: Link | None = None,
    ) -> None:
        self._config = config
        self.script = script or Script()
        self.transcript = Transcript(recording=record)
        self.tokenizer = Tokenizer.from_file(str(config.model_dir / "tokenizer.json"))
        self.eos_id = eos_id(config.model_dir, self.tokenizer)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocabulary, self.texts = http.plain_vocabulary(self.tokenizer)
        self.reader = RemoteReader()
        self._pending: list[dict[str, Any]] = []  # KV events since the last publish
        self.core: EngineCore[bytes, Block] = EngineCore(
            config.core(config.side_channel_port),
            self.reader,
            on_stored=self._stored,
            on_removed=lambda keys, medium: self._pending.append(removed_event(keys, medium)),
            on_cleared=lambda: self._pending.append({"type": "AllBlocksCleared"}),
            link=link,
            params_clock=time.perf_counter,
        )
        self.cache = self.core.pool
        self.timing = self.core.timing
        self.running = 0
        self.requests = 0  # HTTP requests, well-formed or not
        self.timings: OrderedDict[str, float] = OrderedDict()
        self.events = EventPublisher()
        # Where it listens, once started (the configured ports, or the ones picked for port 0).
        self.url = ""
        self.side_channel_port = config.side_channel_port
        self.events_endpoint = self.replay_endpoint = ""
        self._runners: list[web.AppRunner] = []
        endpoint = config.otlp_traces_endpoint
        self.spans = RequestSpans(endpoint, f"standin-{config.role}") if endpoint else None

    @property
    def config(self) -> StandinConfig:
        return self._config

    @config.setter
    def config(self, config: StandinConfig) -> None:
        """A test may reconfigure a running engine (its engine id, say): its core follows."""
        self._config = config
        self.core.config = config.core(self.side_channel_port)

    def publish(self) -> None:
        """The cache's events since the last call, as one batch."""
        events, self._pending = self._pending, []
        self.events.publish(events)

    def _stored(self, indices: list[int], sequence: _Sequence) -> None:
        tokens, hashes, salt, prompt = sequence
        bs = self.config.block_size
        self._pending += stored_events(tokens, hashes, indices, bs, salt, first_generated=prompt // bs)

    # -- the side channel (NIXL READ + notification) -----------------------------------------

    async def _kv_read(self, request: web.Request) -> web.Response:
        body = await request.json()
        wanted = [int(b) for b in body.get("block_ids", [])]
        notify = body.get("notify", True) is not False
        contents = self.core.take(str(body.get("holding")), wanted, notify=notify)
        if contents is None:
            return web.json_response({"error": "no such holding"}, status=404)
        return web.json_response({"blocks": [list(c) for c in contents]})

    async def _kv_host(self, request: web.Request) -> web.Response:
        """A peer's read of this engine's host tier (llm-d's P2P KV sharing): the leading run of
        the keys found there, not freed."""
        body = await request.json()
        keys = [bytes.fromhex(str(k)) for k in body.get("keys", [])]
        return web.json_response({"blocks": [list(c) for c in self.core.host.hits(keys)]})

    async def _kv_handshake(self, _: web.Request) -> web.Response:
        """What a NIXL handshake tells a reader, for an agent's pool (bench/emulator/http/pool_plane.py)."""
        answer = side_channel_handshake(self.config, self.side_channel_port, self.core.link)
        return web.json_response(answer)

    # -- a request's KV ----------------------------------------------------------------------

    async def _prompt_kv(
        self, prompt: list[int], hashes: list[bytes], params: dict[str, Any]
    ) -> tuple[list[int], int]:
        """The KV content of the prompt, token by token (local prefix hits, host-tier loads,
        remote blocks, the rest computed), and the tokens found or read (prefill's
        `remote_prefill_cached_tokens`)."""
        found = await self.core.find(hashes, len(prompt), params)
        content = [t for block in found.contents for t in block][: found.tokens]
        return content + prompt[len(content) :], len(content)

    def _keep(
        self,
        tokens: list[int],
        content: list[int],
        prompt: int,
        params: dict[str, Any],
        salt: str | None,
        **extra: Any,
    ) -> dict[str, Any] | None:
        """Cache the sequence `tokens` (KV `content`; `prompt` of them the prompt) and hold it
        where vLLM would (see EngineCore.keep); offload it to the host tier; its events published."""
        bs = self.config.block_size
        hashes = vllm_block_hashes(tokens, bs, salt)
        blocks = [tuple(content[i : i + bs]) for i in range(0, len(content), bs)]
        out = self.core.keep(
            hashes, blocks, prompt, len(tokens), params, (tokens, hashes, salt, prompt), **extra
        )
        stored = self.core.offload(hashes, blocks)
        if stored:
            index = {h: i for i, h in enumerate(hashes)}
            at = sorted(index[h] for h in stored)
            self._pending += stored_events(
                tokens, hashes, at, bs, salt, first_generated=prompt // bs, medium="CPU"
            )
        self.publish()
        return out

    # -- HTTP --------------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        started, arrival_ns = time.perf_counter(), time.time_ns()
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        self.running += 1
        self.requests += 1
        cfg, script = self.config, self.script
        try:
            try:
                body = await request.json()
            except ValueError:
                return http.error_response("the body is not JSON", 400)
            self.transcript.request(body, dict(request.headers))
            if script.delay:
                await asyncio.sleep(script.delay)
                if request.transport is None or request.transport.is_closing():
                    self.transcript.cancelled.set()  # the caller went away while we "computed"
            if script.fail_status is not None:
                return http.error_response("Internal server error", script.fail_status)
            try:
                req = http.parse_completion(
                    body,
                    model=cfg.served_model_name,
                    vocab_size=self.vocab_size,
                    max_model_len=cfg.max_model_len,
                )
            except http.BadRequest as exc:
                return http.error_response(str(exc), exc.status)
            try:
                return await self._complete(request, request_id, req, (arrival_ns, started))
            except CacheFull as exc:
                return http.error_response(str(exc), 400)
            except KvLoadFailed as exc:
                return http.error_response(str(exc), 500)
        finally:
            self.running -= 1
            self.timings[request_id] = time.perf_counter() - started
            while len(self.timings) > _MAX_TIMINGS:
                self.timings.popitem(last=False)

    async def _complete(
        self,
        request: web.Request,
        request_id: str,
        req: http.CompletionRequest,
        arrival: tuple[int, float],  # wall-clock ns and perf_counter of its receipt
    ) -> web.StreamResponse:
        prompt, salt = req.prompt, req.cache_salt
        got = req.kv_transfer_params if self.script.kv_connector else {}
        content, found = await self._prompt_kv(
            prompt, vllm_block_hashes(prompt, self.config.block_size, salt), got
        )
        answer = self._answer(content, req)
        run = self.core.submit(len(prompt), found, len(answer.ids))
        try:
            await run.prefilled()
            first_token = time.perf_counter()
            out_params = None
            if not answer.aborted:
                out_params = self._retain(prompt, content, answer.ids, found, got, salt)
            run.placed()
            self.transcript.answer(answer.ids, out_params)
            used = http.usage(prompt, answer.ids, found)
            top = http.head(request_id, self.config.served_model_name)
            if req.stream:
                response = await self._stream(request, req, top, answer, out_params, used, run)
            else:
                await run.finished()
                response = web.json_response(http.completion_body(req, top, answer, out_params, used))
            if self.spans is not None:
                arrival_ns, received = arrival
                self.spans.finished(
                    request.headers,
                    request_id=request_id,
                    arrival_ns=arrival_ns,
                    first_token_s=first_token - received,
                    e2e_s=time.perf_counter() - received,
                    prompt_tokens=len(prompt),
                    completion_tokens=len(answer.ids),
                    max_tokens=req.max_tokens,
                )
            return response
        finally:
            run.close()

    def _answer(self, content: list[int], req: http.CompletionRequest) -> http.Answer:
        """The output: the script's text (then EOS) if it has one, else the tokens the KV
        content decides; prefill answers one token."""
        prefill = self.config.role == "prefill"
        text = self.script.answer
        if text is None:
            count = 1 if prefill else req.max_tokens or http.DEFAULT_MAX_TOKENS
            ids = output_tokens(content, count, self.vocabulary)
            return http.apply_stops(ids, [self.texts[i] for i in ids], req.stops)
        limit = 1 if prefill else req.max_tokens
        return scripted_answer(text, self.tokenizer, self.eos_id, limit, req.stops)

    async def _stream(
        self,
        request: web.Request,
        req: http.CompletionRequest,
        top: dict[str, Any],
        answer: http.Answer,
        params: dict[str, Any] | None,
        used: dict[str, Any],
        run: Run,
    ) -> web.StreamResponse:
        script = self.script
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            chunks = http.sse_chunks(req, top, answer, params if script.stream_params else None)
            for i, chunk in enumerate(chunks):
                if i == script.fail_after_tokens:
                    await response.write(http.sse_error("EngineCore died", 500))
                    return response
                await run.token(i)
                if script.token_delay:
                    await asyncio.sleep(script.token_delay)
                await response.write(chunk)
            await response.write(http.sse_tail(req, top, used))
            await response.write_eof()
            self.transcript.finished_streams += 1
        except asyncio.CancelledError:
            self.transcript.cancelled.set()
            raise
        except ConnectionResetError:  # the client closed the connection: vLLM aborts the request
            self.transcript.cancelled.set()
        return response

    def _retain(
        self,
        prompt: list[int],
        content: list[int],
        ids: list[int],
        found: int,
        params: dict[str, Any],
        salt: str | None,
    ) -> dict[str, Any] | None:
        """Cache the request's blocks (prompt + output - 1 tokens: the last sampled token has no
        KV; vLLM caches the answer's full blocks too, so the next turn's prompt finds them); with
        params, hold them for the remote reader and answer the params that name them (None:
        nothing held)."""
        extra = {"remote_prefill_cached_tokens": found} if self.config.role == "prefill" else {}
        tail = ids[:-1]
        return self._keep(prompt + tail, content + tail, len(prompt), params, salt, **extra)

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, _: web.Request) -> web.Response:
        model, usage, waiting = self.config.served_model_name, self.cache.usage(), self.timing.waiting
        text = http.metrics_text(model, self.running - waiting, waiting, usage, self.stats())
        return web.Response(text=text, content_type="text/plain")

    def stats(self) -> dict[str, int]:
        c, cache = self.core.counters, self.cache
        return {
            "requests_total": self.requests,
            "kv_reads_total": c.reads,
            "kv_blocks_read_total": c.read_blocks,
            "kv_load_failures_total": c.read_failures,
            "kv_reads_declined_total": c.reads_declined,
            "holdings_expired_total": c.holdings_expired,
            "holdings": cache.holdings(),
            "evicted_blocks_total": cache.evicted_blocks,
            "dropped_holdings_total": cache.dropped_holdings,
        }

    async def _models(self, _: web.Request) -> web.Response:
        cfg = self.config
        return web.json_response(http.models_body(cfg.served_model_name, cfg.model_dir, cfg.max_model_len))

    async def _timings(self, request: web.Request) -> web.Response:
        got = dict(self.timings)
        if request.query.get("clear"):
            self.timings.clear()
        return web.json_response({"timings": got, "stats": self.stats()})

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen (HTTP, the side channel, KV events); `url` and the ports are then set."""
        cfg = self.config
        self.events_endpoint, self.replay_endpoint = self.events.bind(
            cfg.host, cfg.kv_events_port, cfg.kv_replay_port
        )
        self.reader.open()
        side = web.Application()
        side.router.add_post("/kv/read", self._kv_read)
        side.router.add_post("/kv/host", self._kv_host)
        side.router.add_get("/kv/handshake", self._kv_handshake)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/standin/timings", self._timings)
        self.core.start()
        ports = []
        for application, port in ((side, cfg.side_channel_port), (app, cfg.port)):
            # A stop waits this long for requests in flight, not aiohttp's 60 s: a benchmark
            # stopping its engines under a hung request (bench/cluster/README.md) waited for it.
            runner = web.AppRunner(application, access_log=None, shutdown_timeout=_SHUTDOWN_S)
            self._runners.append(runner)
            await runner.setup()
            await web.TCPSite(runner, cfg.host, port).start()
            ports.append(runner.addresses[0][1])
        self.side_channel_port = ports[0]
        self.core.config = cfg.core(self.side_channel_port)  # what its params name
        self.url = f"http://{cfg.host}:{ports[1]}"

    async def stop(self) -> None:
        """Stop listening (a test may stop an engine before its cluster stops it again)."""
        await self.core.stop()
        while self._runners:
            await self._runners.pop().cleanup()
        await self.reader.close()
        await self.events.close()
        if self.spans is not None:
            await asyncio.to_thread(self.spans.shutdown)

    async def serve(self, stop: asyncio.Event) -> None:
        try:
            await self.start()
            print(f"standin {self.config.role} {self.config.engine_id} ready on {self.url}", flush=True)
            await stop.wait()
        finally:
            await self.stop()


def main() -> None:
    config = config_from_argv(description=(__doc__ or "").split("\n")[0])

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await StandinEngine(config).serve(stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
