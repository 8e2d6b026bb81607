"""Registry memory under a request-id load: the resident set (RSS) of a real `kvshuttle-registry`
process before a 20k-operation load, right after it, and after its leases lapse.

The load is what retried commits and plans look like to the registry: put, claim and release
cycles over fresh conversations, every put and claim carrying a request id, each retention near
the request bounds (4096 block hashes, 8192 block ids in its params: ~57 KiB on the wire). The
retentions are released at once, so what stays is what the registry remembers of the requests:
their request ids (idempotency) and the conversations' fences. Both are held for a TTL that this
run shortens (--ttl) so that their lapse is seen within it. After the lapse the load runs once
more: what the lapse freed is reused (CPython keeps freed memory in its arenas, so RSS shows
reuse as no growth rather than as a drop).

    python -m bench.registry_memory [--ops 20000] [--clients 8] [--rounds 1] [--ttl 60]
                                    [--baseline-tree DIR]

--baseline-tree runs the same load against the registry of another source tree too (for
example `git archive HEAD | tar -x -C /tmp/before`), to compare. Prints a table and writes
bench/results/registry_memory-<utc time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from bench.report import save
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams

BLOCK = 16
NODE = pb.Node(
    name="nodes/decode-0",
    role=pb.NODE_ROLE_DECODE,
    engine_id="decode-0-4f7c2a",
    http_endpoint="http://10.0.0.7:8000",
    side_channel_host="10.0.0.7",
    side_channel_port=5601,
    model="m",
    block_size=BLOCK,
    kv_bytes_per_token=131072,
)
MIB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss(pid: int) -> dict[str, float]:
    """The process's resident set now and at its peak, MiB (Linux /proc)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = round(int(value.split()[0]) / 1024, 1)
    return {"rss_mib": fields["VmRSS"], "peak_mib": fields["VmHWM"]}


def large_retention(hashes: int, block_ids: int, generation: int) -> pb.Retention:
    return pb.Retention(
        node=NODE.name,
        generation=generation,
        model=NODE.model,
        block_size=BLOCK,
        num_tokens=hashes * BLOCK,
        block_hashes=range(1_000_000, 1_000_000 + hashes),
        kv_transfer_params=KvTransferParams(
            do_remote_decode=True,
            remote_block_ids=[BlockIdList(block_ids=range(100_000, 100_000 + block_ids))],
            remote_engine_id=NODE.engine_id,
            remote_request_id=f"cmpl-{uuid.uuid4().hex}-0",
            remote_host=NODE.side_channel_host,
            remote_port=NODE.side_channel_port,
            tp_size=1,
            remote_num_tokens=hashes * BLOCK,
            transfer_mode="pull",
        ),
        kv_bytes=hashes * BLOCK * NODE.kv_bytes_per_token,
    )


async def load(
    stub: pb_grpc.RegistryServiceAsyncStub, *, ops: int, clients: int, hashes: int, block_ids: int, tag: str
) -> dict[str, Any]:
    """`ops` operations (put, claim, release, round robin) over fresh conversations."""
    cycles = ops // 3
    done = 0
    # One retention message, reused: its bytes are the same for every put (request ids differ).
    template = large_retention(hashes, block_ids, 1)
    wire_bytes = template.ByteSize()

    async def worker(w: int) -> None:
        nonlocal done
        for i in range(w, cycles, clients):
            parent = f"tenants/t{i % 4}/conversations/{tag}-{i:06d}"
            put = await stub.PutRetention(
                pb.PutRetentionRequest(
                    request_id=uuid.uuid4().hex, parent=parent, retention=template, ttl=Duration(seconds=300)
                )
            )
            claimed = await stub.ClaimRetention(
                pb.ClaimRetentionRequest(
                    request_id=uuid.uuid4().hex,
                    name=put.retention.name,
                    holder=f"router:{uuid.uuid4().hex}",
                    claim_ttl=Duration(seconds=30),
                )
            )
            await stub.ReleaseRetention(
                pb.ReleaseRetentionRequest(name=put.retention.name, claim_id=claimed.retention.claim.claim_id)
            )
            done += 3

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(clients)))
    wall = time.perf_counter() - start
    return {"load": tag, "ops": done, "ops_per_s": round(done / wall), "retention_wire_bytes": wire_bytes}


