"""kvshuttle's typed async clients.

    from kvshuttle.client import RegistryClient

    async with RegistryClient.connect("127.0.0.1:50051") as registry:
        async for node in registry.iter_nodes():
            print(node.name)

Each client method returns the RPC's generated response message; every failure is a
KvshuttleRpcError with the status code and the server's ErrorInfo (reason, domain, metadata).
Unary calls are retried on UNAVAILABLE only when repeating them is safe (see
kvshuttle.client.retry.RETRY_POLICY), within one deadline per call.
"""

from kvshuttle.client.agent import AgentClient
from kvshuttle.client.channel import ChannelOptions, create_channel
from kvshuttle.client.errors import KvshuttleRpcError
from kvshuttle.client.registry import RegistryClient
from kvshuttle.client.router import RouterClient

__all__ = [
    "AgentClient",
    "ChannelOptions",
    "KvshuttleRpcError",
    "RegistryClient",
    "RouterClient",
    "create_channel",
]
