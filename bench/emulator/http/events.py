"""The stand-in engine's KV events (bench/emulator/http/engine.py), in vLLM's frame shapes
(kvshuttle.vllm.kv_events decodes them): a ZMQ PUB of `[topic, seq, msgpack [ts, [events], 0]]`,
one batch per request that changed the cache, and the replay ROUTER that answers a
`[identity, b"", seq]` request with every buffered batch from `seq` on, then an end frame."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any, Final

import msgpack
import zmq
import zmq.asyncio

TOPIC: Final = b"kv-events"
_END_SEQ: Final = b"\xff" * 8
_REPLAY_BUFFER: Final = 10_000  # vLLM's default buffer_steps


class EventPublisher:
    def __init__(self) -> None:
        self._seq = 0
        self._replay: deque[tuple[int, bytes]] = deque(maxlen=_REPLAY_BUFFER)
        self._zmq = zmq.asyncio.Context()
        self._pub = self._zmq.socket(zmq.PUB)
        self._router = self._zmq.socket(zmq.ROUTER)
        self._task: asyncio.Task[None] | None = None

    def bind(self, host: str, events_port: int, replay_port: int) -> tuple[str, str]:
        """Bind both sockets (port 0: any free one) and serve replays; their endpoints."""
        endpoints = []
        for socket, port in ((self._pub, events_port), (self._router, replay_port)):
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(f"tcp://{host}:{port or '*'}")
            endpoints.append(str(socket.getsockopt_string(zmq.LAST_ENDPOINT)))
        self._task = asyncio.create_task(self._serve_replay())
        return endpoints[0], endpoints[1]

    def publish(self, events: list[dict[str, Any]]) -> None:
        """`events` as one batch (none: nothing sent)."""
        if not events:
            return
        payload = bytes(msgpack.packb([time.time(), events, 0]))
        seq, self._seq = self._seq, self._seq + 1
        self._replay.append((seq, payload))
        self._pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    async def close(self) -> None:
        if self._zmq.closed:
            return
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(0)
        self._router.close(0)
        self._zmq.term()

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