async def run_one(args: argparse.Namespace, tree: Path | None) -> dict[str, Any]:
    port = free_port()
    env = dict(
        os.environ,
        KVSHUTTLE_REGISTRY_SERVER__LISTEN=f"127.0.0.1:{port}",
        KVSHUTTLE_REGISTRY_TELEMETRY__LOG_LEVEL="warning",
        KVSHUTTLE_REGISTRY_STORE_LIMITS__IDEMPOTENCY_TTL=str(args.ttl),
        KVSHUTTLE_REGISTRY_STORE_LIMITS__FENCE_TTL=str(args.ttl),
    )
    if tree is not None:
        # That tree's packages first on the path: they shadow this checkout's (editable) ones.
        env["PYTHONPATH"] = os.pathsep.join(
            [str(tree / "services"), str(tree / "clients"), env.get("PYTHONPATH", "")]
        )
    server = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvshuttle.registry.main",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    addr = f"127.0.0.1:{port}"
    options = [("grpc.max_send_message_length", 8 * MIB), ("grpc.max_receive_message_length", 8 * MIB)]
    try:
        async with grpc.aio.insecure_channel(addr, options=options) as channel:
            await asyncio.wait_for(channel.channel_ready(), 60)
            stub: pb_grpc.RegistryServiceAsyncStub = pb_grpc.RegistryServiceStub(channel)
            await stub.RegisterNode(pb.RegisterNodeRequest(node=NODE, ttl=Duration(seconds=300)))
            await asyncio.sleep(0.5)
            samples: list[dict[str, Any]] = [{"at": "before the load", **rss(server.pid)}]
            rounds = []
            for r in range(args.rounds):
                rounds.append(
                    await load(
                        stub,
                        ops=args.ops,
                        clients=args.clients,
                        hashes=args.hashes,
                        block_ids=args.block_ids,
                        tag=f"r{r}",
                    )
                )
                samples.append({"at": f"after load {r + 1} ({args.ops} ops)", **rss(server.pid)})
            # Every lease lapses: the retentions were released; request ids and fences outlive
            # them by --ttl. One small put afterwards: a store that forgets request ids only when
            # it writes one gets its chance too.
            await asyncio.sleep(args.ttl + 3)
            small = large_retention(1, 1, 1)
            put = await stub.PutRetention(
                pb.PutRetentionRequest(
                    request_id=uuid.uuid4().hex, parent="tenants/t0/conversations/last", retention=small
                )
            )
            await stub.ReleaseRetention(pb.ReleaseRetentionRequest(name=put.retention.name, force=True))
            await asyncio.sleep(1.5)
            samples.append({"at": f"after the leases lapse ({args.ttl + 4.5:g} s later)", **rss(server.pid)})
            # The same load once more: memory freed by the lapse is reused, not added to.
            rounds.append(
                await load(
                    stub,
                    ops=args.ops,
                    clients=args.clients,
                    hashes=args.hashes,
                    block_ids=args.block_ids,
                    tag="again",
                )
            )
            samples.append({"at": f"after one more load ({args.ops} ops)", **rss(server.pid)})
            return {"tree": str(tree) if tree else "this checkout", "rounds": rounds, "samples": samples}
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), 30)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=20_000, help="operations per load round (put/claim/release)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent callers")
    ap.add_argument("--rounds", type=int, default=1, help="load rounds before the leases lapse")
    ap.add_argument("--hashes", type=int, default=4096, help="block hashes per retention")
    ap.add_argument("--block-ids", type=int, default=8192, help="block ids in each retention's params")
    ap.add_argument("--ttl", type=float, default=60.0, help="idempotency and fence TTL of the run, seconds")
    ap.add_argument("--baseline-tree", type=Path, help="also run the registry of this source tree")
    args = ap.parse_args()

    results = [asyncio.run(run_one(args, None))]
    if args.baseline_tree is not None:
        results.append(asyncio.run(run_one(args, args.baseline_tree.resolve())))

    for result in results:
        print(f"registry of {result['tree']}:")
        for r in result["rounds"]:
            print(
                f"  load {r['load']}: {r['ops']} ops at {r['ops_per_s']} ops/s, "
                f"retentions of {r['retention_wire_bytes'] / 1024:.0f} KiB"
            )
        for s in result["samples"]:
            print(f"  {s['at']:<40} RSS {s['rss_mib']:>8.1f} MiB   peak {s['peak_mib']:>8.1f} MiB")

    out = save("registry_memory", {"results": results}, args=args)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
