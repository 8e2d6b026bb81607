"""HTTP calls to the vLLM engines (the turn runner's EnginePort): one aiohttp session (a
keep-alive pool) for all of them.

Every call goes to the engine's `/v1/completions` with a token-id prompt. Failures become
GatewayError (see kvshuttle.gateway.errors): an engine's 400 stays a client error, anything
else that goes wrong with an engine is a 502 (504 on a timeout).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson

from kvshuttle.gateway.config import EngineSettings
from kvshuttle.gateway.errors import GatewayError, engine_error, engine_message, engine_timeout

__all__ = ["EngineClient", "completions_url"]

# Largest error body read from an engine, and largest single SSE event accepted.
_MAX_ERROR_BODY = 64 * 1024
_MAX_EVENT = 64 * 2**20


def completions_url(endpoint: str) -> str:
    """The completions URL of an engine's base URL ("http://host:8000" or ".../v1")."""
    base = endpoint.rstrip("/")
    return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


class EngineClient:
    """POSTs to engines. `start()` opens the session (on the serving loop), `close()` ends it."""

    def __init__(self, settings: EngineSettings) -> None:
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._settings.max_connections, ttl_dns_cache=60)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            headers={"Content-Type": "application/json", "Accept-Encoding": "identity"},
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EngineClient.start() was not called")
        return self._session

    async def _failure(self, role: str, response: aiohttp.ClientResponse) -> GatewayError:
        try:
            raw = await response.content.read(_MAX_ERROR_BODY)
            body = json.loads(raw) if raw else None
        except (TimeoutError, ValueError, aiohttp.ClientError):
            body = None
        return engine_error(role, response.status, engine_message(body))

    async def complete(
        self, role: str, endpoint: str, body: bytes, headers: Mapping[str, str], *, timeout_s: float
    ) -> dict[str, Any]:
        """One non-streaming completion; its JSON body."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=self._settings.connect_timeout_s)
        try:
            async with self.session.post(
                completions_url(endpoint), data=body, headers=headers, timeout=timeout
            ) as response:
                if response.status != 200:
                    raise await self._failure(role, response)
                raw = await response.read()
        except TimeoutError:
            raise engine_timeout(role) from None
        except aiohttp.ClientError as exc:
            raise engine_error(role, None, type(exc).__name__) from None
        try:
            # orjson: decode's answer echoes the prompt's ids (return_token_ids), ~2.5x faster.
            parsed = orjson.loads(raw)
        except ValueError:
            raise engine_error(role, None, "the answer is not JSON") from None
        if not isinstance(parsed, dict):
            raise engine_error(role, None, "the answer is not a JSON object")
        return parsed

    @asynccontextmanager
    async def stream(
        self, role: str, endpoint: str, body: bytes, headers: Mapping[str, str]
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """A streaming completion: yields its chunks' JSON, in order, until `data: [DONE]`.

        Leaving the block before the end closes the connection, which makes vLLM abort the
        request (a client disconnect does exactly that)."""
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self._settings.connect_timeout_s,
            sock_read=self._settings.decode_idle_timeout_s,
        )
        try:
            response = await self.session.post(
                completions_url(endpoint), data=body, headers=headers, timeout=timeout
            )
        except TimeoutError:
            raise engine_timeout(role) from None
        except aiohttp.ClientError as exc:
            raise engine_error(role, None, type(exc).__name__) from None
        finished = False
        chunks = _chunks(role, response)
        try:
            if response.status != 200:
                raise await self._failure(role, response)
            yield chunks
            finished = True
        finally:
            await chunks.aclose()
            if finished:
                response.release()
            else:
                response.close()


async def _chunks(role: str, response: aiohttp.ClientResponse) -> AsyncGenerator[dict[str, Any], None]:
    try:
        async for data in _events(response):
            if data == b"[DONE]":
                return
            try:
                chunk = json.loads(data)
            except ValueError:
                raise engine_error(role, None, "a stream event is not JSON") from None
            if not isinstance(chunk, dict):
                raise engine_error(role, None, "a stream event is not a JSON object")
            if "error" in chunk or chunk.get("object") == "error":
                # vLLM reports a failure after the first byte as an error event.
                raise engine_error(role, 500, engine_message(chunk))
            yield chunk
    except TimeoutError:
        raise engine_timeout(role) from None
    except aiohttp.ClientError as exc:
        raise engine_error(role, None, f"the stream broke ({type(exc).__name__})") from None
    raise engine_error(role, None, "the stream ended without [DONE]")


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The data of each server-sent event (lines joined), as bytes."""
    buffer = bytearray()
    async for data in response.content.iter_any():
        buffer += data.replace(b"\r\n", b"\n") if b"\r" in data else data
        start = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            lines = bytes(buffer[start:end]).split(b"\n")
            start = end + 2
            payload = b"\n".join(line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:"))
            if payload:
                yield payload
        if start:
            del buffer[:start]
        if len(buffer) > _MAX_EVENT:
            raise aiohttp.ClientPayloadError("a stream event is too large")
