"""The gateway's HTTP server: OpenAI-compatible endpoints that drive each request through
PlanTurn -> prefill -> decode -> CommitTurn.

Per request:

1. Authenticate (API key -> tenant), validate, and tokenize the prompt exactly as the engine
   would (kvshuttle.gateway.tokenizer).
2. PlanTurn(model, prompt ids, `tenants/{tenant}/conversations/{id}`, request id): placement,
   and the `kv_transfer_params` prefill must get (with reuse: the retained KV, truncated to
   the verified prefix).
3. Prefill: `/v1/completions` with the token-id prompt, `max_tokens: 1`, `stream: false` and the
   plan's params. Its answer's `kv_transfer_params` go to decode unchanged, or none at all
   (never a hand-made dict: decode would hold such a request's blocks forever).
4. Decode: `/v1/completions` with the same prompt, P's params, `return_token_ids: true` and the
   client's sampling; streamed to the client as it comes (translated to chat chunks for chat).
5. CommitTurn once decode has answered, in the background: the client's response does not
   wait for it. It carries decode's final `kv_transfer_params` (the non-streaming body, or the
   stream chunk that carries them: upstream 0.33, or 0.32 with the kvshuttle plugin; absent,
   nothing is retained), the sequence's token ids (prompt + output) and the timings. The
   conversation's next turn plans only after that commit has landed (in this gateway), so it
   finds the retention; a turn that reaches another gateway replica first recomputes.

Whatever ends a planned turn early (an engine error, the client leaving, shutdown) aborts it,
which releases a claimed retention. One `request.done` log line per request carries what the
lead's benchmark reads, `added_ms` included: the wall time less the prefill and decode requests;
the commit logs its own `turn.committed` line (or `turn.commit_failed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import Any

import grpc
import structlog
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvshuttle.client import KvshuttleRpcError, RouterClient
from kvshuttle.client.convert import to_duration
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.gateway.config import DEFAULT_TENANT, GatewaySettings
from kvshuttle.gateway.engines import EngineClient, request_body
from kvshuttle.gateway.errors import GatewayError, engine_error, router_error
from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.gateway.protocol import (
    CONVERSATION_HEADER,
    SSE_DONE,
    ChatStream,
    CompletionStream,
    DecodeOutput,
    Kind,
    TurnRequest,
    chat_completion,
    completion,
    dumps,
    parse_request,
    sse,
)
from kvshuttle.gateway.tokenizer import ChatTokenizer, TemplateError
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.kv_transfer_params import from_vllm, to_vllm
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

__all__ = ["Gateway", "RequestLog"]

log = structlog.get_logger("kvshuttle.gateway")

_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~:-]{0,63}")
_PROPAGATOR = TraceContextTextMapPropagator()
# Status logged for a request whose client left before its response was complete (nginx's).
CLIENT_CLOSED = 499


def digest(text: str) -> str:
    """16 hex digits naming a conversation in logs (the router's spans use the same digest)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _enum_name(value: str, prefix: str) -> str:
    return value.removeprefix(prefix).lower()


@dataclass(slots=True)
class RequestLog:
    """The one `request.done` line of a request (and the turn span's attributes)."""

    endpoint: str
    request_id: str
    client_request_id: str = ""
    model: str = ""
    tenant: str = ""
    conversation: str = ""
    stream: bool = False
    status: int = 0
    outcome: str = "ok"
    error: str = ""
    decision: str = ""
    reason: str = ""
    generation: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    output_tokens: int = 0
    remote_cached_tokens: int | None = None
    stop_strings: bool = False
    tokenize_ms: float | None = None
    plan_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    # Waiting for the conversation's previous commit (in flight when this turn arrived).
    wait_ms: float | None = None
    ttft_ms: float | None = None
    # Decode's time to its first byte (streaming) or to its whole answer.
    decode_ttfb_ms: float | None = None
    # The gateway's share of the client's TTFT: ttft - prefill - decode's first byte.
    ttft_added_ms: float | None = None
    total_ms: float | None = None
    added_ms: float | None = None

    def fields(self) -> dict[str, Any]:
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None and v != ""}


@dataclass(slots=True)
class _Turn:
    handle: str
    conversation: str
    # Committed, aborted, or handed to a commit in flight: nothing left to abort.
    settled: bool = False


class _ClientGone(Exception):
    """The client closed the connection while its response was being written."""


