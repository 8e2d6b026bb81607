"""The floor under every kvshuttle RPC (issue 21): the CPU a bare grpc.aio unary call costs its
client and its server process on this machine, with no kvshuttle code on either side (an echo of
300 bytes, a generic handler, no interceptor, no auth, no logging, no spans).

    python -m bench.grpc_floor [--rates 100,1000] [--calls 2000]

Per rate: the client's and the server's CPU per call (utime + stime from /proc, the server a
process of its own), calls open loop at the rate. A turn of the load bench makes ~5 of these
(gateway -> router twice, router -> registry ~2, an agent's event report ~0.5), each paid on
both sides. Writes bench/results/grpc_floor-<utc time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

import grpc
import grpc.aio

from bench.load import cpu_seconds
from bench.report import save

_METHOD = "/bench.Echo/Echo"


async def serve() -> None:
    async def echo(request: bytes, _: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)  # to the measuring process
    await server.wait_for_termination()


async def measure(port: int, server_pid: int, rate: float, calls: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(_METHOD)
        payload = b"x" * 300
        for _ in range(100):  # warm-up: the connection, the first calls
            await call(payload)
        client0, server0, started = cpu_seconds(os.getpid()), cpu_seconds(server_pid), time.monotonic()
        tasks = []
        next_at = started
        for _ in range(calls):
            tasks.append(asyncio.ensure_future(call(payload)))
            next_at += 1 / rate
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        await asyncio.gather(*tasks)
        wall = time.monotonic() - started
        client, server = cpu_seconds(os.getpid()) - client0, cpu_seconds(server_pid) - server0
    return {
        "offered_calls_s": rate,
        "achieved_calls_s": round(calls / wall, 1),
        "client_cpu_us_per_call": round(client / calls * 1e6),
        "server_cpu_us_per_call": round(server / calls * 1e6),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="100,1000")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve())
        return
    started = datetime.now(UTC)
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_floor", "--serve"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        steps = [
            asyncio.run(measure(port, server.pid, float(rate), args.calls)) for rate in args.rates.split(",")
        ]
    finally:
        server.terminate()
        server.wait()
    for s in steps:
        print(
            f"{s['offered_calls_s']:6.0f}/s -> {s['achieved_calls_s']:6.1f}/s  client "
            f"{s['client_cpu_us_per_call']} us, server {s['server_cpu_us_per_call']} us of CPU per call"
        )
    print(f"wrote {save('grpc_floor', {'steps': steps}, args=args, utc=started)}")


if __name__ == "__main__":
    main()
