"""The sidecar's plain serving, as llm-d's routing sidecar serves a request (its NIXL v2
connector): the client's own OpenAI request, not tokenized here.

- P->D (`disaggregated`): prefill gets the request with `kv_transfer_params` asking it to keep
  its KV for a remote decode (`do_remote_decode: true`), `stream: false`, `max_tokens: 1`
  (and `max_completion_tokens: 1` when the request sets that) and no `stream_options`; decode
  then gets the request as sent with prefill's `kv_transfer_params`, and its answer (status,
  headers, bytes, streamed or not) goes back unchanged. Both requests share one X-Request-Id.
  Where llm-d would fail the request, this degrades: a prefill that fails (5xx, no answer, a
  connection error) leaves decode to compute the prompt itself; a prefill that refuses the
  request (4xx) answers the client with its refusal, as decode would.
- Local (`local`): the request to this pod's decode, its answer back unchanged.

A client's own `kv_transfer_params` never reach an engine: they would point the engine's KV
reads at any address (the SSRF guard's second half). The sidecar's and kvshuttle's headers are
not forwarded either.

Traced as the gateway traces a turn: a SERVER span `request` (`kvshuttle.sidecar.mode` llmd or
local; a child of the caller's `traceparent`) unless a planned turn's span is current (its
fallback), and a CLIENT span `prefill` / `decode` per engine request, whose context the engine
gets as `traceparent` / `tracestate` (vLLM's `llm_request` span joins the trace). Other paths
pass the caller's trace context on as it came.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import aiohttp
import orjson
import structlog
from aiohttp import web
from multidict import CIMultiDict
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvshuttle.gateway.config import EngineSettings
from kvshuttle.gateway.errors import GatewayError
from kvshuttle.gateway.pd_headers import KVSHUTTLE_HEADERS, PREFILLER_HOST_PORT_HEADER
from kvshuttle.sidecar.metrics import SidecarMetrics

__all__ = ["PlainProxy", "host_url"]

log = structlog.get_logger("kvshuttle.sidecar")

# Turn 1's prefill params, as llm-d sends them (nulls included: vLLM reads each with .get()).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Not forwarded: hop-by-hop (RFC 9110 7.6.1), recomputed by aiohttp, or the sidecar's own.
_DROP_REQUEST = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "accept-encoding",
        "x-request-id",
        # Set anew: the engine request's own span (else the caller's, as it came).
        "traceparent",
        "tracestate",
        PREFILLER_HOST_PORT_HEADER,
        *KVSHUTTLE_HEADERS,
    }
)
_DROP_RESPONSE = frozenset(
    {"content-length", "connection", "keep-alive", "transfer-encoding", "upgrade", "trailer"}
    | {"server", "date"}
)
_MAX_PREFILL_ANSWER = 64 * 2**20
_PROPAGATOR = TraceContextTextMapPropagator()


def host_url(host_port: str, path: str) -> str:
    """The URL of `path` on the engine at canonical `host:port`."""
    return f"http://{host_port}{path}"


def _forwarded(headers: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    out = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _DROP_REQUEST)
    out["X-Request-Id"] = request_id
    out["Content-Type"] = "application/json"
    current = trace.get_current_span().get_span_context().is_valid
    _PROPAGATOR.inject(out, context=None if current else _PROPAGATOR.extract(headers))
    return out


def _dumps(body: Mapping[str, Any]) -> bytes:
    return orjson.dumps(body)


class PlainProxy:
    """Plain P->D and local serving over one aiohttp session (`start()` / `close()`)."""

    def __init__(
        self, decode_endpoint: str, engines: EngineSettings, metrics: SidecarMetrics, tracer: trace.Tracer
    ) -> None:
        self._decode = decode_endpoint.rstrip("/")
        self._engines = engines
        self._metrics = metrics
        self._tracer = tracer
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._engines.max_connections, ttl_dns_cache=60)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("PlainProxy.start() was not called")
        return self._session

    @contextmanager
    def _served(self, request: web.Request, mode: Literal["llmd", "local"]) -> Iterator[None]:
        """The request's SERVER span, unless a planned turn's span is current (its fallback)."""
        if trace.get_current_span().get_span_context().is_valid:
            yield
            return
        with self._tracer.start_as_current_span(
            "request",
            context=_PROPAGATOR.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes={"kvshuttle.sidecar.mode": mode},
        ):
            yield

    async def local(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        """The request to this pod's decode, as it came (less any kv_transfer_params)."""
        body = _json_object(raw)
        if body is not None and "kv_transfer_params" in body:
            del body["kv_transfer_params"]
            raw = _dumps(body)
        with self._served(request, "local"):
            return await self._decode_answer(request, raw, uuid.uuid4().hex, traced=True)

    async def other(self, request: web.Request) -> web.StreamResponse:
        """Any other request (GET /v1/models, /metrics, /tokenize, ...): to this pod's decode, as
        llm-d's sidecar passes them."""
        return await self._decode_answer(request, await request.read(), uuid.uuid4().hex)

    async def disaggregated(
        self, request: web.Request, raw: bytes, prefill_host_port: str
    ) -> web.StreamResponse:
        """llm-d's P->D: prefill on `prefill_host_port` (already allowed), then local decode."""
        with self._served(request, "llmd"):
            return await self._disaggregated(request, raw, prefill_host_port)

    async def _disaggregated(
        self, request: web.Request, raw: bytes, prefill_host_port: str
    ) -> web.StreamResponse:
        body = _json_object(raw)
        if body is None:  # decode says what is wrong with it
            return await self._decode_answer(request, raw, uuid.uuid4().hex, traced=True)
        body.pop("kv_transfer_params", None)
        request_id = uuid.uuid4().hex
        prefill_body = {**body, "kv_transfer_params": PREFILL_PARAMS, "stream": False, "max_tokens": 1}
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        params, refusal = await self._prefill(request, prefill_host_port, prefill_body, request_id)
        if refusal is not None:
            return refusal
        if params is not None:
            body["kv_transfer_params"] = params
        return await self._decode_answer(request, _dumps(body), request_id, traced=True)

    async def _prefill(
        self, request: web.Request, target: str, body: dict[str, Any], request_id: str
    ) -> tuple[dict[str, Any] | None, web.Response | None]:
        """Prefill's kv_transfer_params for decode (None: decode computes the prompt), or the
        client's answer when prefill refused the request."""
        with self._tracer.start_as_current_span(
            "prefill", kind=SpanKind.CLIENT, attributes={"server.address": target}
        ):
            return await self._prefill_call(request, target, body, request_id)

    async def _prefill_call(
        self, request: web.Request, target: str, body: dict[str, Any], request_id: str
    ) -> tuple[dict[str, Any] | None, web.Response | None]:
        timeout = aiohttp.ClientTimeout(
            total=self._engines.prefill_timeout_s, connect=self._engines.connect_timeout_s
        )
        try:
            async with self.session.post(
                host_url(target, request.path),
                data=_dumps(body),
                headers=_forwarded(request.headers, request_id),
                timeout=timeout,
            ) as answer:
                raw = await answer.content.read(_MAX_PREFILL_ANSWER)
                if 400 <= answer.status < 500:
                    headers = {"Content-Type": answer.headers.get("Content-Type", "application/json")}
                    return None, web.Response(status=answer.status, body=raw, headers=headers)
                if answer.status != 200:
                    self._prefill_failed(target, f"status {answer.status}")
                    return None, None
        except TimeoutError:
            self._prefill_failed(target, "timeout")
            return None, None
        except aiohttp.ClientError as exc:
            self._prefill_failed(target, type(exc).__name__)
            return None, None
        parsed = _json_object(raw)
        params = None if parsed is None else parsed.get("kv_transfer_params")
        if not isinstance(params, dict):
            # As the turn runner: no params rather than made-up ones (decode would hold its blocks).
            log.warning("sidecar.prefill_no_kv_transfer_params", prefill=target)
            return None, None
        return params, None

    def _prefill_failed(self, target: str, why: str) -> None:
        self._metrics.prefill_failures.inc()
        log.warning("sidecar.prefill_failed", prefill=target, why=why)

    async def _decode_answer(
        self, request: web.Request, body: bytes, request_id: str, *, traced: bool = False
    ) -> web.StreamResponse:
        """`body` to the local decode with the request's method, path and query; its answer,
        streamed back (`traced`: under a CLIENT span `decode`, to the stream's end)."""
        if not traced:
            return await self._decode_call(request, body, request_id)
        with self._tracer.start_as_current_span(
            "decode", kind=SpanKind.CLIENT, attributes={"server.address": self._decode}
        ):
            return await self._decode_call(request, body, request_id)

    async def _decode_call(self, request: web.Request, body: bytes, request_id: str) -> web.StreamResponse:
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self._engines.connect_timeout_s,
            sock_read=self._engines.decode_idle_timeout_s,
        )
        try:
            upstream = await self.session.request(
                request.method,
                self._decode + request.path_qs,
                data=body,
                headers=_forwarded(request.headers, request_id),
                timeout=timeout,
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("sidecar.decode_failed", why=type(exc).__name__)
            err = GatewayError(
                502, "the decode engine did not answer", type_="server_error", code="engine_error"
            )
            return web.Response(status=502, body=_dumps(err.body()), content_type="application/json")
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for key, value in upstream.headers.items():
            if key.lower() not in _DROP_RESPONSE:
                response.headers.add(key, value)
        finished = False
        try:
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            finished = True
            await response.write_eof()
        except (TimeoutError, aiohttp.ClientError, ConnectionResetError) as exc:
            # The status line is gone: the client sees the stream end early, as from vLLM itself.
            log.warning("sidecar.decode_broke", why=type(exc).__name__)
        finally:
            if finished:
                upstream.release()
            else:
                upstream.close()  # vLLM aborts the request
        return response


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None
