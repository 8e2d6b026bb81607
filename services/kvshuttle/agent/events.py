"""The engine's KV-event stream over ZMQ: a SUB socket on its publisher, a DEALER on its
replay endpoint. Wire format and decoding: kvshuttle.vllm.kv_events.

The receiver never slows the engine: vLLM's PUB socket drops messages for a subscriber that
falls behind (it never blocks), and the receiver hands batches to a bounded queue without
waiting, dropping (and counting) a batch when the queue is full. Whatever went missing either
way is a gap in the sequence, which the forwarder fills from the replay endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
import zmq
import zmq.asyncio

from kvshuttle.agent.model import EventStreamStats, LiveBatch
from kvshuttle.core.kv_events import EventBatch
from kvshuttle.vllm.kv_events import KvEventDecoder, ReplayEnd, replay_request

__all__ = ["EventReceiver", "ZmqReplayer"]

log = structlog.get_logger("kvshuttle.agent")

_YIELD_EVERY = 32


class EventReceiver:
    """Subscribes to `endpoint` (e.g. "tcp://127.0.0.1:5557"; the engine binds, the agent
    connects) for `topic` and feeds `queue`.

    An engine restart shows as a seq at or below the last one received: that batch goes out
    flagged `restart` (and if the queue drops it, the flag rides on the next batch that fits).
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        topic: str,
        queue: asyncio.Queue[LiveBatch | None],
        stats: EventStreamStats,
        decoder: KvEventDecoder,
        *,
        receive_hwm: int = 10_000,
    ) -> None:
        self._context = context
        self._endpoint = endpoint
        self._topic = topic.encode()
        self._queue = queue
        self._stats = stats
        self._decoder = decoder
        self._hwm = receive_hwm
        self.connected = asyncio.Event()  # the socket is connecting (ZMQ connects in the background)

    async def run(self) -> None:
        """Receive until cancelled."""
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, self._hwm)
        socket.setsockopt(zmq.SUBSCRIBE, self._topic)
        socket.connect(self._endpoint)
        self.connected.set()
        log.info("events.subscribed", endpoint=self._endpoint, topic=self._topic.decode(errors="replace"))
        received = 0
        try:
            while True:
                frames = await socket.recv_multipart()
                self.receive(frames)
                received += 1
                if received % _YIELD_EVERY == 0:
                    # A ready socket answers without suspending: let the forwarder and the
                    # heartbeats run during a burst.
                    await asyncio.sleep(0)
        finally:
            socket.close(linger=0)

    def receive(self, frames: list[bytes]) -> None:
        """One live message: decode, track the sequence, enqueue or drop. Never raises."""
        if self._topic and frames and frames[0] != self._topic:
            self._stats.foreign_topic += 1  # the SUB filter matches prefixes only
            return
        batch = self._decoder.decode_message(frames)
        if batch is None:
            return
        stats = self._stats
        stats.batches_received += 1
        if stats.last_seq is not None and batch.seq <= stats.last_seq:
            stats.engine_restarts += 1
            stats.restart_pending = True
            log.warning("events.engine_restarted", seq=batch.seq, last_seq=stats.last_seq)
        stats.last_seq = batch.seq
        try:
            self._queue.put_nowait(LiveBatch(batch, restart=stats.restart_pending))
        except asyncio.QueueFull:
            stats.batches_dropped += 1
            return
        stats.restart_pending = False


class ZmqReplayer:
    """ReplayPort over the engine's replay ROUTER socket: one DEALER per fetch (a late answer
    to an abandoned fetch can never be mistaken for the next one's), `timeout` seconds for the
    whole fetch, at most `max_batches` batches."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        decoder: KvEventDecoder,
        *,
        timeout: float,
        max_batches: int,
    ) -> None:
        self._context = context
        self._endpoint = endpoint
        self._decoder = decoder
        self._timeout = timeout
        self._max = max_batches
        self.fetches = 0
        self.failed_fetches = 0

    async def fetch(self, start: int, end: int) -> list[EventBatch]:
        if end <= start:
            return []
        self.fetches += 1
        end = min(end, start + self._max)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        found: list[EventBatch] = []
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(self._endpoint)
            await socket.send_multipart(replay_request(start))
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await socket.poll(max(1, int(remaining * 1000))):
                    self.failed_fetches += 1
                    log.warning(
                        "events.replay_timeout", endpoint=self._endpoint, start=start, end=end, got=len(found)
                    )
                    break
                item = self._decoder.decode_replay_message(await socket.recv_multipart())
                if isinstance(item, ReplayEnd):
                    break
                if item is None or item.seq < start or (found and item.seq <= found[-1].seq):
                    continue
                if item.seq >= end:
                    break  # the rest of the engine's buffer is not wanted
                found.append(item)
                if item.seq == end - 1:
                    break
        except zmq.ZMQError as exc:
            self.failed_fetches += 1
            log.warning("events.replay_failed", endpoint=self._endpoint, error=str(exc))
        finally:
            with contextlib.suppress(zmq.ZMQError):
                socket.close(linger=0)
        return found
