"""Registry benchmark: put / claim / renew throughput and latency, in-process (domain only)
and over gRPC with N concurrent clients, plus memory per retention at 100k retentions.

    python -m bench.registry_bench [--ops 20000] [--clients 1,8,32] [--retentions 100000]

Prints a table and writes bench/results/registry_bench-<utc time>.json. Figures from one
run are comparable with each other; this machine is noisy, so compare ratios, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import socket
import statistics
import sys
import time
import tracemalloc
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from bench.report import save
from kvshuttle.core.clock import SystemClock
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.core.nodes import NodeRole, NodeSpec
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.model import Holder, Retention
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams

BLOCK_SIZE = 32
TOKENS = 2048  # 64 blocks per retention
NODE = "nodes/decode-0"


def params(block_ids: list[int]) -> KvTransferParams:
    return KvTransferParams(
        do_remote_decode=True,
        remote_block_ids=[BlockIdList(block_ids=block_ids)],
        remote_engine_id="decode-0-4f7c2a",
        remote_request_id="cmpl-5d1e8b2f9a6c4e3b-0",
        remote_host="10.0.0.7",
        remote_port=5601,
        tp_size=1,
        dcp_size=1,
        pp_size=1,
        remote_num_tokens=TOKENS,
        remote_blocks_expiry_time=12345.678,
        transfer_mode="pull",
    )


def node_spec() -> NodeSpec:
    return NodeSpec(
        name=NODE,
        role=NodeRole.DECODE,
        engine_id="decode-0-4f7c2a",
        http_endpoint="http://10.0.0.7:8000",
        side_channel_host="10.0.0.7",
        side_channel_port=5601,
        agent_endpoint="",
        model="m",
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=131072,
    )


HOLDER = Holder.of(node_spec())


def summarize(name: str, samples_ns: list[int], wall_s: float) -> dict[str, Any]:
    ordered = sorted(samples_ns)
    return {
        "op": name,
        "count": len(ordered),
        "ops_per_s": round(len(ordered) / wall_s),
        "p50_us": round(ordered[len(ordered) // 2] / 1e3, 1),
        "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e3, 1),
        "mean_us": round(statistics.fmean(ordered) / 1e3, 1),
    }


async def timed(n: int, op: Callable[[int], Awaitable[object]]) -> tuple[list[int], float]:
    samples: list[int] = []
    start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter_ns()
        await op(i)
        samples.append(time.perf_counter_ns() - t0)
    return samples, time.perf_counter() - start


def new_registry(n: int) -> Registry:
    limits = StoreLimits(max_retentions=n + 10, max_retentions_per_tenant=n + 10)
    return Registry(InMemoryStore(limits), SystemClock(), BlockIndex(1000), RegistryLimits())


def retention(hashes: array[int], blob: bytes) -> Retention:
    """A retention of TOKENS tokens on NODE, as a commit puts it."""
    return Retention(
        name="",
        node=NODE,
        generation=1,
        model="m",
        block_size=BLOCK_SIZE,
        num_tokens=TOKENS,
        block_hashes=hashes,
        kv_transfer_params=blob,
        kv_bytes=TOKENS * 131072,
        pin_expire_at=None,
        holder=HOLDER,  # what the servicer reads from the params: NODE's engine and side channel
    )


async def bench_domain(n: int) -> list[dict[str, Any]]:
    registry = new_registry(n)
    await registry.register_node(node_spec(), ttl=300)
    hashes = array("Q", chain_hashes(list(range(TOKENS)), BLOCK_SIZE))
    blob = params(list(range(TOKENS // BLOCK_SIZE))).SerializeToString()

    rows = []
    put_s, put_w = await timed(
        n,
        lambda i: registry.put_retention(
            request_id="", parent=f"tenants/t/conversations/c{i}", retention=retention(hashes, blob), ttl=300
        ),
    )
    rows.append(summarize("put", put_s, put_w))
    renew_s, renew_w = await timed(
        n, lambda i: registry.renew_retention(f"tenants/t/conversations/c{i}/retentions/1", 300)
    )
    rows.append(summarize("renew", renew_s, renew_w))
    claim_s, claim_w = await timed(
        n,
        lambda i: registry.claim_retention(
            request_id="", name=f"tenants/t/conversations/c{i}/retentions/1", holder="bench", claim_ttl=30
        ),
    )
    rows.append(summarize("claim", claim_s, claim_w))
    for row in rows:
        row["layer"] = "domain"
        row["clients"] = 1
    return rows


async def memory_per_retention(n: int) -> dict[str, Any]:
    """tracemalloc growth of the registry for n retentions, each with its own 64-hash chain and
    64 block ids (as real retentions have), with the block ids' own bytes reported apart."""
    registry = new_registry(n)
    await registry.register_node(node_spec(), ttl=300)
    rng = random.Random(1)
    blocks = TOKENS // BLOCK_SIZE
    inputs = [
        ([rng.randrange(0, 100_000) for _ in range(blocks)], [rng.getrandbits(64) for _ in range(blocks)])
        for _ in range(n)
    ]
    empty = len(params([]).SerializeToString())
    block_id_bytes = 0
    hash_bytes = n * (blocks * 8)
    gc.collect()
    # The hash array and the serialized params are built inside the measurement: the registry
    # keeps exactly those objects. The input lists are freed before the final reading.
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, (ids, chain) in enumerate(inputs):
        hashes = array("Q", chain)
        blob = params(ids).SerializeToString()
        block_id_bytes += len(blob) - empty
        await registry.put_retention(
            request_id="",
            parent=f"tenants/t/conversations/conv-{i:08d}",
            retention=retention(hashes, blob),
            ttl=300,
        )
    del inputs  # the registry keeps what it needs; the inputs' own copies are not its cost
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per = grown / n
    ids_per = block_id_bytes / n
    hashes_per = hash_bytes / n
    return {
        "retentions": n,
        "blocks_per_retention": blocks,
        "bytes_per_retention": round(per),
        "block_id_bytes_per_retention": round(ids_per),
        "hash_bytes_per_retention": round(hashes_per),
        "bytes_per_retention_excluding_block_ids_and_hashes": round(per - ids_per - hashes_per),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def bench_grpc(addr: str, n: int, clients: int, tag: str) -> list[dict[str, Any]]:
    channels = [grpc.aio.insecure_channel(addr) for _ in range(min(clients, 4))]
    stubs: list[pb_grpc.RegistryServiceAsyncStub] = [pb_grpc.RegistryServiceStub(ch) for ch in channels]
    hashes = chain_hashes(list(range(TOKENS)), BLOCK_SIZE)
    kvp = params(list(range(TOKENS // BLOCK_SIZE)))
    ttl = Duration(seconds=300)
    claim_ttl = Duration(seconds=30)

    async def run(
        op: str, make: Callable[[pb_grpc.RegistryServiceAsyncStub, int], Awaitable[object]]
    ) -> dict[str, Any]:
        per_client = n // clients
        samples: list[int] = []

        async def worker(w: int) -> None:
            stub = stubs[w % len(stubs)]
            for k in range(per_client):
                t0 = time.perf_counter_ns()
                await make(stub, w * per_client + k)
                samples.append(time.perf_counter_ns() - t0)

        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(clients)))
        row = summarize(op, samples, time.perf_counter() - start)
        row.update(layer="grpc", clients=clients)
        return row

    def conv(i: int) -> str:
        return f"tenants/t/conversations/{tag}-{i}"

    rows = [
        await run(
            "put",
            lambda s, i: s.PutRetention(
                pb.PutRetentionRequest(
                    parent=conv(i),
                    ttl=ttl,
                    retention=pb.Retention(
                        node=NODE,
                        generation=1,
                        model="m",
                        block_size=BLOCK_SIZE,
                        num_tokens=TOKENS,
                        block_hashes=hashes,
                        kv_transfer_params=kvp,
                        kv_bytes=TOKENS * 131072,
                    ),
                )
            ),
        ),
        await run(
            "renew",
            lambda s, i: s.RenewRetention(pb.RenewRetentionRequest(name=f"{conv(i)}/retentions/1", ttl=ttl)),
        ),
        await run(
            "claim",
            lambda s, i: s.ClaimRetention(
                pb.ClaimRetentionRequest(name=f"{conv(i)}/retentions/1", holder="bench", claim_ttl=claim_ttl)
            ),
        ),
    ]
    for ch in channels:
        await ch.close()
    return rows


async def grpc_suite(n: int, client_counts: list[int]) -> list[dict[str, Any]]:
    port = free_port()
    env = dict(
        os.environ,
        KVSHUTTLE_REGISTRY_SERVER__LISTEN=f"127.0.0.1:{port}",
        KVSHUTTLE_REGISTRY_TELEMETRY__LOG_LEVEL="warning",
        KVSHUTTLE_REGISTRY_STORE_LIMITS__MAX_RETENTIONS=str(n * len(client_counts) + 10),
        KVSHUTTLE_REGISTRY_STORE_LIMITS__MAX_RETENTIONS_PER_TENANT=str(n * len(client_counts) + 10),
    )
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvshuttle.registry.main", env=env, stdout=asyncio.subprocess.DEVNULL
    )
    addr = f"127.0.0.1:{port}"
    try:
        async with grpc.aio.insecure_channel(addr) as ch:
            await asyncio.wait_for(ch.channel_ready(), 30)
            await pb_grpc.RegistryServiceStub(ch).RegisterNode(
                pb.RegisterNodeRequest(
                    ttl=Duration(seconds=300),
                    node=pb.Node(
                        name=NODE,
                        role=pb.NODE_ROLE_DECODE,
                        engine_id="decode-0-4f7c2a",
                        http_endpoint="http://10.0.0.7:8000",
                        side_channel_host="10.0.0.7",
                        side_channel_port=5601,
                        model="m",
                        block_size=BLOCK_SIZE,
                        kv_bytes_per_token=131072,
                    ),
                )
            )
        rows: list[dict[str, Any]] = []
        for clients in client_counts:
            rows += await bench_grpc(addr, n, clients, f"n{clients}")
        return rows
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), 30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=20_000, help="operations per domain measurement")
    ap.add_argument("--grpc-ops", type=int, default=4_000, help="operations per gRPC measurement")
    ap.add_argument("--clients", default="1,8,32", help="concurrent gRPC clients, comma-separated")
    ap.add_argument("--retentions", type=int, default=100_000, help="retentions for the memory figure")
    args = ap.parse_args()

    rows = asyncio.run(bench_domain(args.ops))
    rows += asyncio.run(grpc_suite(args.grpc_ops, [int(c) for c in args.clients.split(",")]))
    memory = asyncio.run(memory_per_retention(args.retentions))

    print(f"{'layer':<7} {'clients':>7} {'op':<6} {'ops/s':>9} {'p50 us':>9} {'p99 us':>9}")
    for r in rows:
        print(
            f"{r['layer']:<7} {r['clients']:>7} {r['op']:<6} {r['ops_per_s']:>9} "
            f"{r['p50_us']:>9} {r['p99_us']:>9}"
        )
    print(
        f"memory: {memory['bytes_per_retention']} B per retention at {memory['retentions']} retentions "
        f"({memory['blocks_per_retention']} blocks each); without its block ids "
        f"({memory['block_id_bytes_per_retention']} B) and hash chain "
        f"({memory['hash_bytes_per_retention']} B): "
        f"{memory['bytes_per_retention_excluding_block_ids_and_hashes']} B"
    )

    figures = {
        "rows": rows,
        "memory": memory,
        "targets": {"domain_ops_per_s": 20_000, "bytes_per_retention_excluding_block_ids": 1024},
    }
    out = save("registry_bench", figures, args=args)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