@dataclass(slots=True)
class _Timing:
    start: float = field(default_factory=time.perf_counter)

    def ms(self) -> float:
        return _ms(time.perf_counter() - self.start)


class Gateway:
    """The request handlers and what they share: tokenizers, the router client, the engines' pool."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        tracer_provider: TracerProvider,
        metrics: GatewayMetrics | None = None,
        tokenizers: Mapping[str, ChatTokenizer] | None = None,
    ) -> None:
        self.settings = settings
        self._provider = tracer_provider
        self._tracer = tracer_provider.get_tracer("kvshuttle.gateway")
        self._metrics = metrics or GatewayMetrics()
        self.tokenizers: dict[str, ChatTokenizer] = (
            dict(tokenizers)
            if tokenizers is not None
            else {
                name: ChatTokenizer.load(
                    name,
                    model,
                    cache_bytes=settings.tokenizer_cache_bytes,
                    verify_fraction=settings.tokenizer_verify_fraction,
                )
                for name, model in settings.models.items()
            }
        )
        self._content_format = {name: m.content_format for name, m in settings.models.items()}
        self._keys = {_key_digest(key): tenant for key, tenant in settings.tenant_keys().items()}
        self._engines = EngineClient(settings.engines)
        self._router: RouterClient | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # Conversation -> its latest turn's commit while in flight.
        self._commits: dict[str, asyncio.Task[Any]] = {}
        self._started = int(time.time())
        self.draining = False

    # ---- lifecycle -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_request_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        options = self.settings.router.channel_options()
        self._router = RouterClient.connect(options, tracer_provider=self._provider)
        await self._engines.start()

    async def _cleanup(self, app: web.Application) -> None:
        # Commits, and aborts of requests cancelled by the shutdown, may still be in flight.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.settle(), self.settings.router.timeout + 1)
        if self._router is not None:
            await self._router.close()
        await self._engines.close()

    @property
    def router(self) -> RouterClient:
        if self._router is None:
            raise RuntimeError("the gateway app has not started")
        return self._router

    async def settle(self) -> None:
        """Wait until no commit or abort is in flight (one may start another)."""
        while self._background:
            await asyncio.wait(set(self._background))

    def _spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        """A task that outlives the request that started it (kept referenced, failures logged)."""
        task = asyncio.create_task(coro)
        self._background.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled() and (exc := t.exception()) is not None:
                log.error("gateway.background_failed", what=what, error=repr(exc)[:500])

        task.add_done_callback(done)
        return task

    # ---- plain endpoints -------------------------------------------------------------------

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except GatewayError as err:
            return self._error_response(err)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self._error_response(_http_error(exc))

    @staticmethod
    def _error_response(err: GatewayError, request_id: str = "") -> web.Response:
        headers = {"X-Request-Id": request_id} if request_id else {}
        if err.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return web.Response(
            status=err.status, body=dumps(err.body()), content_type="application/json", headers=headers
        )

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        self._tenant(request)
        data = [
            {"id": name, "object": "model", "created": self._started, "owned_by": "kvshuttle", "root": name}
            for name in self.settings.models
        ]
        return web.json_response({"object": "list", "data": data})

    def _tenant(self, request: web.Request) -> str:
        if not self._keys:
            return DEFAULT_TENANT
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        tenant = self._keys.get(_key_digest(key.strip())) if scheme.lower() == "bearer" and key else None
        if tenant is None:
            raise GatewayError(
                401,
                "Incorrect API key provided." if key else "Missing API key: send Authorization: Bearer KEY.",
                type_="authentication_error",
                code="invalid_api_key",
            )
        return tenant

    # ---- completions -----------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions")

    async def _handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        start = time.perf_counter()
        # Always the gateway's own: it is PlanTurn's idempotency key, and a client reusing its
        # X-Request-Id for two requests would otherwise get the first turn's plan back.
        request_id = uuid.uuid4().hex
        header_id = request.headers.get("X-Request-Id", "")
        rec = RequestLog(
            endpoint=kind,
            request_id=request_id,
            client_request_id=header_id if _REQUEST_ID.fullmatch(header_id) else "",
        )
        parent = _PROPAGATOR.extract(request.headers)
        with (
            structlog.contextvars.bound_contextvars(request_id=request_id),
            self._tracer.start_as_current_span("turn", context=parent, kind=SpanKind.SERVER) as span,
        ):
            try:
                response = await self._serve(request, kind, rec, start)
                rec.status = rec.status or response.status
                return response
            except GatewayError as err:
                rec.status, rec.error = err.status, err.code or err.type
                if rec.outcome == "ok":
                    rec.outcome = "error"
                return self._error_response(err, request_id)
            except asyncio.CancelledError:
                rec.status, rec.outcome = CLIENT_CLOSED, "client_disconnected"
                raise
            except Exception as exc:
                log.exception("request.failed")
                rec.status, rec.outcome, rec.error = 500, "error", type(exc).__name__
                internal = GatewayError(500, "internal error", type_="server_error", code="internal_error")
                return self._error_response(internal, request_id)
            finally:
                self._finish(rec, start, span)

    def _finish(self, rec: RequestLog, start: float, span: trace.Span) -> None:
        total = time.perf_counter() - start
        rec.total_ms = _ms(total)
        rec.added_ms = round(rec.total_ms - (rec.prefill_ms or 0.0) - (rec.decode_ms or 0.0), 3)
        if rec.ttft_ms is not None and rec.prefill_ms is not None and rec.decode_ttfb_ms is not None:
            rec.ttft_added_ms = round(rec.ttft_ms - rec.prefill_ms - rec.decode_ttfb_ms, 3)
        ctx = span.get_span_context()
        log.info("request.done", trace_id=format(ctx.trace_id, "032x"), **rec.fields())
        attributes: dict[str, Any] = {
            "http.response.status_code": rec.status,
            "kvshuttle.outcome": rec.outcome,
            "kvshuttle.endpoint": rec.endpoint,
            "kvshuttle.prompt_tokens": rec.prompt_tokens,
            "kvshuttle.output_tokens": rec.output_tokens,
            "kvshuttle.added.ms": rec.added_ms,
        }
        for name, value in (
            ("kvshuttle.tenant", rec.tenant),
            ("kvshuttle.conversation", rec.conversation),
            ("kvshuttle.decision", rec.decision),
            ("kvshuttle.decision.reason", rec.reason),
            ("kvshuttle.turn_index", rec.generation or None),
            ("kvshuttle.reused_tokens", rec.reused_tokens if rec.decision else None),
            ("kvshuttle.remote_cached_tokens", rec.remote_cached_tokens),
            ("kvshuttle.commit_wait.ms", rec.wait_ms),
            ("kvshuttle.ttft.ms", rec.ttft_ms),
            ("kvshuttle.tokenize.ms", rec.tokenize_ms),
            ("kvshuttle.prefill.ms", rec.prefill_ms),
            ("kvshuttle.decode.ms", rec.decode_ms),
        ):
            if value is not None and value != "":
                attributes[name] = value
        span.set_attributes(attributes)
        if rec.status >= 500 or rec.outcome not in ("ok", "client_disconnected"):
            span.set_status(Status(StatusCode.ERROR, rec.error or rec.outcome))
        self._metrics.requests.labels(rec.endpoint, str(rec.status)).inc()
        if rec.decision:
            self._metrics.added.observe(rec.added_ms / 1e3)
        if rec.ttft_ms is not None:
            self._metrics.ttft.observe(rec.ttft_ms / 1e3)

    async def _serve(
        self, request: web.Request, kind: Kind, rec: RequestLog, start: float
    ) -> web.StreamResponse:
        tenant = self._tenant(request)
        rec.tenant = tenant
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(
                413,
                f"the request body exceeds {self.settings.max_request_bytes} bytes",
                code="request_too_large",
            ) from None
        try:
            body = json.loads(raw)
        except ValueError:
            raise GatewayError.invalid("the request body is not valid JSON") from None
        treq = parse_request(
            kind,
            body,
            models=self.settings.models.keys(),
            default_max_tokens=self.settings.default_max_tokens,
            content_format=self._content_format,
            conversation_header=request.headers.get(CONVERSATION_HEADER),
        )
        rec.model, rec.stream, rec.stop_strings = treq.model, treq.stream, treq.stop_strings
        if treq.ignored:
            log.debug("request.ignored_fields", fields=treq.ignored)
        conversation = (
            f"tenants/{tenant}/conversations/{treq.conversation_id}" if treq.conversation_id else ""
        )
        rec.conversation = digest(conversation) if conversation else ""
        timer = _Timing()
        ids = await self._tokenize(self.tokenizers[treq.model], treq)
        rec.tokenize_ms = timer.ms()
        rec.prompt_tokens = len(ids)
        return await self._turn(request, treq, ids, conversation, rec, start)

    async def _tokenize(self, tok: ChatTokenizer, treq: TurnRequest) -> list[int]:
        if treq.kind == "completions":
            if treq.prompt_ids is not None:
                ids = treq.prompt_ids
            else:
                text = treq.prompt_text or ""
                ids = await self._encode_exact(tok, text, treq.add_special_tokens)
        else:
            if not tok.has_chat_template:
                raise GatewayError.invalid(
                    f"model {treq.model!r} has no chat template; use /v1/completions", "messages"
                )
            try:
                text = tok.render(
                    treq.messages,
                    add_generation_prompt=treq.add_generation_prompt,
                    template_kwargs=treq.template_kwargs,
                )
            except TemplateError as exc:
                raise GatewayError.invalid(
                    f"chat template: {exc}", "messages", code="chat_template_error"
                ) from None
            if treq.add_special_tokens or not tok.cached:
                ids = await self._encode_exact(tok, text, treq.add_special_tokens)
            else:
                parts, missing = tok.pieces(text)
                if tok.needs_thread(missing):
                    encoded = await asyncio.to_thread(tok.encode_missing, missing)
                else:
                    encoded = tok.encode_missing(missing)
                ids = tok.assemble(parts, missing, encoded)
                if tok.should_verify():
                    self._spawn(self._verify(tok, text, ids), "tokenizer.verify")
        if not ids:
            raise GatewayError.invalid(
                "the prompt is empty", "prompt" if treq.kind == "completions" else "messages"
            )
        if len(ids) > self.settings.max_prompt_tokens:
            raise GatewayError.invalid(
                f"the prompt has {len(ids)} tokens, more than {self.settings.max_prompt_tokens}",
                code="context_length_exceeded",
            )
        return ids

    @staticmethod
    async def _verify(tok: ChatTokenizer, text: str, ids: list[int]) -> None:
        """Re-tokenize the whole chat off the event loop; a mismatch turns the cache off (here,
        on the loop: the cache belongs to it)."""
        mismatch = await asyncio.to_thread(tok.check, text, ids)
        if mismatch and tok.cached:
            tok.disable_cache(mismatch)

    @staticmethod
    async def _encode_exact(tok: ChatTokenizer, text: str, add_special_tokens: bool) -> list[int]:
        if tok.needs_thread([text]):
            return await asyncio.to_thread(tok.encode_exact, text, add_special_tokens=add_special_tokens)
        return tok.encode_exact(text, add_special_tokens=add_special_tokens)

    # ---- the turn --------------------------------------------------------------------------

    async def _turn(
        self,
        request: web.Request,
        treq: TurnRequest,
        ids: list[int],
        conversation: str,
        rec: RequestLog,
        start: float,
    ) -> web.StreamResponse:
        served = self.settings.served_name(treq.model)
        previous = self._commits.get(conversation) if conversation else None
        if previous is not None:
            # The previous turn's retention is what this turn may read: plan once it is stored.
            # (A commit never raises; a client leaving now does not cancel it.)
            timer = _Timing()
            await asyncio.wait({previous}, timeout=self.settings.router.timeout)
            rec.wait_ms = timer.ms()
        timer = _Timing()
        try:
            plan = await self.router.plan_turn(
                served, ids, conversation=conversation, request_id=rec.request_id
            )
        except KvshuttleRpcError as err:
            rec.plan_ms = timer.ms()
            rec.outcome = "router_error"
            raise router_error(err) from None
        rec.plan_ms = timer.ms()
        rec.decision = _enum_name(pb.Decision.Name(plan.decision), "DECISION_")
        rec.reason = _enum_name(pb.DecisionReason.Name(plan.reason), "DECISION_REASON_")
        rec.generation = plan.generation
        rec.reused_tokens = plan.reusable_tokens
        self._metrics.turns.labels(rec.decision, rec.reason).inc()
        self._metrics.reused_tokens.inc(plan.reusable_tokens)

        turn = _Turn(plan.turn, conversation)
        prompt_json = json.dumps(ids, separators=(",", ":")).encode()
        try:
            if not plan.prefill.http_endpoint or not plan.decode.http_endpoint:
                raise engine_error(
                    "prefill", None, "the router placed the turn on a node without an HTTP endpoint"
                )
            decode_params = await self._prefill(plan, treq, served, prompt_json, rec)
            fields: dict[str, Any] = {"model": served, **treq.decode_params, "return_token_ids": True}
            if decode_params is not None:
                fields["kv_transfer_params"] = decode_params
            if treq.stream:
                fields.update(stream=True, stream_options={"include_usage": True})
                return await self._decode_stream(
                    request, plan, turn, treq, ids, request_body(prompt_json, fields), rec, start
                )
            fields["stream"] = False
            return await self._decode(plan, turn, treq, ids, request_body(prompt_json, fields), rec, start)
        except BaseException as exc:
            if not turn.settled:
                turn.settled = True
                why = exc.message if isinstance(exc, GatewayError) else type(exc).__name__
                if isinstance(exc, asyncio.CancelledError):
                    why = "client disconnected"
                await self._abort(turn.handle, why)
                if isinstance(exc, GatewayError) and rec.outcome == "ok":
                    rec.outcome = (
                        "engine_error"
                        if exc.status in (502, 504) or exc.code == "engine_rejected"
                        else "error"
                    )
            raise

    def _engine_span(self, role: str, placed: pb.Placement) -> AbstractContextManager[trace.Span]:
        """The current span of a request to the engine the plan placed on `role`."""
        return self._tracer.start_as_current_span(
            role,
            kind=SpanKind.CLIENT,
            attributes={"kvshuttle.node": placed.node, "server.address": placed.http_endpoint},
        )

    def _headers(self, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        _PROPAGATOR.inject(headers)  # the current span: prefill's or decode's
        return headers

    async def _prefill(
        self, plan: pb.PlanTurnResponse, treq: TurnRequest, served: str, prompt_json: bytes, rec: RequestLog
    ) -> dict[str, Any] | None:
        """Run prefill; the params decode must get (P's, unchanged), or None for none."""
        fields: dict[str, Any] = {"model": served, **treq.prefill_params, "max_tokens": 1, "stream": False}
        if plan.HasField("prefill_kv_transfer_params"):
            fields["kv_transfer_params"] = to_vllm(plan.prefill_kv_transfer_params)
        with self._engine_span("prefill", plan.prefill) as span:
            timer = _Timing()
            try:
                body = await self._engines.complete(
                    "prefill",
                    plan.prefill.http_endpoint,
                    request_body(prompt_json, fields),
                    self._headers(f"{rec.request_id}-p"),
                    timeout_s=self.settings.engines.prefill_timeout_s,
                )
            finally:
                rec.prefill_ms = timer.ms()
            params = body.get("kv_transfer_params")
            if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
                # No params (P runs without the NIXL connector), or not P's kind: decode computes
                # the prompt itself. A made-up dict instead would make decode hold its blocks.
                log.warning(
                    "prefill.no_kv_transfer_params", node=plan.prefill.node, got=type(params).__name__
                )
                return None
            cached = params.get("remote_prefill_cached_tokens")
            if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
                rec.remote_cached_tokens = cached
                span.set_attribute("kvshuttle.remote_cached_tokens", cached)
            return params

    async def _decode(
        self,
        plan: pb.PlanTurnResponse,
        turn: _Turn,
        treq: TurnRequest,
        ids: list[int],
        body: bytes,
        rec: RequestLog,
        start: float,
    ) -> web.StreamResponse:
        with self._engine_span("decode", plan.decode):
            timer = _Timing()
            try:
                answer = await self._engines.complete(
                    "decode",
                    plan.decode.http_endpoint,
                    body,
                    self._headers(f"{rec.request_id}-d"),
                    timeout_s=self.settings.engines.decode_timeout_s,
                )
            finally:
                rec.decode_ms = rec.decode_ttfb_ms = timer.ms()
        choices = answer.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise engine_error("decode", None, "the answer has no choices")
        rec.ttft_ms = _ms(time.perf_counter() - start)
        out = DecodeOutput()
        out.take_choice(choices[0])
        usage = answer.get("usage")
        out.usage = usage if isinstance(usage, dict) else None
        params = answer.get("kv_transfer_params")
        out.kv_transfer_params = params if isinstance(params, dict) else None
        rec.output_tokens = len(out.token_ids)
        self._commit(turn, ids, out, rec)
        response_id = self._response_id(treq, rec)
        if treq.kind == "chat":
            created = answer.get("created")
            payload = chat_completion(
                response_id=response_id,
                created=created if isinstance(created, int) else int(time.time()),
                model=treq.model,
                out=out,
                prompt_ids=ids,
                token_ids=treq.return_token_ids,
            )
        else:
            payload = completion(
                answer, response_id=response_id, model=treq.model, token_ids=treq.return_token_ids
            )
        return web.Response(body=dumps(payload), content_type="application/json", headers=turn_headers(rec))

    @staticmethod
    def _response_id(treq: TurnRequest, rec: RequestLog) -> str:
        return f"{'chatcmpl' if treq.kind == 'chat' else 'cmpl'}-{rec.request_id}"

    async def _decode_stream(
        self,
        request: web.Request,
        plan: pb.PlanTurnResponse,
        turn: _Turn,
        treq: TurnRequest,
        ids: list[int],
        body: bytes,
        rec: RequestLog,
        start: float,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **turn_headers(rec)}
        )
        response_id = self._response_id(treq, rec)
        created = int(time.time())
        translator: ChatStream | CompletionStream = (
            ChatStream(
                response_id=response_id, created=created, model=treq.model, prompt_ids=ids, request=treq
            )
            if treq.kind == "chat"
            else CompletionStream(response_id=response_id, model=treq.model, request=treq)
        )
        out = DecodeOutput()

        async def write(data: bytes) -> None:
            try:
                await response.write(data)
            except ConnectionResetError:  # aiohttp's ClientConnectionResetError included
                raise _ClientGone from None

        timer = _Timing()
        try:
            with self._engine_span("decode", plan.decode):
                headers = self._headers(f"{rec.request_id}-d")
                async with self._engines.stream("decode", plan.decode.http_endpoint, body, headers) as chunks:
                    try:  # decode answered 200: the client gets 200 too
                        await response.prepare(request)
                    except ConnectionResetError:
                        raise _ClientGone from None
                    await self._relay(chunks, translator, out, write, rec, start, timer)
                rec.decode_ms = timer.ms()
                if out.finish_reason is None:
                    raise engine_error("decode", None, "the stream ended without a finish_reason")
        except _ClientGone:
            rec.decode_ms = timer.ms()
            rec.status, rec.outcome = CLIENT_CLOSED, "client_disconnected"
            turn.settled = True
            await self._abort(turn.handle, "client disconnected")
            return response
        except GatewayError as err:
            rec.decode_ms = rec.decode_ms or timer.ms()
            if not response.prepared:
                raise  # no byte sent yet: the client gets a plain error response
            # Mid-stream: the status line is long gone; end the stream with an error event.
            rec.status, rec.outcome, rec.error = err.status, "engine_error", err.code or err.type
            turn.settled = True
            await self._abort(turn.handle, err.message)
            with contextlib.suppress(_ClientGone):
                await write(sse(err.body()) + SSE_DONE)
            return response
        rec.output_tokens = len(out.token_ids)
        self._commit(turn, ids, out, rec)
        try:
            await write(SSE_DONE)
            await response.write_eof()
        except (_ClientGone, ConnectionResetError):
            rec.status, rec.outcome = CLIENT_CLOSED, "client_disconnected"
        rec.status = rec.status or 200
        return response

    @staticmethod
    async def _relay(
        chunks: AsyncIterator[dict[str, Any]],
        translator: ChatStream | CompletionStream,
        out: DecodeOutput,
        write: Callable[[bytes], Awaitable[None]],
        rec: RequestLog,
        start: float,
        timer: _Timing,
    ) -> None:
        """Decode's chunks to the client as they come; what the commit needs is kept in `out`."""
        async for chunk in chunks:
            if not out.chunks:
                rec.decode_ttfb_ms = timer.ms()
            out.chunks += 1
            params = chunk.get("kv_transfer_params")
            if isinstance(params, dict):
                out.kv_transfer_params = params
            choices = chunk.get("choices")
            if isinstance(choices, list) and choices and isinstance(choices[0], dict):
                out.take_choice(choices[0])
            if isinstance(chunk.get("usage"), dict):
                out.usage = chunk["usage"]
            data = translator.events(chunk)
            if data:
                await write(data)
                if rec.ttft_ms is None:
                    rec.ttft_ms = _ms(time.perf_counter() - start)

    # ---- commit and abort ------------------------------------------------------------------

    def _commit(self, turn: _Turn, ids: list[int], out: DecodeOutput, rec: RequestLog) -> None:
        """CommitTurn in the background: the client's answer is complete without it, and a
        client leaving now must not lose the retention decode holds. The conversation's next
        turn waits for it (in _turn)."""
        turn.settled = True
        timings = pb.TurnTimings()
        if rec.ttft_ms is not None:
            timings.ttft.CopyFrom(to_duration(rec.ttft_ms / 1e3))
        if rec.prefill_ms is not None:
            timings.prefill.CopyFrom(to_duration(rec.prefill_ms / 1e3))
        if rec.decode_ms is not None:
            timings.decode.CopyFrom(to_duration(rec.decode_ms / 1e3))
        if rec.remote_cached_tokens is not None:
            timings.remote_cached_tokens = rec.remote_cached_tokens
        call = self._commit_call(turn.handle, ids, out, timings, rec.request_id, rec.stop_strings)
        task = self._spawn(call, "commit")
        if conversation := turn.conversation:
            self._commits[conversation] = task

            def forget(t: asyncio.Task[Any]) -> None:
                if self._commits.get(conversation) is t:
                    del self._commits[conversation]

            task.add_done_callback(forget)

    async def _commit_call(
        self,
        handle: str,
        ids: list[int],
        out: DecodeOutput,
        timings: pb.TurnTimings,
        request_id: str,
        stop_strings: bool,
    ) -> None:
        """The CommitTurn RPC (decode's params converted here, off the response's path) and its
        log line; a failed commit aborts the turn, which releases a claimed retention the
        commit did not."""
        timer = _Timing()
        params: KvTransferParams | None = None
        if out.kv_transfer_params is not None:
            try:
                params = from_vllm(out.kv_transfer_params, "decode.kv_transfer_params")
            except InvalidArgument as exc:
                log.warning("decode.bad_kv_transfer_params", error=exc.message)
        elif out.finish_reason is not None:
            log.debug("decode.no_kv_transfer_params", stop_strings=stop_strings)
        tokens = ids + out.token_ids if out.ids_complete else ids
        try:
            result = await self.router.commit_turn(
                handle, token_ids=tokens, decode_kv_transfer_params=params, timings=timings
            )
        except KvshuttleRpcError as err:
            self._metrics.commits.labels("failed").inc()
            log.warning(
                "turn.commit_failed",
                code=err.code_name,
                reason=err.reason,
                message=err.message[:300],
                commit_ms=timer.ms(),
                request_id=request_id,
            )
            await self._abort_call(handle, "commit failed")
            return
        self._metrics.commits.labels("stored" if result.retention else "nothing_retained").inc()
        log.info("turn.committed", retention=result.retention, commit_ms=timer.ms(), request_id=request_id)

    async def _abort(self, handle: str, reason: str) -> None:
        """AbortTurn, shielded from the request's cancellation; failures are logged, not raised."""
        await asyncio.shield(self._spawn(self._abort_call(handle, reason[:300]), "abort"))

    async def _abort_call(self, handle: str, reason: str) -> None:
        try:
            await self.router.abort_turn(handle, reason=reason)
        except KvshuttleRpcError as err:
            level = log.debug if err.code == grpc.StatusCode.FAILED_PRECONDITION else log.warning
            level("turn.abort_failed", code=err.code_name, reason=err.reason)


def turn_headers(rec: RequestLog) -> dict[str, str]:
    """What the router decided for this turn, for clients and dashboards (sent before the body,
    so a streaming client sees them with the first byte)."""
    headers = {
        "X-Request-Id": rec.request_id,
        "X-Kvshuttle-Decision": rec.decision,
        "X-Kvshuttle-Reason": rec.reason,
        "X-Kvshuttle-Generation": str(rec.generation),
        "X-Kvshuttle-Prompt-Tokens": str(rec.prompt_tokens),
        "X-Kvshuttle-Reused-Tokens": str(rec.reused_tokens),
    }
    if rec.remote_cached_tokens is not None:
        # Prefill's own count: tokens it read remotely plus its local prefix-cache hits.
        headers["X-Kvshuttle-Prefill-Cached-Tokens"] = str(rec.remote_cached_tokens)
    if rec.prefill_ms is not None:
        headers["X-Kvshuttle-Prefill-Ms"] = f"{rec.prefill_ms:.1f}"
    return headers


def _http_error(exc: web.HTTPException) -> GatewayError:
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
        exc.status, "http_error"
    )
    return GatewayError(exc.status, exc.reason or "error", code=code)
