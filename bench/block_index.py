"""Where the block index lives with several registry replicas over one Redis, decided by
measurement, in one run, on one redis-server (127.0.0.1, no persistence):

  memory   one process's BlockIndex (kvshuttle.registry.block_index), the single-process baseline;
  stream   each replica keeps that BlockIndex, fed from one Redis Stream of accepted reports
           (kvshuttle.registry.feeds.redis_index, the production code): ingestion through
           RedisIndexFeed.report on replica A (which waits until A's own index applied it) with
           replica B's reader applying the same stream in the same process; lookups read a
           replica's own index;
  redis    the index held in Redis: per node (hash tag = the node, Cluster-safe) a hash vLLM hash
           -> chain hash, a hash chain hash -> count and the node's seq; an ingest is one round
           trip to resolve parents (HMGET) and read the seq, the chain computed in Python (Redis
           Lua has no BLAKE2b), then one script that checks the seq and applies the stores and
           removals; a lookup is one script per node (walk the chain with HEXISTS), pipelined: one
           round trip on one server (one per shard in a Cluster). A prototype of this bench only
           (no capacity bound or media), which favours it.

Workload: `--nodes` nodes; conversations whose turns grow by 8..64 blocks up to 8k tokens, each
turn's prefill one BlockStored chained from the previous turn's last block; batches of 1..4 such
events (an engine step serving several requests, as in tests/fixtures/vllm-0.32.0-cpu-kv-events.json,
where a batch is one BlockStored with the removals it caused), and each node evicts its oldest
conversations (BlockRemoved, deepest first) beyond its share of `--blocks` indexed blocks.
Lookups: prompts of a random conversation's chain (1k..8k tokens) plus 4 blocks nobody holds, the
chain hashed beforehand (the router does that), over every node.

    python -m bench.block_index [--blocks 100000] [--nodes 2,16] [--block-size 16] [--lookups 2000]

Prints a table and writes bench/results/block_index-<utc time>.json. Client and redis-server
share this machine's cores: compare within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis

from bench.redis_store import cpu_seconds, redis_server
from bench.report import save
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.core.kv_events import BlockEvent, BlockRemoved, BlockStored, EventBatch
from kvshuttle.registry.block_index import BlockIndex, plan_batches
from kvshuttle.registry.feeds.redis_index import RedisIndexFeed

VOCAB = 32_000


@dataclass
class Conversation:
    node: int
    tokens: list[int]
    vllm: list[int]  # vLLM's hash of each block stored so far
    chain: list[int]  # kvshuttle's chain of the same blocks


def workload(
    nodes: int, total_blocks: int, block_size: int, rng: random.Random
) -> tuple[list[tuple[str, EventBatch]], list[Conversation]]:
    """(node, batch) in report order, and every conversation (for lookups)."""
    share = total_blocks // nodes
    convs: list[Conversation] = []
    held: list[list[Conversation]] = [[] for _ in range(nodes)]  # oldest first
    count = [0] * nodes
    seq = [0] * nodes
    out: list[tuple[str, EventBatch]] = []
    next_hash = 1
    max_blocks = 8192 // block_size
    produced = 0
    while produced < total_blocks * 2:  # twice the index: it fills, then evicts
        n = rng.randrange(nodes)
        events: list[BlockEvent] = []
        for _ in range(rng.randint(1, 4)):
            live = [c for c in held[n][-8:] if len(c.vllm) < max_blocks]
            if live and rng.random() < 0.7:
                conv = rng.choice(live)
            else:
                conv = Conversation(n, [], [], [])
                convs.append(conv)
                held[n].append(conv)
            k = min(rng.randint(8, 64), max_blocks - len(conv.vllm))
            tokens = [rng.randrange(VOCAB) for _ in range(k * block_size)]
            parent_chain = conv.chain[-1] if conv.chain else 0
            hashes = tuple(range(next_hash, next_hash + k))
            next_hash += k
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=conv.vllm[-1] if conv.vllm else None,
                    token_ids=tuple(tokens),
                    block_size=block_size,
                    lora_id=None,
                    medium="GPU",
                )
            )
            conv.tokens += tokens
            conv.vllm += hashes
            conv.chain += chain_hashes(tokens, block_size, parent_chain)
            count[n] += k
            produced += k
            while count[n] > share and len(held[n]) > 1:
                old = held[n].pop(0)
                events.append(BlockRemoved(block_hashes=tuple(reversed(old.vllm)), medium="GPU"))
                count[n] -= len(old.vllm)
                old.vllm, old.chain = [], []
        out.append((f"nodes/n{n}", EventBatch(seq=seq[n], engine_time=time.time(), events=tuple(events))))
        seq[n] += 1
    return out, [c for c in convs if c.chain]


def prompts(
    convs: Sequence[Conversation], block_size: int, count: int, rng: random.Random
) -> list[list[int]]:
    out: list[list[int]] = []
    for _ in range(count):
        conv = rng.choice(convs)
        cut = rng.randint(min(len(conv.chain), 1024 // block_size), len(conv.chain))
        out.append(conv.chain[:cut] + [rng.getrandbits(64) for _ in range(4)])
    return out


def pct(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def index_mib(index: BlockIndex) -> float:
    """The index's own objects (its dicts and the ints in them; small cached ints counted too),
    by sys.getsizeof: deterministic where RSS on a shared allocator is not."""
    seen: set[int] = set()

    def size(obj: object) -> int:
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return sys.getsizeof(obj)

    total = size(index._holders) + sum(size(k) + size(v) for k, v in index._holders.items())
    for node in index._nodes.values():
        total += size(node) + size(node.media) + size(node.multi)
        for table in node.media.values():
            total += size(table) + sum(size(k) + size(v) for k, v in table.items())
    return total / 2**20


def events_in(batches: Sequence[tuple[str, EventBatch]]) -> int:
    return sum(len(b.events) for _, b in batches)


def blocks_in(batches: Sequence[tuple[str, EventBatch]]) -> int:
    return sum(len(getattr(e, "block_hashes", ())) for _, b in batches for e in b.events)


# ---- the index held in Redis (a prototype, this bench only) ------------------------------------

# KEYS: map (vllm -> chain), counts (chain -> n), seq. ARGV: the seq planned against ('' none), the
# new seq, then ops: 'c' (clear) | 's' vllm chain | 'r' vllm.
_APPLY = """
local cur = redis.call('GET', KEYS[3]) or ''
if cur ~= ARGV[1] then return {'moved', cur} end
redis.call('SET', KEYS[3], ARGV[2])
local i = 3
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'c' then
    redis.call('DEL', KEYS[1], KEYS[2]); i = i + 1
  elseif op == 's' then
    local old = redis.call('HGET', KEYS[1], ARGV[i + 1])
    if old ~= ARGV[i + 2] then
      if old then
        if redis.call('HINCRBY', KEYS[2], old, -1) <= 0 then redis.call('HDEL', KEYS[2], old) end
      end
      redis.call('HSET', KEYS[1], ARGV[i + 1], ARGV[i + 2])
      redis.call('HINCRBY', KEYS[2], ARGV[i + 2], 1)
    end
    i = i + 3
  else
    local old = redis.call('HGET', KEYS[1], ARGV[i + 1])
    if old then
      redis.call('HDEL', KEYS[1], ARGV[i + 1])
      if redis.call('HINCRBY', KEYS[2], old, -1) <= 0 then redis.call('HDEL', KEYS[2], old) end
    end
    i = i + 2
  end
