"""envoy.service.ext_proc.v3.ExternalProcessor: one Process stream per HTTP request, in the
message pattern of the Inference Extension's reference picker (pkg/lwepp/handlers), with bodies
FULL_DUPLEX_STREAMED both ways.

Request path: `request_headers` are held (no answer) until the body has ended; each
`request_body` chunk is buffered (at most `max_request_bytes`: else 413); at the chunk with
end_of_stream (or at `request_trailers`, which end a body whose last chunk did not say so) the
picker picks, and the stream gets, in this order, the headers' answer (destination header and
metadata, the sidecar's headers, clear_route_cache), the body streamed back unchanged, and the
trailers' answer when there were trailers. A request without a body (`request_headers` with
end_of_stream) is picked for at once. A refusal is one ImmediateResponse and the end of the
stream.

Response path: `response_headers` are read for the status and the endpoint that served
(`x-gateway-destination-endpoint-served`, compared with the pick: kvshuttle_epp_served_total)
and answered unchanged; `response_body` chunks are streamed back unchanged as they come
(FULL_DUPLEX_STREAMED; under another response body mode, acknowledged without a mutation); and
`response_trailers` answered. A `protocol_config` whose request body mode is not
FULL_DUPLEX_STREAMED is refused (500, details naming it): the pick needs the body, and in the
other modes Envoy would wait for the headers' answer first.

Messages out of order (a body before headers, headers twice, a message naming no phase) are the
caller's error: INVALID_ARGUMENT naming the field. The request's one line is the interceptor's
`rpc.done` (method=Process), with what this module and the picker bound: http_method, path,
model, conversation (digest), prompt_tokens, outcome, decision, reason, picked, prefill,
status, served, served_match, upstream_status, pick_ms, plan_ms, body_bytes, subset.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.epp.metrics import EppMetrics
from kvshuttle.epp.picker import SIDECAR_HEADERS, Pick, Picker, PickRequest
from kvshuttle.epp.protocol import (
    FULL_DUPLEX_STREAMED,
    Subset,
    body_responses,
    header_values,
    headers_response,
    immediate_response,
    served_endpoint,
    subset_hint,
)
from kvshuttle.gateway.errors import GatewayError
from kvshuttle.gateway.pd_headers import PREFILLER_HOST_PORT_HEADER

if TYPE_CHECKING:
    import grpc.aio

__all__ = ["SERVICE_NAME", "ExternalProcessor"]

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"

log = structlog.get_logger("kvshuttle.epp")

Responses = list[ext.ProcessingResponse]


@dataclass(slots=True)
class _Exchange:
    """One HTTP request's stream: what arrived so far and what was answered."""

    started: float = field(default_factory=time.perf_counter)
    headers: dict[str, str] | None = None
    subset: Subset | None = None
    body: bytearray = field(default_factory=bytearray)
    has_body: bool = False
    picked: Pick | None = None
    # Echo response bodies as streamed mutations (FULL_DUPLEX_STREAMED), else acknowledge them.
    echo_responses: bool = True
    outcome: str = "cancelled"
    status: int = 0
    responded: bool = False


