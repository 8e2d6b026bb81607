"""What the three service clients share: the channel's lifetime (made again when its certificate
files change), unary calls with the retry policy, server-streaming calls, and errors as
KvshuttleRpcError."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from types import TracebackType
from typing import Any, ClassVar, Self, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message
from opentelemetry import trace

from kvshuttle.client.channel import ChannelOptions, create_channel, tls_files_signature
from kvshuttle.client.errors import KvshuttleRpcError
from kvshuttle.client.retry import call_unary, retry_policy
from kvshuttle.client.tracing import record_status, traced_attempt

RespT = TypeVar("RespT", bound=Message)

log = logging.getLogger("kvshuttle.client")

# Calls begun on a channel replaced for new certificates get this long to finish before it closes.
_DRAIN_GRACE = 60.0


def new_request_id(request_id: str | None) -> str:
    """`request_id`, or a fresh uuid4 when None. Pass "" to send none (and so forgo retries)."""
    return str(uuid.uuid4()) if request_id is None else request_id


class ServiceClient:
    """Base of the typed clients: one gRPC service over one grpc.aio channel.

    Build one with `connect()` (it owns its channel and closes it), or over a channel you
    already have with `Client(channel, options)` (it leaves the channel open). Either way
    it is an async context manager, and `close()` closes what it owns.

    Every RPC method takes `timeout`: seconds for the call, retries included; None means
    `options.default_timeout`.

    A client that made its channel over TLS checks the certificate files every
    `options.tls_reload_interval` seconds (at a call, never between calls) and, when they
    changed, sends the calls that follow on a new channel made from them; the old one closes
    when its calls are done (`_DRAIN_GRACE` at most). Files that fail to load keep the old one.
    """

    SERVICE: ClassVar[str]
    """The gRPC service's full name, e.g. "kvshuttle.registry.v1.RegistryService"."""

    def __init__(
        self, channel: grpc.aio.Channel, options: ChannelOptions | None = None, *, owns_channel: bool = False
    ) -> None:
        self._channel = channel
        self._options = options or ChannelOptions("(caller's channel)")
        self._owns_channel = owns_channel
        self._callables: dict[str, Any] = {}
        reload = owns_channel and self._options.secure and self._options.tls_reload_interval is not None
        self._tls_files = tls_files_signature(self._options) if reload else None
        self._tls_checked_at = time.monotonic()
        self._draining: set[asyncio.Task[None]] = set()
        provider = self._options.tracer_provider
        self._tracer = (
            None if provider is None else trace.get_tracer("kvshuttle.client", tracer_provider=provider)
        )

    @classmethod
    def connect(cls, target: str | ChannelOptions, **overrides: Any) -> Self:
        """A client on a new channel to `target` ("host:port" or ChannelOptions).

        `overrides` replace ChannelOptions fields (e.g. `default_timeout=1.0`). The channel
        connects lazily: an unreachable server shows up as UNAVAILABLE on the first call.
        Use as `async with Client.connect("127.0.0.1:50051") as client: ...`, or keep it and
        `await client.close()`.
        """
        options = ChannelOptions.of(target, **overrides)
        return cls(create_channel(options), options, owns_channel=True)

    @property
    def options(self) -> ChannelOptions:
        return self._options

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._current_channel()

    def _current_channel(self) -> grpc.aio.Channel:
        """The channel for the next call: a new one when the certificate files changed."""
        interval = self._options.tls_reload_interval
        if self._tls_files is None or interval is None or time.monotonic() - self._tls_checked_at < interval:
            return self._channel
        self._tls_checked_at = time.monotonic()
        files = tls_files_signature(self._options)
        if files == self._tls_files:
            return self._channel
        try:
            channel = create_channel(self._options)
        except OSError as exc:  # mid-rotation or gone: keep the old channel, look again later
            log.warning("client.tls_reload_failed target=%s error=%s", self._options.target, exc)
            return self._channel
        old, self._channel, self._tls_files = self._channel, channel, files
        self._callables.clear()
        drain = asyncio.get_running_loop().create_task(old.close(_DRAIN_GRACE))
        self._draining.add(drain)
        drain.add_done_callback(self._draining.discard)
        log.info("client.tls_reloaded target=%s drain_grace_s=%s", self._options.target, _DRAIN_GRACE)
        return channel

    async def close(self, grace: float | None = None) -> None:
        """Close the channel if this client opened it (in-flight calls are cancelled after `grace`),
        and any it replaced that is still draining."""
        if self._owns_channel:
            for drain in list(self._draining):
                drain.cancel()
            await self._channel.close(grace)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _path(self, method: str) -> str:
        return f"/{self.SERVICE}/{method}"

    def _timeout(self, timeout: float | None) -> float | None:
        return self._options.default_timeout if timeout is None else timeout

    async def _unary(
        self, method: str, request: Message, response_type: type[RespT], timeout: float | None
    ) -> RespT:
        """Call unary `method` with the retry policy of the table in kvshuttle.client.retry."""
        path = self._path(method)
        channel = self._current_channel()
        multicallable = self._callables.get(path)
        if multicallable is None:
            multicallable = channel.unary_unary(
                path,
                request_serializer=type(request).SerializeToString,
                response_deserializer=response_type.FromString,
            )
            self._callables[path] = multicallable
        response: RespT = await call_unary(
            multicallable,
            request,
            method=path,
            policy=retry_policy(self.SERVICE, method),
            options=self._options,
            timeout=self._timeout(timeout),
            tracer=self._tracer,
        )
        return response

    async def _server_stream(
        self, method: str, request: Message, response_type: type[RespT], timeout: float | None
    ) -> AsyncGenerator[RespT, None]:
        """Yield the responses of server-streaming `method`; never retried.

        `timeout` bounds the whole stream (None: no deadline). Closing the generator cancels
        the call.
        """
        path = self._path(method)
        retry_policy(self.SERVICE, method)  # every RPC is classified, streams included
        multicallable = self._current_channel().unary_stream(
            path,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        with traced_attempt(self._tracer, path) as (span, metadata):
            call = multicallable(request, timeout=timeout, metadata=(*self._options.call_metadata, *metadata))
            try:
                async for response in call:
                    yield response
            except grpc.aio.AioRpcError as exc:
                record_status(span, exc.code(), exc.details())
                raise KvshuttleRpcError.from_rpc_error(exc, method=path) from exc
            finally:
                call.cancel()
            record_status(span, grpc.StatusCode.OK)