end
return {'ok', ''}
"""
# KEYS: counts. ARGV: the chain. The leading blocks held.
_DEPTH = """
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then return i - 1 end
end
return #ARGV
"""


class RedisHeldIndex:
    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client
        self._apply = client.register_script(_APPLY)
        self._depth_sha = ""

    @staticmethod
    def _keys(node: str) -> list[str]:
        return [f"bix:{{{node}}}:m", f"bix:{{{node}}}:c", f"bix:{{{node}}}:s"]

    async def report(self, node: str, batches: Sequence[EventBatch]) -> None:
        keys = self._keys(node)
        parents = sorted(
            {
                e.parent_block_hash
                for b in batches
                for e in b.events
                if isinstance(e, BlockStored) and e.parent_block_hash is not None
            }
        )
        pipe = self._redis.pipeline(transaction=False)
        pipe.get(keys[2])
        pipe.hmget(keys[0], parents or ["-"])
        cur, found = await pipe.execute()
        known = {p: int(v) for p, v in zip(parents, found, strict=False) if v is not None}
        state = (cur or b"").decode()
        plan = plan_batches(int(state) if state else None, [b.seq for b in batches])
        ops: list[Any] = []
        for i, clear in plan.apply:
            if clear:
                ops.append("c")
                known.clear()
            for e in batches[i].events:
                if isinstance(e, BlockStored):
                    parent = 0 if e.parent_block_hash is None else known.get(e.parent_block_hash)
                    if parent is None:
                        continue  # unkeyed
                    for vh, ch in zip(
                        e.block_hashes, chain_hashes(e.token_ids, e.block_size, parent), strict=True
                    ):
                        ops += ["s", vh, ch]
                        known[vh] = ch
                elif isinstance(e, BlockRemoved):
                    for vh in e.block_hashes:
                        ops += ["r", vh]
                else:
                    ops.append("c")
        new = "" if plan.next_seq is None else str(plan.next_seq)
        out = await cast("Awaitable[list[Any]]", self._apply(keys=keys, args=[state, new, *ops]))
        assert out[0] == b"ok", out

    async def lookup(self, chain: Sequence[int], nodes: Sequence[str]) -> list[tuple[str, int]]:
        if not self._depth_sha:
            self._depth_sha = str(await self._redis.script_load(_DEPTH))
        pipe = self._redis.pipeline(transaction=False)
        for node in nodes:
            pipe.evalsha(self._depth_sha, 1, self._keys(node)[1], *map(str, chain))
        depths = await pipe.execute()
        return sorted(
            ((n, int(d)) for n, d in zip(nodes, depths, strict=True) if d), key=lambda x: (-x[1], x[0])
        )


# ---- the measurements ---------------------------------------------------------------------------


def ingest_figures(
    batches: Sequence[tuple[str, EventBatch]], wall: float, extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "batches": len(batches),
        "events": events_in(batches),
        "blocks": blocks_in(batches),
        "wall_s": round(wall, 3),
        "batches_per_s": round(len(batches) / wall),
        "events_per_s": round(events_in(batches) / wall),
        "blocks_per_s": round(blocks_in(batches) / wall),
        **extra,
    }


def lookup_figures(samples: Sequence[float]) -> dict[str, float]:
    return {
        "p50_us": round(statistics.median(samples) * 1e6, 1),
        "p99_us": round(pct(samples, 0.99) * 1e6, 1),
        "mean_us": round(statistics.fmean(samples) * 1e6, 1),
    }


def bench_memory(
    batches: Sequence[tuple[str, EventBatch]], queries: Sequence[list[int]], names: list[str]
) -> tuple[dict[str, Any], BlockIndex]:
    index = BlockIndex(10_000_000)
    t0 = time.perf_counter()
    for node, batch in batches:
        index.apply(node, [batch])
    wall = time.perf_counter() - t0
    samples: list[float] = []
    for chain in queries:
        t = time.perf_counter()
        index.lookup(chain, names)
        samples.append(time.perf_counter() - t)
    stats = index.stats()
    return {
        "ingest": ingest_figures(batches, wall, {}),
        "lookup": lookup_figures(samples),
        "indexed_blocks": stats.total_blocks,
        "process_index_mib": round(index_mib(index), 1),
    }, index


async def used_memory(client: aioredis.Redis) -> int:
    info = await client.info("memory")
    return int(info["used_memory"])


async def bench_stream(
    port: int,
    pid: int,
    batches: Sequence[tuple[str, EventBatch]],
    queries: Sequence[list[int]],
    names: list[str],
) -> tuple[dict[str, Any], BlockIndex]:
    client = aioredis.Redis(host="127.0.0.1", port=port, decode_responses=False)
    await client.flushall()
    base = await used_memory(client)
    a, b = BlockIndex(10_000_000), BlockIndex(10_000_000)
    feed_a = RedisIndexFeed(client, a, maxlen=len(batches) + 1000, block_ms=200, read_your_writes=5.0)
    feed_b = RedisIndexFeed(client, b, maxlen=len(batches) + 1000, block_ms=200, read_your_writes=5.0)
    readers = [asyncio.create_task(feed_a.run()), asyncio.create_task(feed_b.run())]
    server0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    for node, batch in batches:
        await feed_a.report(node, 1, [batch])
    while b.stats().total_blocks != a.stats().total_blocks or feed_b._applied < feed_a._applied:  # noqa: ASYNC110
        await asyncio.sleep(0.001)  # B's reader, catching up
    wall = time.perf_counter() - t0
    server = cpu_seconds(pid) - server0
    samples: list[float] = []
    for chain in queries:
        t = time.perf_counter()
        b.lookup(chain, names)
        samples.append(time.perf_counter() - t)
    # What every lookup through the Registry adds on Redis, either way: its live-node listing.
    rt: list[float] = []
    for _ in range(200):
        t = time.perf_counter()
        await client.zrange("{kvshuttle}:nodes", 0, 999)
        rt.append(time.perf_counter() - t)
    stream_bytes = await used_memory(client) - base
    for task in readers:
        task.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    await client.aclose()
    assert a.stats() == b.stats()
    return {
        "ingest": ingest_figures(batches, wall, {"redis_cpu_s": round(server, 2)}),
        "lookup": lookup_figures(samples),
        "redis_round_trip": lookup_figures(rt),
        "indexed_blocks": b.stats().total_blocks,
        "process_index_mib_per_replica": round(index_mib(b), 1),
        "redis_used_memory_mib": round(stream_bytes / 2**20, 1),
        "redis_bytes_per_stream_entry": round(stream_bytes / len(batches)),
    }, b


async def bench_redis(
    port: int,
    pid: int,
    batches: Sequence[tuple[str, EventBatch]],
    queries: Sequence[list[int]],
    names: list[str],
) -> tuple[dict[str, Any], RedisHeldIndex]:
    client = aioredis.Redis(host="127.0.0.1", port=port, decode_responses=False)
    await client.flushall()
    base = await used_memory(client)
    index = RedisHeldIndex(client)
    server0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    for node, batch in batches:
        await index.report(node, [batch])
    wall = time.perf_counter() - t0
    server = cpu_seconds(pid) - server0
    held = await used_memory(client) - base
    samples: list[float] = []
    answers: list[list[tuple[str, int]]] = []
    server0 = cpu_seconds(pid)
    for chain in queries:
        t = time.perf_counter()
        answers.append(await index.lookup(chain, names))
        samples.append(time.perf_counter() - t)
    lookup_cpu = cpu_seconds(pid) - server0
    blocks = 0
    for name in names:
        blocks += int(await cast("Awaitable[int]", client.hlen(RedisHeldIndex._keys(name)[0])))
    await client.aclose()
    return {
        "ingest": ingest_figures(batches, wall, {"redis_cpu_s": round(server, 2)}),
        "lookup": {
            **lookup_figures(samples),
            "redis_cpu_ms_per_lookup": round(lookup_cpu / len(queries) * 1e3, 3),
        },
        "indexed_blocks": blocks,
        "redis_used_memory_mib": round(held / 2**20, 1),
        "answers": answers,
    }, index


async def run(args: argparse.Namespace, port: int, pid: int) -> dict[str, Any]:
    rng = random.Random(7)
    out: dict[str, Any] = {}
    for nodes in args.nodes:
        batches, convs = workload(nodes, args.blocks, args.block_size, rng)
        queries = prompts(convs, args.block_size, args.lookups, rng)
        names = [f"nodes/n{i}" for i in range(nodes)]
        memory, index = bench_memory(batches, queries, names)
        stream, replica = await bench_stream(port, pid, batches, queries, names)
        redis_held, held_index = await bench_redis(port, pid, batches, queries, names)
        answers = redis_held.pop("answers")
        # All three hold the same index: the same answers.
        expected = [index.lookup(q, names) for q in queries]
        assert [replica.lookup(q, names) for q in queries] == expected
        assert answers == expected, "the Redis-held prototype disagrees with the BlockIndex"
        hits = sum(1 for a in expected if a) / len(expected)
        lengths = [len(q) for q in queries]
        out[f"{nodes} nodes"] = {
            "workload": {
                "nodes": nodes,
                "block_size": args.block_size,
                "batches": len(batches),
                "events_per_batch": round(events_in(batches) / len(batches), 2),
                "blocks_per_batch": round(blocks_in(batches) / len(batches), 1),
                "lookup_blocks_p50": int(statistics.median(lengths)),
                "lookup_hit_rate": round(hits, 3),
            },
            "memory": memory,
            "stream": stream,
            "redis": redis_held,
        }
        del held_index
    return out


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{'':10} {'candidate':8} {'batches/s':>10} {'events/s':>9} {'blocks/s':>9} "
        f"{'lookup p50 us':>14} {'p99 us':>9} {'memory':>28}"
    )
    for case, r in result.items():
        for name in ("memory", "stream", "redis"):
            c = r[name]
            if name == "memory":
                mem = f"process {c['process_index_mib']} MiB"
            elif name == "stream":
                mem = f"{c['process_index_mib_per_replica']} MiB each, Redis {c['redis_used_memory_mib']} MiB"
            else:
                mem = f"Redis {c['redis_used_memory_mib']} MiB"
            i, lk = c["ingest"], c["lookup"]
            print(
                f"{case:10} {name:8} {i['batches_per_s']:>10} {i['events_per_s']:>9} {i['blocks_per_s']:>9} "
                f"{lk['p50_us']:>14} {lk['p99_us']:>9} {mem:>28}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",")], default=[2, 16])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args()
    with redis_server(Path(args.dir), ["--appendonly", "no"]) as (port, pid):
        result = asyncio.run(run(args, port, pid))
    print_table(result)
    figures = {
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "results": result,
    }
    path = save("block_index", figures, args=args)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
