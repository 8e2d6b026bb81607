"""A stand-in vLLM engine for real NIXL READs in this process: its KV cache in NIXL memory
(a NixlPoolMemory advertised as vLLM's CPU build advertises its cache), polled by a thread of
its own as vLLM's worker is, recording the notifications readers send it."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from typing import Any

import numpy as np
from tests.agent.engine_fakes import engine_metadata

from kvshuttle.agent.pool.blocks import PoolLayout
from kvshuttle.agent.pool.nixl_memory import NixlPoolMemory
from kvshuttle.agent.pool.side_channel import Handshake
from kvshuttle.vllm.nixl_layout import RemoteLayout
from kvshuttle.vllm.nixl_wire import ClockOffset, NixlHandshakePayload, encode_agent_metadata

ENGINE = PoolLayout(regions=2, blocks=8, block_bytes=16 * 1024)
HASH = "ab" * 32


class Engine:
    """The engine's KV cache in NIXL memory, with its worker's notification loop."""

    def __init__(self) -> None:
        self.memory = NixlPoolMemory(ENGINE, agent_name=f"engine-{uuid.uuid4().hex[:8]}")
        rng = np.random.default_rng(11)
        for region in range(ENGINE.regions):
            for block in range(ENGINE.blocks):
                self.memory.block(region, block)[:] = rng.integers(0, 256, ENGINE.block_bytes, dtype=np.uint8)
        self.notifications: list[tuple[str, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            for peer, messages in self.memory.progress().items():
                self.notifications.extend((str(peer), m) for m in messages)
            time.sleep(0.0001)

    def handshake(self, **changes: Any) -> Handshake:
        meta = engine_metadata(ENGINE, agent_metadata=self.memory.metadata(), base=self.memory.base_address)
        meta = dataclasses.replace(meta, **changes)
        return Handshake(
            payload=NixlHandshakePayload(HASH, encode_agent_metadata(meta)),
            metadata=meta,
            layout=RemoteLayout.of(meta),
            clock=ClockOffset(offset=0.0, rtt=0.0),
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.memory.close()