class ExternalProcessor:
    """The ext_proc service (registered with ext_grpc.add_ExternalProcessorServicer_to_server)."""

    def __init__(self, picker: Picker, metrics: EppMetrics, *, max_request_bytes: int) -> None:
        self._picker = picker
        self._metrics = metrics
        self._max_request_bytes = max_request_bytes

    async def Process(
        self,
        request_iterator: AsyncIterator[ext.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[ext.ProcessingResponse]:
        ex = _Exchange()
        try:
            async for message in request_iterator:
                responses, final = await self._on(ex, message)
                for response in responses:
                    yield response
                if final:
                    return
        finally:
            self._metrics.requests.labels(ex.outcome, str(ex.status)).inc()
            if not ex.responded and ex.picked is not None:
                self._metrics.served.labels("unreported").inc()
            structlog.contextvars.bind_contextvars(outcome=ex.outcome, status=ex.status)

    async def _on(self, ex: _Exchange, message: ext.ProcessingRequest) -> tuple[Responses, bool]:
        """The answers to one message, and whether the stream is over: only after an
        ImmediateResponse; otherwise Envoy ends it, once the response has passed."""
        if message.HasField("protocol_config"):
            refused = _mode_refusal(ex, message.protocol_config)
            if refused is not None:
                return [refused], True
        phase = message.WhichOneof("request")
        if phase == "request_headers":
            if ex.headers is not None:
                raise InvalidArgument("request_headers", "request headers sent twice on one stream")
            return await self._request_headers(ex, message)
        if phase in ("request_body", "request_trailers") and ex.headers is None:
            raise InvalidArgument(phase, f"{phase} before the request headers")
        if phase == "request_body":
            return await self._request_body(ex, message.request_body)
        if phase == "request_trailers":
            answers: Responses = []
            if ex.has_body and ex.picked is None:  # the trailers end the body
                answers, final = await self._pick(ex, end_of_stream=False)
                if final:
                    return answers, True
            return [*answers, ext.ProcessingResponse(request_trailers=ext.TrailersResponse())], False
        if phase in ("response_headers", "response_body", "response_trailers") and ex.picked is None:
            raise InvalidArgument(phase, f"{phase} before the request was picked for")
        if phase == "response_headers":
            return [self._response_headers(ex, message)], False
        if phase == "response_body":
            chunk = message.response_body
            if ex.echo_responses:
                answers = list(body_responses(chunk.body, request=False, end_of_stream=chunk.end_of_stream))
            else:
                answers = [ext.ProcessingResponse(response_body=ext.BodyResponse())]
            return answers, False
        if phase == "response_trailers":
            return [ext.ProcessingResponse(response_trailers=ext.TrailersResponse())], False
        raise InvalidArgument("request", "a ProcessingRequest that carries no request phase")

    async def _request_headers(self, ex: _Exchange, message: ext.ProcessingRequest) -> tuple[Responses, bool]:
        ex.headers = header_values(message.request_headers)
        ex.subset = subset_hint(message)
        structlog.contextvars.bind_contextvars(
            http_method=ex.headers.get(":method", ""),
            path=ex.headers.get(":path", "").split("?", 1)[0][:200],
            subset=None if ex.subset is None else len(ex.subset),
        )
        if message.request_headers.end_of_stream:
            return await self._pick(ex, end_of_stream=True)
        ex.has_body = True
        return [], False  # deferred until the body has ended

    async def _request_body(self, ex: _Exchange, chunk: ext.HttpBody) -> tuple[Responses, bool]:
        if not ex.has_body or ex.picked is not None:
            raise InvalidArgument("request_body", "request body after the request's end of stream")
        if len(ex.body) + len(chunk.body) > self._max_request_bytes:
            err = GatewayError(
                413, f"the request body exceeds {self._max_request_bytes} bytes", code="request_too_large"
            )
            return [self._refuse(ex, err)], True
        ex.body += chunk.body
        if chunk.end_of_stream:
            return await self._pick(ex, end_of_stream=True)
        return [], False

    async def _pick(self, ex: _Exchange, *, end_of_stream: bool) -> tuple[Responses, bool]:
        assert ex.headers is not None
        body = bytes(ex.body) if ex.has_body else None
        started = time.perf_counter()
        request = PickRequest(
            method=ex.headers.get(":method", ""),
            path=ex.headers.get(":path", ""),
            headers=ex.headers,
            body=body,
            subset=ex.subset,
        )
        try:
            pick = await self._picker.pick(request)
        except GatewayError as err:
            return [self._refuse(ex, err)], True
        seconds = time.perf_counter() - started
        self._metrics.pick.observe(seconds)
        self._metrics.picks.labels(pick.decision, pick.reason).inc()
        ex.picked, ex.outcome, ex.status = pick, pick.outcome, 200
        structlog.contextvars.bind_contextvars(
            picked=pick.endpoint,
            prefill=pick.headers.get(PREFILLER_HOST_PORT_HEADER, ""),
            decision=pick.decision,
            reason=pick.reason,
            pick_ms=round(seconds * 1e3, 3),
            body_bytes=len(body) if body is not None else 0,
        )
        set_headers = dict(pick.headers)
        if body is not None and end_of_stream:
            # As the reference picker: the length of the body streamed back (Envoy may drop it).
            set_headers["content-length"] = str(len(body))
        remove = [h for h in SIDECAR_HEADERS if h not in set_headers]
        answers = [headers_response(pick.endpoint, set_headers, remove)]
        if body is not None:
            answers.extend(body_responses(body, request=True, end_of_stream=end_of_stream))
        ex.body = bytearray()
        return answers, False

    def _refuse(self, ex: _Exchange, err: GatewayError) -> ext.ProcessingResponse:
        ex.outcome, ex.status = "refused", err.status
        structlog.contextvars.bind_contextvars(error=err.code or err.type, param=err.param)
        return immediate_response(
            err.status, orjson.dumps(err.body()), f"kvshuttle_epp_{err.code or err.type}"
        )

    def _response_headers(self, ex: _Exchange, message: ext.ProcessingRequest) -> ext.ProcessingResponse:
        headers = header_values(message.response_headers)
        served = served_endpoint(message, headers)
        assert ex.picked is not None
        match = "unreported" if served is None else "picked" if served == ex.picked.endpoint else "other"
        ex.responded = True
        self._metrics.served.labels(match).inc()
        structlog.contextvars.bind_contextvars(
            served=served, served_match=match, upstream_status=headers.get(":status", "")
        )
        if match == "other":
            # Envoy sent the request elsewhere (a retry, a gateway ignoring the pick): that
            # pod's sidecar finds the plan names another decode node and serves it plain.
            log.warning("pick.served_elsewhere", picked=ex.picked.endpoint, served=served)
        return ext.ProcessingResponse(response_headers=ext.HeadersResponse())


def _mode_refusal(ex: _Exchange, config: ext.ProtocolConfiguration) -> ext.ProcessingResponse | None:
    """Read the body modes Envoy is configured with; a refusal when the request's is unusable."""
    ex.echo_responses = config.response_body_mode == FULL_DUPLEX_STREAMED
    if config.request_body_mode == FULL_DUPLEX_STREAMED:
        return None
    log.error(
        "epp.misconfigured",
        detail="the ext_proc filter's processing_mode.request_body_mode must be FULL_DUPLEX_STREAMED",
        request_body_mode=config.request_body_mode,
    )
    ex.outcome, ex.status = "refused", 500
    err = GatewayError(
        500,
        "the gateway's ext_proc filter must send request bodies FULL_DUPLEX_STREAMED to the endpoint picker",
        type_="server_error",
        code="ext_proc_misconfigured",
    )
    return immediate_response(500, orjson.dumps(err.body()), "kvshuttle_epp_request_body_mode")
