"""The gateway's HTTP server: OpenAI-compatible endpoints, each request one turn that
kvshuttle.gateway.turns.runner runs (PlanTurn -> prefill -> decode -> CommitTurn).

Per request, here: authenticate (API key -> tenant), validate (kvshuttle.gateway.openai.protocol),
tokenize the prompt exactly as the engine would (kvshuttle.gateway.prompts.tokenizer), derive the turn's
vLLM cache salt from the tenant (kvshuttle.gateway.prompts.salts), hand the turn to the runner, and
answer: one JSON body, or server-sent events as decode streams (a failure after
the first byte ends the stream with an error event). Errors are OpenAI-style bodies
(kvshuttle.gateway.errors); a client that leaves mid-answer is logged with status 499. Every
request ends with one `request.done` line (kvshuttle.gateway.turns.request_log).

One module: the gateway's whole HTTP surface (routes, auth, the two ways of answering a turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
import structlog
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvshuttle.core.digest import log_digest
from kvshuttle.gateway.affinity import affinity_key
from kvshuttle.gateway.config import DEFAULT_TENANT, GatewaySettings
from kvshuttle.gateway.errors import GatewayError
from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.gateway.openai.prompt import Transcripts, prompt_ids, transcript_spec
from kvshuttle.gateway.openai.protocol import (
    CONVERSATION_HEADER,
    SESSION_HEADER,
    THINK_TIME_HEADER,
    Kind,
    TurnRequest,
    expected_think_time,
    parse_request,
)
from kvshuttle.gateway.openai.responses import (
    SSE_DONE,
    ChatStream,
    CompletionStream,
    chat_completion,
    completion,
    dumps,
    sse,
    with_cached_tokens,
)
from kvshuttle.gateway.parsing import OutputParser, check_parsers, reasoning_decode_params
from kvshuttle.gateway.pd_headers import PROMPT_HEADER, prompt_digest
from kvshuttle.gateway.prompts.salts import CacheSalts
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.gateway.turns.background import BackgroundTasks
from kvshuttle.gateway.turns.engines import EngineClient
from kvshuttle.gateway.turns.record import DecodeOutput, Turn
from kvshuttle.gateway.turns.request_log import RequestLog
from kvshuttle.gateway.turns.router_port import GrpcRouterPort
from kvshuttle.gateway.turns.runner import ClientGone, TurnRunner
from kvshuttle.router.v1 import router_service_pb2 as pb

__all__ = ["Fallback", "Gateway"]

# What answers a turn that failed before its first byte instead of an error (the sidecar's
# plain serving); given the failure.
Fallback = Callable[[GatewayError], Awaitable[web.StreamResponse]]

log = structlog.get_logger("kvshuttle.gateway")

_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~:-]{0,63}")
_PROPAGATOR = TraceContextTextMapPropagator()
# Status logged for a request whose client left before its response was complete (nginx's).
CLIENT_CLOSED = 499


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Gateway:
    """The request handlers and what they share: tokenizers, the turn runner, the router's
    client and the engines' pool."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        tracer_provider: TracerProvider,
        metrics: GatewayMetrics | None = None,
        tokenizers: Mapping[str, ChatTokenizer] | None = None,
        hold_for_commit: bool = False,
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        """`tenant`: every request's without API keys. `hold_for_commit`:
        the answer ends only once its turn's commit has landed (bounded by router.timeout), for
        turns planned elsewhere (the sidecar)."""
        self.settings = settings
        self._default_tenant = tenant
        self._hold_for_commit = hold_for_commit
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
        self._tool_parsers = {name: m.tool_call_parser for name, m in settings.models.items()}
        for name, m in settings.models.items():  # a parser whose tokens the model lacks: fail now
            check_parsers(m.tool_call_parser, m.reasoning_parser, self.tokenizers[name].tokenizer.token_to_id)
        # The models in history mode exact_tokens: their turns keep transcripts.
        self._exact = {n for n, m in settings.models.items() if m.history == "exact_tokens"}
        self._keys = {_key_digest(key): tenant for key, tenant in settings.tenant_keys().items()}
        key = None if settings.cache_salt_key is None else settings.cache_salt_key.get_secret_value().encode()
        self._salts = CacheSalts.from_key(key)
        self._engines = EngineClient(settings.engines)
        self._router = GrpcRouterPort(
            settings.router,
            tracer_provider=tracer_provider,
            metrics=self._metrics,
            affinity_key=affinity_key(key),
        )
        self._background = BackgroundTasks()
        self._turns = TurnRunner(
            self._router,
            self._engines,
            tracer=self._tracer,
            metrics=self._metrics,
            background=self._background,
            prefill_timeout_s=settings.engines.prefill_timeout_s,
            reuse_prefill_timeout_s=settings.engines.reuse_prefill_timeout_s,
            decode_timeout_s=settings.engines.decode_timeout_s,
            commit_wait_s=settings.router.timeout,
        )
        self._started = int(time.time())
        self.draining = False

    # ---- lifecycle -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_request_bytes, middlewares=[self.errors])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        self.attach(app)
        return app

    def attach(self, app: web.Application) -> None:
        """Open the router's channels and the engines' pool with `app`, close them after it."""
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)

    async def _startup(self, app: web.Application) -> None:
        self._router.connect()
        await self._engines.start()

    async def _cleanup(self, app: web.Application) -> None:
        # Commits, and aborts of requests cancelled by the shutdown, may still be in flight.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.settle(), self.settings.router.timeout + 1)
        await self._router.close()
        await self._engines.close()

    @property
    def router(self) -> GrpcRouterPort:
        """The router port the turn runner calls (one client per replica with affinity)."""
        return self._router

    async def settle(self) -> None:
        """Wait until no commit or abort is in flight (one may start another)."""
        await self._background.settle()

    # ---- plain endpoints -------------------------------------------------------------------

    @web.middleware
    async def errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except GatewayError as err:
            return _error_response(err)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error_response(_http_error(exc))

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
            return self._default_tenant
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
        return await self.handle(request, kind)

    async def handle(
        self,
        request: web.Request,
        kind: Kind,
        *,
        plan: pb.PlanTurnResponse | None = None,
        fallback: Fallback | None = None,
    ) -> web.StreamResponse:
        """One request's turn. `plan`: its plan, made elsewhere (the sidecar: the endpoint
        picker's); None: PlanTurn here. `fallback`: answers instead of an error response when
        the turn fails before the client got a byte (the request's body stays readable)."""
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
                response = await self._serve(request, kind, rec, start, plan)
                rec.status = rec.status or response.status
                return response
            except GatewayError as err:
                rec.status, rec.error = err.status, err.code or err.type
                if fallback is not None:
                    rec.outcome = "fell_back"
                    response = await fallback(err)
                    rec.status = response.status
                    return response
                if rec.outcome == "ok":
                    rec.outcome = "error"
                return _error_response(err, request_id)
            except asyncio.CancelledError:
                rec.status, rec.outcome = CLIENT_CLOSED, "client_disconnected"
                raise
            except Exception as exc:
                log.exception("request.failed")
                rec.status, rec.outcome, rec.error = 500, "error", type(exc).__name__
                internal = GatewayError(500, "internal error", type_="server_error", code="internal_error")
                return _error_response(internal, request_id)
            finally:
                rec.finish(start, span, self._metrics)

    async def _serve(
        self,
        request: web.Request,
        kind: Kind,
        rec: RequestLog,
        start: float,
        plan: pb.PlanTurnResponse | None,
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
            # orjson: ~3x the stdlib's speed on a long prompt's ids (2.3 -> 0.8 ms at 32k). It is
            # stricter (NaN, Infinity and lone surrogates are refused; an integer past 64 bits
            # is a float, which no integer field takes), and its errors are ValueErrors too.
            body = orjson.loads(raw)
        except ValueError:
            raise GatewayError.invalid("the request body is not valid JSON") from None
        treq = parse_request(
            kind,
            body,
            models=self.settings.models.keys(),
            default_max_tokens=self.settings.default_max_tokens,
            content_format=self._content_format,
            conversation_header=request.headers.get(CONVERSATION_HEADER),
            session_header=request.headers.get(SESSION_HEADER),
            tool_parsers=self._tool_parsers,
        )
        if treq.kind == "chat":  # e.g. qwen3 reads its markers with special tokens kept
            treq.decode_params.update(
                reasoning_decode_params(self.settings.models[treq.model].reasoning_parser)
            )
        rec.model, rec.stream, rec.stop_strings = treq.model, treq.stream, treq.stop_strings
        if treq.ignored:
            log.debug("request.ignored_fields", fields=treq.ignored)
        conversation = (
            f"tenants/{tenant}/conversations/{treq.conversation_id}" if treq.conversation_id else ""
        )
        tokenizing = time.perf_counter()
        served = self.settings.served_name(treq.model)
        salt = self._salts.salt(tenant, treq.cache_salt)
        # Without a conversation id, when finding is on, the router finds the turn's conversation
        # by the prompt (which a transcript starts with decode's own ids), or starts one.
        finding = self.settings.find_conversations and not conversation
        transcripts = (
            Transcripts(self._router, f"tenants/{tenant}", served, salt, conversation)
            if treq.model in self._exact and (conversation or finding)
            else None
        )
        tok = self.tokenizers[treq.model]
        prompt = await prompt_ids(
            tok,
            treq,
            max_tokens=self.settings.max_prompt_tokens,
            background=self._background,
            transcripts=transcripts,
        )
        if plan is not None and request.headers.get(PROMPT_HEADER) != prompt_digest(prompt.ids):
            # Planned elsewhere for other ids (the picker found another transcript, or none):
            # the plan's KV is not this prompt's.
            raise GatewayError(
                502, "the plan was made for another prompt", type_="server_error", code="prompt_mismatch"
            )
        # A transcript found without an id names a conversation, but the plan does not take it:
        # the router finds it again by the prompt (the transcript's ids make the chain match), and
        # a fork's siblings, which all find the same one, get conversations of their own there.
        rec.conversation = log_digest(conversation) if conversation else ""
        ids = prompt.ids
        rec.tokenize_ms = round((time.perf_counter() - tokenizing) * 1e3, 3)
        rec.prompt_tokens = len(ids)
        turn = Turn(
            request_id=rec.request_id,
            model=served,
            conversation=conversation,
            prompt_ids=ids,
            prefill_params=treq.prefill_params,
            decode_params=treq.decode_params,
            arrived=start,
            cache_salt=salt,
            stop_strings=treq.stop_strings,
            expected_think_time_s=self._think_time(treq, request.headers.get(THINK_TIME_HEADER)),
            finish_reason=self._finish_reader(treq),
            tenant=f"tenants/{tenant}" if finding else "",
            transcript=(lambda out: transcript_spec(tok, prompt, out)) if prompt.lookup_key else None,
        )
        try:
            if treq.stream:
                response = await self._stream(request, treq, turn, rec, plan)
            else:
                response = await self._complete(treq, turn, plan)
            return response
        finally:
            rec.add_turn(turn)

    # ---- the turn's response ---------------------------------------------------------------

    async def _complete(
        self, treq: TurnRequest, turn: Turn, plan: pb.PlanTurnResponse | None
    ) -> web.Response:
        answer = await self._turns.complete(turn, plan)
        if self._holds(turn):
            await self._turns.committed(turn.conversation)
        response_id = _response_id(treq, turn)
        if treq.kind == "chat":
            created = answer.get("created")
            payload = chat_completion(
                response_id=response_id,
                created=created if isinstance(created, int) else int(time.time()),
                model=treq.model,
                out=turn.output,
                prompt_ids=turn.prompt_ids,
                token_ids=treq.return_token_ids,
                cached_tokens=turn.remote_cached_tokens,
                parser=self._output_parser(treq),
            )
        else:
            payload = completion(
                answer,
                response_id=response_id,
                model=treq.model,
                token_ids=treq.return_token_ids,
                cached_tokens=turn.remote_cached_tokens,
            )
        return web.Response(body=dumps(payload), content_type="application/json", headers=turn_headers(turn))

    def _holds(self, turn: Turn) -> bool:
        """Whether the answer ends only once the turn's commit has landed: for a sidecar's turns
        (planned elsewhere), and for a turn of no conversation id (or one that keeps a
        transcript), which the client's next request, on whichever replica, finds by what it
        holds only once it is stored (and whose parent the commit may remove: its forks
        continue it)."""
        return self._hold_for_commit or turn.transcript is not None or bool(turn.tenant)

    def _think_time(self, treq: TurnRequest, header: str | None) -> float | None:
        """The client's hint, else the agent default for a request that declares tools."""
        seconds = expected_think_time(header)
        if seconds is None and treq.tools is not None:
            seconds = self.settings.agent_think_time_s
        return seconds

    def _finish_reader(self, treq: TurnRequest) -> Callable[[DecodeOutput], str | None] | None:
        """How the answer ended, for CommitTurn's turn_end: with tools declared, "tool_calls"
        whenever the answer parses as a tool call (a fresh parser: a stream's is stateful), even
        where the client is told "stop" (vLLM's finish_reason for a named tool_choice), else the
        client's finish_reason; without tools, decode's own (None)."""
        if treq.tools is None:
            return None

        def finish(out: DecodeOutput) -> str | None:
            parser = self._output_parser(treq)
            assert parser is not None  # tools were declared
            message, reason = parser.message(out.text, out.token_ids, out.finish_reason)
            return "tool_calls" if message.get("tool_calls") else reason

        return finish

    def _output_parser(self, treq: TurnRequest) -> OutputParser | None:
        """What splits a chat answer into content, reasoning and tool calls; None when it is
        all content (no tools, no reasoning parser)."""
        model = self.settings.models[treq.model]
        if treq.tools is None and model.reasoning_parser is None:
            return None
        return OutputParser(
            tool_request=treq.tools,
            tool_parser=model.tool_call_parser,
            reasoning_parser=model.reasoning_parser,
            vocab=self.tokenizers[treq.model].tokenizer.token_to_id,
            include_reasoning=treq.include_reasoning,
        )

    async def _stream(
        self,
        request: web.Request,
        treq: TurnRequest,
        turn: Turn,
        rec: RequestLog,
        plan: pb.PlanTurnResponse | None,
    ) -> web.StreamResponse:
        response_id = _response_id(treq, turn)
        translator: ChatStream | CompletionStream = (
            ChatStream(
                response_id=response_id,
                created=int(time.time()),
                model=treq.model,
                prompt_ids=turn.prompt_ids,
                token_ids=treq.return_token_ids,
                include_usage=treq.include_usage,
                parser=self._output_parser(treq),
            )
            if treq.kind == "chat"
            else CompletionStream(
                response_id=response_id,
                model=treq.model,
                token_ids=treq.return_token_ids,
                include_usage=treq.include_usage,
            )
        )
        events = _EventStream(request, turn, translator)
        try:
            await self._turns.stream(turn, events, plan)
        except ClientGone:
            rec.status, rec.outcome = CLIENT_CLOSED, "client_disconnected"
            return events.response
        except GatewayError as err:
            if not events.response.prepared:
                raise  # no byte sent yet: the client gets a plain error response
            # Mid-stream: the status line is long gone; end the stream with an error event.
            rec.status, rec.error = err.status, err.code or err.type
            with contextlib.suppress(ClientGone):
                await events.write(sse(err.body()) + SSE_DONE)
            return events.response
        try:
            if self._holds(turn):
                await self._turns.committed(turn.conversation)
            await events.write(SSE_DONE)
            await events.response.write_eof()
        except (ClientGone, ConnectionResetError):
            rec.status, rec.outcome = CLIENT_CLOSED, "client_disconnected"
        rec.status = rec.status or 200
        return events.response


class _EventStream:
    """The client's text/event-stream response: the turn runner's DecodeSink."""

    def __init__(self, request: web.Request, turn: Turn, translator: ChatStream | CompletionStream) -> None:
        self._request = request
        self._turn = turn
        self._translator = translator
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

    async def open(self) -> None:
        self.response.headers.update(turn_headers(self._turn))
        try:
            await self.response.prepare(self._request)
        except ConnectionResetError:
            raise ClientGone from None

    async def send(self, chunk: dict[str, Any]) -> bool:
        if "usage" in chunk:  # known by now: prefill answered before decode streamed
            chunk["usage"] = with_cached_tokens(chunk["usage"], self._turn.remote_cached_tokens)
        data = self._translator.events(chunk)
        if data:
            await self.write(data)
        return bool(data)

    async def write(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError included
            raise ClientGone from None


def turn_headers(turn: Turn) -> dict[str, str]:
    """What the router decided for this turn, for clients and dashboards (sent before the body,
    so a streaming client sees them with the first byte). A reuse turn whose prefill fell back
    to recomputing (turn.fallback) says what ran: recompute, 0 tokens reused."""
    headers = {
        "X-Request-Id": turn.request_id,
        "X-Kvshuttle-Decision": "recompute" if turn.fallback else turn.decision,
        "X-Kvshuttle-Reason": turn.reason,
        "X-Kvshuttle-Generation": str(turn.generation),
        "X-Kvshuttle-Prompt-Tokens": str(len(turn.prompt_ids)),
        "X-Kvshuttle-Reused-Tokens": str(turn.reused_tokens),
    }
    if turn.remote_cached_tokens is not None:
        # Prefill's own count: tokens it read remotely plus its local prefix-cache hits.
        headers["X-Kvshuttle-Prefill-Cached-Tokens"] = str(turn.remote_cached_tokens)
    if turn.prefill_s is not None:
        # The request.done line's prefill_ms (rounded to the microsecond), to one decimal.
        headers["X-Kvshuttle-Prefill-Ms"] = f"{round(turn.prefill_s * 1e3, 3):.1f}"
    return headers


def _response_id(treq: TurnRequest, turn: Turn) -> str:
    return f"{'chatcmpl' if treq.kind == 'chat' else 'cmpl'}-{turn.request_id}"


def _error_response(err: GatewayError, request_id: str = "") -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.Response(
        status=err.status, body=dumps(err.body()), content_type="application/json", headers=headers
    )


def _http_error(exc: web.HTTPException) -> GatewayError:
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
        exc.status, "http_error"
    )
    return GatewayError(exc.status, exc.reason or "error", code=code)
