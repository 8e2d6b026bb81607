"""Stand-ins for the engine beside an agent, all real sockets on 127.0.0.1: its HTTP server
(/health, /metrics), its KV-event publisher and replay endpoint (ZMQ), its NIXL side channel, and
the engine-id file its start script writes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

import zmq
import zmq.asyncio
from aiohttp import web
from tests.support.fixtures_vllm import FIXTURE_TOPIC

from kvshuttle.agent.pool.blocks import PoolLayout
from kvshuttle.core.kv_events import EventBatch
from kvshuttle.vllm.kv_events import END_OF_REPLAY, decode_seq, encode_message
from kvshuttle.vllm.nixl_wire import (
    NixlAgentMetadata,
    NixlHandshakePayload,
    encode_agent_metadata,
    encode_handshake_payload,
    encode_handshake_reply,
)

BLOCK_SIZE = 32  # the fixture's engine ran with --block-size 32

# What vLLM 0.32 (V1 engine) serves on /metrics, trimmed: the three load gauges among the
# counters, histograms and info gauges around them, as prometheus_client writes them.
VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 21466.0
python_gc_objects_collected_total{generation="1"} 3392.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.439035392e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 5.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="deferred"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.4583333333333333
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 1690.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 96.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny-llama"} 1690.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny-llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="tiny-llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="tiny-llama"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="tiny-llama"} 9.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="tiny-llama"} 14.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 15.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny-llama"} 15.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny-llama"} 0.27019715309143066
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="24"} 1.0
"""


# -- the engine -----------------------------------------------------------------------------------


class FakeEngineHttp:
    """vLLM's /health and /metrics on a real HTTP server."""

    def __init__(self) -> None:
        self.health_status = 200
        self.metrics = VLLM_METRICS
        self.hits: dict[str, int] = {"/health": 0, "/metrics": 0}
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _health(self, request: web.Request) -> web.Response:
        self.hits["/health"] += 1
        return web.Response(status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits["/metrics"] += 1
        return web.Response(text=self.metrics, content_type="text/plain", charset="utf-8")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class FakePublisher:
    """An engine's KV-event sockets: an XPUB where vLLM has a PUB (same wire protocol; XPUB
    also tells when the agent's subscription arrived, so no message is lost to ZMQ's slow
    joiner), and a ROUTER replay endpoint answering from `buffer` as vLLM's does."""

    def __init__(self, context: zmq.asyncio.Context, topic: bytes = FIXTURE_TOPIC) -> None:
        self.topic = topic
        self.pub = context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[list[bytes]] = []  # what the engine published: [topic, seq, payload]
        self.replay_requests: list[int] = []
        self._replay_task = asyncio.create_task(self._serve_replay())

    async def wait_subscribed(self) -> None:
        message = await asyncio.wait_for(self.pub.recv(), 5.0)
        assert message == b"\x01" + self.topic

    async def publish(self, frames: Sequence[bytes], *, deliver: bool = True) -> None:
        """Publish a message (into the replay buffer always; to subscribers when `deliver`)."""
        self.buffer.append(list(frames))
        if deliver:
            await self.pub.send_multipart(list(frames))

    async def publish_batch(self, batch: EventBatch, *, deliver: bool = True) -> None:
        await self.publish(encode_message(self.topic, batch), deliver=deliver)

    async def _serve_replay(self) -> None:
        while True:
            identity, _empty, start_frame = await self.router.recv_multipart()
            start = decode_seq(start_frame)
            assert start is not None
            self.replay_requests.append(start)
            for frames in list(self.buffer):
                seq = decode_seq(frames[1])
                assert seq is not None
                if seq >= start:
                    await self.router.send_multipart([identity, b"", *frames])
            await self.router.send_multipart([identity, *END_OF_REPLAY])

    async def close(self) -> None:
        self._replay_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._replay_task
        self.pub.close(linger=0)
        self.router.close(linger=0)


# -- the engine's NIXL side channel ---------------------------------------------------------------


def engine_metadata(
    layout: PoolLayout, *, engine_id: str = "engine-a", agent_metadata: bytes = b"", base: int = 1 << 32
) -> NixlAgentMetadata:
    """What vLLM's CPU build advertises for a KV cache shaped like `layout` at `base` (one region
    per layer, blocks of `layout.block_bytes` back to back, LBHNC, DRAM)."""
    return NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=agent_metadata,
        kv_caches_base_addr=tuple(base + r * layout.region_bytes for r in range(layout.regions)),
        device_id=0,
        num_blocks=layout.blocks,
        block_lens=(layout.block_bytes,) * layout.regions,
        block_strides=(layout.block_bytes,) * layout.regions,
        kv_cache_layout="LBHNC",
        block_size=BLOCK_SIZE,
        ssm_sizes=(0, 0),
        attn_backend_name="CPU_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=(layout.blocks,) * layout.regions,
        region_group_ids=(0,) * layout.regions,
        region_names=tuple(f"model.layers.{r}.self_attn.attn" for r in range(layout.regions)),
        region_mem_types=("DRAM",) * layout.regions,
    )


class FakeSideChannel:
    """vLLM's handshake listener (a ZMQ ROUTER) answering with `metadata`, or silent while
    `metadata` is None."""

    def __init__(self, context: zmq.asyncio.Context, metadata: NixlAgentMetadata | None) -> None:
        self.metadata = metadata
        self.requests = 0
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, _, _request = await self.socket.recv_multipart()
            self.requests += 1
            if self.metadata is not None:
                payload = encode_handshake_payload(
                    NixlHandshakePayload("ab" * 32, encode_agent_metadata(self.metadata))
                )
                await self.socket.send_multipart(
                    [identity, b"", *encode_handshake_reply(payload, time.perf_counter())]
                )

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.socket.close(linger=0)


# -- the engine id file ---------------------------------------------------------------------------


def write_id(path: Path, engine_id: str) -> None:
    """As vllm-start.sh does: a temporary file renamed over the id file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(engine_id + "\n")
    tmp.replace(path)
