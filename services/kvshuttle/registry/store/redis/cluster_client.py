"""The Redis Cluster client the registry uses: redis-py's, made to find the cluster again after a
failover.

redis-py forgets a node as a place to map the cluster from whenever a call to it fails with a
connection error or a timeout (it pops it from `startup_nodes`), and then closes every connection
of the client. The calls in flight on the healthy masters then fail with connection errors too,
and each pops its own node: one dead master under concurrent calls can empty `startup_nodes`.
Nothing fills it again but a mapping that succeeds, and with it empty none can: every call
after that fails with "Redis Cluster cannot be connected ... None", however long ago the cluster
healed (seen in a failover under load: writes never resumed). This client puts the configured
seed and every node it has seen back among the nodes it maps from, each time it maps again.
"""

from __future__ import annotations

from typing import Any, Self

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode

__all__ = ["MAX_REMEMBERED_NODES", "ReseedingRedisCluster"]

# Nodes remembered to map from: a cluster's masters and replicas (Redis Cluster's own guidance
# stops at 1,000 nodes).
MAX_REMEMBERED_NODES = 1_000


class ReseedingRedisCluster(aioredis.RedisCluster):
    """redis-py's RedisCluster whose every (re)initialisation may map the cluster from any node
    it was configured with or has seen, not only from those no call has failed on yet."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # host:port of the configured seeds, then of every node a mapping found (oldest first).
        self._known: dict[str, tuple[str, int | str]] = {
            node.name: (node.host, node.port) for node in self.nodes_manager.startup_nodes.values()
        }

    async def initialize(self) -> Self:
        if self._initialize:
            self._reseed()
        await super().initialize()
        self._remember()
        return self

    def _reseed(self) -> None:  # a node not answering is skipped by the mapping, as before
        startup = self.nodes_manager.startup_nodes
        for name, (host, port) in self._known.items():
            if name not in startup:
                startup[name] = ClusterNode(host, port, **self.nodes_manager.connection_kwargs)

    def _remember(self) -> None:
        for node in self.nodes_manager.nodes_cache.values():
            if node.name not in self._known and len(self._known) < MAX_REMEMBERED_NODES:
                self._known[node.name] = (node.host, node.port)

    @property
    def known_nodes(self) -> list[str]:
        """host:port of the nodes it may map the cluster from."""
        return list(self._known)
