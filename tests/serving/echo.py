"""A tiny service for the serving tests, registered through generic handlers so it needs no proto."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio
import structlog
from google.rpc import error_details_pb2

from kvshuttle.core.errors import InvalidArgument, NotFound
from kvshuttle.serving.logging import configure_logging
from kvshuttle.serving.settings import TelemetrySettings

SERVICE = "kvshuttle.testing.v1.EchoService"
DOMAIN = "testing.kvshuttle"
# A generated message with a request_id field.
Request = error_details_pb2.RequestInfo

_Context = grpc.aio.ServicerContext[Any, Any]


class EchoServicer:
    """One method per behaviour under test."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def Echo(self, request: Any, context: _Context) -> Any:
        structlog.contextvars.bind_contextvars(echoed=request.serving_data)
        return Request(request_id=request.request_id, serving_data=request.serving_data)

    async def Missing(self, request: Any, context: _Context) -> Any:
        raise NotFound("no thing named x", reason="THING_NOT_FOUND", metadata={"name": "x"})

    async def Invalid(self, request: Any, context: _Context) -> Any:
        raise InvalidArgument("a.b", "too long")

    async def Boom(self, request: Any, context: _Context) -> Any:
        raise RuntimeError("secret: /var/lib/kvshuttle/db password=hunter2")

    async def Refuse(self, request: Any, context: _Context) -> Any:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")

    async def Slow(self, request: Any, context: _Context) -> Any:
        """Runs until the test sets `release`."""
        self.entered.set()
        await asyncio.wait_for(self.release.wait(), timeout=30)
        return Request(serving_data="finally")

    async def Count(self, request: Any, context: _Context) -> AsyncIterator[Any]:
        """Streams serving_data responses; request_id "fail" fails after the first."""
        for i in range(int(request.serving_data)):
            if i == 1 and request.request_id == "fail":
                raise NotFound("gone mid-stream", reason="STREAM_GONE")
            yield Request(serving_data=str(i))

    async def Flood(self, request: Any, context: _Context) -> AsyncIterator[Any]:
        """Streams 64 KiB messages until flow control stops it, and then until cancelled."""
        while True:
            yield Request(serving_data="x" * 65536)


def register(servicer: EchoServicer) -> Callable[[grpc.aio.Server], None]:
    """The `register` callback GrpcServer takes."""

    def add(server: grpc.aio.Server) -> None:
        unary = {
            name: grpc.unary_unary_rpc_method_handler(
                getattr(servicer, name),
                request_deserializer=Request.FromString,
                response_serializer=Request.SerializeToString,
            )
            for name in ("Echo", "Missing", "Invalid", "Boom", "Refuse", "Slow")
        }
        streams = {
            name: grpc.unary_stream_rpc_method_handler(
                getattr(servicer, name),
                request_deserializer=Request.FromString,
                response_serializer=Request.SerializeToString,
            )
            for name in ("Count", "Flood")
        }
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {**unary, **streams})])

    return add


def unary(channel: grpc.aio.Channel, method: str) -> grpc.aio.UnaryUnaryMultiCallable[Any, Any]:
    return channel.unary_unary(
        f"/{SERVICE}/{method}",
        request_serializer=Request.SerializeToString,
        response_deserializer=Request.FromString,
    )


class JsonLog:
    """Routes logging (configure_logging, JSON format) into a buffer and reads it back as events."""

    def __init__(self) -> None:
        self._buffer = io.StringIO()
        configure_logging(TelemetrySettings(log_format="json"), stream=self._buffer)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self._buffer.getvalue().splitlines()]

    def done(self, method: str) -> list[dict[str, Any]]:
        """The rpc.done lines of `method`."""
        return [e for e in self.events() if e["event"] == "rpc.done" and e["method"] == method]

    async def done_once(self, method: str) -> dict[str, Any]:
        """The one canonical line of `method`, waiting for it when the server finishes after the client."""
        for _ in range(200):
            if lines := self.done(method):
                assert len(lines) == 1, lines
                return lines[0]
            await asyncio.sleep(0.01)
        raise AssertionError(f"no rpc.done for {method}")

    def close(self) -> None:
        """Leave logging as other tests expect it: structlog defaults, no handler of ours on root."""
        structlog.reset_defaults()
        root = logging.getLogger()
        for handler in [h for h in root.handlers if h.get_name() == "kvshuttle"]:
            root.removeHandler(handler)
