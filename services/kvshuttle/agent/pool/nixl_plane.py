"""NIXL's data plane (kvshuttle.agent.pool.data_plane), the one that ships: the engine's and the
holders' handshakes over vLLM's side channel (kvshuttle.agent.pool.side_channel), host memory
registered with a NIXL agent of its own (kvshuttle.agent.pool.nixl_memory), READs into it
(kvshuttle.agent.pool.park) and the pool served on a side channel of its own
(kvshuttle.agent.pool.serve)."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from kvshuttle.agent.config import PoolSettings
from kvshuttle.agent.pool.blocks import BlockPool
from kvshuttle.agent.pool.data_plane import HolderFetch, OpenedPool
from kvshuttle.agent.pool.nixl_memory import NixlPoolMemory
from kvshuttle.agent.pool.park import Parker
from kvshuttle.agent.pool.serve import PoolServer
from kvshuttle.agent.pool.side_channel import Handshake, fetch_handshake, verify_engine
from kvshuttle.vllm.nixl_compat import Expected

__all__ = ["NixlDataPlane"]


class NixlDataPlane:
    fetch_holder: HolderFetch = staticmethod(fetch_handshake)

    async def verify_engine(
        self,
        context: zmq.asyncio.Context,
        host: str,
        port: int,
        expected: Expected,
        *,
        reply_timeout: float,
    ) -> Handshake:
        return await verify_engine(context, host, port, expected, reply_timeout=reply_timeout)

    async def open(
        self,
        pool: BlockPool,
        engine: Handshake,
        settings: PoolSettings,
        context: zmq.asyncio.Context,
        *,
        name: str,
    ) -> OpenedPool:
        memory = NixlPoolMemory(pool.layout, agent_name=name)
        parker = Parker(pool, memory, timeout=settings.park_timeout, max_remotes=settings.max_remote_agents)
        server = None
        if settings.serve_port is not None:
            server = PoolServer(
                pool,
                memory,
                engine,
                context,
                host=settings.serve_host,
                port=settings.serve_port,
                lease=settings.serve_lease,
                grace=settings.serve_grace,
            )
            try:
                await server.start()
            except BaseException:
                await asyncio.to_thread(memory.close)
                raise

        async def close() -> None:
            if server is not None:
                await server.close()
            await asyncio.to_thread(memory.close)  # waits for a READ in flight

        return OpenedPool(reader=parker, server=server, close=close, memory=memory)
