"""Builders of the registry's domain objects (node specs, retentions, pool moves) and the store
factory the registry tests run over each store."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

from kvshuttle.core.clock import Clock
from kvshuttle.core.errors import NotFound
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.core.nodes import (
    POOL_CAPACITY_LABEL,
    POOL_OF_LABEL,
    NodeRole,
    NodeSpec,
    pool_node_name,
)
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.model import Holder, Move, Retention
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import RegistryStore

CONV = "tenants/acme/conversations/c1"


BLOCK = 16


def spec(name: str = "nodes/d0", engine_id: str = "engine-d0", role: NodeRole = NodeRole.DECODE) -> NodeSpec:
    return NodeSpec(
        name=name,
        role=role,
        engine_id=engine_id,
        http_endpoint="http://127.0.0.1:8001",
        side_channel_host="127.0.0.1",
        side_channel_port=5601,
        agent_endpoint="",
        model="m",
        block_size=BLOCK,
        kv_bytes_per_token=1024,
    )


def retention(
    generation: int = 1,
    node: str = "nodes/d0",
    tokens: int = 100,
    pin: float | None = None,
    holder: Holder | None = None,
) -> Retention:
    ids = list(range(tokens))
    return Retention(
        name="",
        node=node,
        generation=generation,
        model="m",
        block_size=BLOCK,
        num_tokens=tokens,
        block_hashes=array("Q", chain_hashes(ids, BLOCK)),
        kv_transfer_params=b"\x10\x01",
        kv_bytes=tokens * 1024,
        pin_expire_at=pin,
        # What the servicer reads from the params: the node's engine and side channel (spec()).
        holder=holder or Holder(f"engine-{node.removeprefix('nodes/')}", "127.0.0.1", 5601),
    )


async def put(
    registry: Registry,
    generation: int = 1,
    *,
    conv: str = CONV,
    ttl: float | None = 60,
    request_id: str = "",
    **kw: object,
) -> Retention:
    result = await registry.put_retention(
        request_id=request_id,
        parent=conv,
        retention=retention(generation, **kw),  # type: ignore[arg-type]
        ttl=ttl,
    )
    return result.retention


StoreFactory = Callable[..., RegistryStore]


NAME = f"{CONV}/retentions/1"


POOL = "nodes/d0-pool"


POOL_HOLDER = Holder("pool-d0", "127.0.0.1", 5700)


POOLED = b"\x08\x01\x12\x07pool-d0"  # opaque to the registry; distinct from decode's params


def pool_spec(owner: str = "nodes/d0", **kw: Any) -> NodeSpec:
    fields: dict[str, Any] = {
        "name": pool_node_name(owner),
        "role": NodeRole.POOL,
        "engine_id": f"pool-{owner.removeprefix('nodes/')}",
        "http_endpoint": "http://127.0.0.1:8001",
        "side_channel_host": "127.0.0.1",
        "side_channel_port": 5700,
        "agent_endpoint": "127.0.0.1:50061",
        "model": "m",
        "block_size": BLOCK,
        "kv_bytes_per_token": 1024,
        "labels": {POOL_OF_LABEL: owner, POOL_CAPACITY_LABEL: str(2**30)},
    }
    fields.update(kw)
    return NodeSpec(**fields)


def move(claim_id: str = "", **kw: Any) -> Move:
    fields: dict[str, Any] = {
        "name": NAME,
        "claim_id": claim_id,
        "node": POOL,
        "kv_transfer_params": POOLED,
        "kv_bytes": 99 * 1024,
        "holder": POOL_HOLDER,
    }
    fields.update(kw)
    return Move(**fields)


async def claimed(registry: Registry, generation: int = 1, **kw: Any) -> Retention:
    """The conversation's retention `generation`, put and claimed by a reader (a park)."""
    await put(registry, generation, **kw)
    return await registry.claim_retention(
        request_id="", name=f"{CONV}/retentions/{generation}", holder="router/park", claim_ttl=10
    )


async def state(registry: Registry) -> tuple[Any, ...]:
    """Everything a move or an eviction may change."""
    nodes = [
        (n.name, n.retained_bytes, n.retention_count)
        for n in (await registry.list_nodes(role=None, model="", page_size=0, page_token=""))[0]
    ]
    retentions, _ = await registry.list_retentions(parent="tenants/acme", node="", page_size=0, page_token="")
    try:
        fence = (await registry.get_conversation(CONV)).fence_generation
    except NotFound:
        fence = 0
    return nodes, [repr(r) for r in retentions], fence, registry.counts_by_kind()


async def with_pool_node(store: RegistryStore, clock: Clock) -> Registry:
    """A registry over `store` on `clock` with a decode node (spec()) and its pool node
    (pool_spec()), both leased for 60 s."""
    registry = Registry(store, clock, BlockIndex(max_blocks_per_node=1000), RegistryLimits())
    await registry.register_node(spec(), ttl=60)
    await registry.register_node(pool_spec(), ttl=60)
    return registry
