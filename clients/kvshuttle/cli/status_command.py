"""`kvshuttle status`: the stack at a glance, from what the services already expose.

    kvshuttle status [--gateway-metrics HOST:PORT ...] [--tenant T ...] [--last N] [--json]

- nodes, their health, load and the retentions each holds: the registry's ListNodes;
- each agent's block pool: GetStatus of every agent the nodes name (one that does not answer
  is shown as such, the rest still print);
- the turns' decisions so far, by reason: the gateways' Prometheus metrics
  (`kvshuttle_gateway_turns_total` and friends), summed over every --gateway-metrics given;
- the last turns: each conversation's live retention (the KV its last committed turn left),
  newest first, from the registry's ListRetentions of the tenants asked for.

With --json one document: {"registry", "nodes", "pools", "turns", "last_turns"}, integers as
JSON numbers. Exit status 1 when the registry does not answer; agents and gateways that do not
answer are reported in place.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from prometheus_client.parser import text_string_to_metric_families

from kvshuttle.agent.v1 import agent_service_pb2 as apb
from kvshuttle.cli import output
from kvshuttle.cli.common import host_port, positive_int
from kvshuttle.cli.output import Printer
from kvshuttle.client import AgentClient, ChannelOptions, KvshuttleRpcError, RegistryClient
from kvshuttle.core.prototime import from_timestamp
from kvshuttle.registry.v1 import registry_service_pb2 as pb

GATEWAY_METRICS_ENV: Final = "KVSHUTTLE_GATEWAY_METRICS_ADDR"
# The gateway's tenant when it has no API keys (kvshuttle.gateway.config.DEFAULT_TENANT; the CLI
# does not import the gateway: they are layers apart).
DEFAULT_TENANT: Final = "default"
DEFAULT_LAST: Final = 10
# Bounds on what one status reads: retentions per tenant, and bytes of one metrics page.
MAX_RETENTIONS: Final = 10_000
MAX_METRICS_BYTES: Final = 4 << 20

Options: TypeAlias = Callable[[str], ChannelOptions]
"""The channel options (TLS, token, deadline) of the command line, for another address."""

StatusCommand: TypeAlias = Callable[[RegistryClient, Options, argparse.Namespace, Printer], Awaitable[int]]


# What the status reads


@dataclass
class Turns:
    """The gateways' counters, summed."""

    sources: list[str]
    by_reason: dict[tuple[str, str], int] = field(default_factory=dict)
    reused_tokens: int = 0
    commits: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def add_page(self, text: str) -> None:
        """One gateway's /metrics page (Prometheus text format)."""
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue  # the _created twins
                value = int(sample.value)
                labels = sample.labels
                if family.name == "kvshuttle_gateway_turns":
                    key = (labels.get("decision", ""), labels.get("reason", ""))
                    self.by_reason[key] = self.by_reason.get(key, 0) + value
                elif family.name == "kvshuttle_gateway_reused_tokens":
                    self.reused_tokens += value
                elif family.name == "kvshuttle_gateway_commits":
                    outcome = labels.get("outcome", "")
                    self.commits[outcome] = self.commits.get(outcome, 0) + value
                elif family.name == "kvshuttle_gateway_reuse_fallbacks":
                    why = labels.get("why", "")
                    self.fallbacks[why] = self.fallbacks.get(why, 0) + value

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def decided(self, decision: str) -> int:
        return sum(n for (d, _), n in self.by_reason.items() if d == decision)

    def to_json(self) -> dict[str, Any]:
        return {
            "sources": self.sources,
            "errors": self.errors,
            "total": self.total,
            "decisions": [
                {"decision": d, "reason": r, "turns": n} for (d, r), n in sorted(self.by_reason.items())
            ],
            "reused_tokens": self.reused_tokens,
            "commits": self.commits,
            "reuse_fallbacks": self.fallbacks,
        }


def _fetch_metrics(address: str, timeout: float) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as response:
        body: bytes = response.read(MAX_METRICS_BYTES + 1)
    if len(body) > MAX_METRICS_BYTES:
        raise ValueError(f"more than {MAX_METRICS_BYTES} bytes of metrics")
    return body.decode()


async def read_turns(addresses: list[str], call_timeout: float) -> Turns:
    turns = Turns(sources=addresses)
    pages = await asyncio.gather(
        *(asyncio.to_thread(_fetch_metrics, a, call_timeout) for a in addresses), return_exceptions=True
    )
    for address, page in zip(addresses, pages, strict=True):
        if isinstance(page, BaseException):
            turns.errors[address] = str(getattr(page, "reason", None) or page)
            continue
        try:
            turns.add_page(page)
        except ValueError as exc:  # not a Prometheus page
            turns.errors[address] = f"not Prometheus metrics: {exc}"
    return turns


@dataclass
class Pool:
    """One agent's answer: its node and pool, or why it gave none."""

    agent: str
    node: str  # the (engine's) node that names this agent, as the registry says
    status: apb.GetStatusResponse | None = None
    error: str = ""


async def read_pools(nodes: Iterable[pb.Node], options: Options, call_timeout: float) -> list[Pool]:
    # An agent with a pool registers two nodes (its engine's and its pool's): name the engine's.
    named = {n.agent_endpoint: n.name for n in nodes if n.agent_endpoint and n.role == pb.NODE_ROLE_POOL}
    named |= {n.agent_endpoint: n.name for n in nodes if n.agent_endpoint and n.role != pb.NODE_ROLE_POOL}

    async def one(agent: str) -> Pool:
        try:
            async with AgentClient.connect(options(agent)) as client:
                return Pool(agent, named[agent], await client.get_status(timeout=call_timeout))
        except KvshuttleRpcError as exc:
            return Pool(agent, named[agent], error=exc.code_name if exc.reason is None else str(exc))

    return list(await asyncio.gather(*(one(a) for a in sorted(named))))


async def read_last_turns(
    client: RegistryClient, tenants: list[str], last: int
) -> tuple[list[pb.Retention], list[str]]:
    """The `last` newest retentions over `tenants`; and the tenants with more than
    MAX_RETENTIONS (only that many of theirs were read)."""
    found: list[pb.Retention] = []
    truncated = []
    for tenant in tenants:
        read = 0
        async for retention in client.iter_retentions(f"tenants/{tenant}"):
            read += 1
            if read > MAX_RETENTIONS:
                truncated.append(tenant)
                break
            found.append(retention)
            if len(found) > last:  # keep `last` in memory, not the tenant's whole list
                found = heapq.nlargest(last, found, key=_committed)
    return sorted(found, key=_committed, reverse=True)[:last], truncated


def _committed(retention: pb.Retention) -> float:
    return from_timestamp(retention.create_time) if retention.HasField("create_time") else 0.0


# How it prints


def health(node: pb.Node) -> str:
    if not node.HasField("load"):
        return "unknown"
    return "healthy" if node.load.engine_healthy else "unhealthy"


def load(node: pb.Node) -> str:
    if not node.HasField("load"):
        return "-"
    value = node.load
    return f"run {value.running_requests} wait {value.waiting_requests} kv {value.kv_cache_usage:.0%}"


def node_json(node: pb.Node) -> dict[str, Any]:
    return {
        "name": node.name,
        "role": output.role(node.role),
        "model": node.model,
        "health": health(node),
        "load": None
        if not node.HasField("load")
        else {
            "running_requests": node.load.running_requests,
            "waiting_requests": node.load.waiting_requests,
            "kv_cache_usage": node.load.kv_cache_usage,
        },
        "retentions": node.retention_count,
        "retained_bytes": node.retained_bytes,
        "agent": node.agent_endpoint,
    }


def pool_json(pool: Pool) -> dict[str, Any]:
    if pool.status is None:
        return {"agent": pool.agent, "node": pool.node, "error": pool.error}
    p = pool.status.pool
    return {
        "agent": pool.agent,
        "node": pool.node,
        "capacity_bytes": p.capacity_bytes,
        "used_bytes": p.used_bytes,
        "total_blocks": p.total_blocks,
        "used_blocks": p.used_blocks,
        "parked_retentions": p.parked_retentions,
        "filling_retentions": p.filling_retentions,
    }


def pool_row(pool: Pool) -> list[str]:
    if pool.status is None:
        return [pool.agent, pool.node, f"unreachable ({pool.error})", "", ""]
    p = pool.status.pool
    if p.capacity_bytes == 0:
        return [pool.agent, pool.node, "no pool", "", ""]
    return [
        pool.agent,
        pool.node,
        f"{output.size(p.used_bytes)} of {output.size(p.capacity_bytes)}"
        f" ({p.used_blocks}/{p.total_blocks} blocks)",
        f"{p.parked_retentions} parked, {p.filling_retentions} filling",
        f"{p.capacity_bytes and p.used_bytes / p.capacity_bytes:.0%}",
    ]


def conversation_of(retention: pb.Retention) -> str:
    """tenants/t/conversations/c/retentions/g -> tenants/t/conversations/c."""
    return retention.name.rpartition("/retentions/")[0]


def last_turn_json(retention: pb.Retention) -> dict[str, Any]:
    return {
        "conversation": conversation_of(retention),
        "turn": retention.generation,
        "tokens": retention.num_tokens,
        "holder": retention.node,
        "state": output.state(retention.state),
        "kv_bytes": retention.kv_bytes,
        "committed": retention.create_time.ToJsonString() if retention.HasField("create_time") else None,
    }


def print_text(
    p: Printer,
    registry: str,
    nodes: list[pb.Node],
    pools: list[Pool],
    turns: Turns | None,
    last: list[pb.Retention],
    tenants: list[str],
) -> None:
    now = p.clock()
    retained = sum(n.retained_bytes for n in nodes)
    p.line(
        f"NODES (registry {registry}): {output.plural(len(nodes), 'node')}, "
        f"{output.plural(sum(n.retention_count for n in nodes), 'retention')} ({output.size(retained)})"
    )
    p.table(
        ("NAME", "ROLE", "HEALTH", "LOAD", "RETENTIONS", "RETAINED", "AGENT"),
        (
            [n.name, output.role(n.role), health(n), load(n), str(n.retention_count),
             output.size(n.retained_bytes), n.agent_endpoint or "-"]
            for n in nodes
        ),
    )  # fmt: skip
    p.line()
    p.line("POOLS")
    if pools:
        p.table(("AGENT", "NODE", "USED", "RETENTIONS", "USE"), (pool_row(pool) for pool in pools))
    else:
        p.line("  no agent registered")
    p.line()
    if turns is None:
        p.line(f"TURNS: give --gateway-metrics HOST:PORT (or ${GATEWAY_METRICS_ENV}) to see the decisions")
    else:
        p.line(f"TURNS (gateway metrics {', '.join(turns.sources)})")
        for address, error in turns.errors.items():
            p.line(f"  {address}: unreachable ({error})")
        if turns.by_reason:
            p.table(
                ("DECISION", "REASON", "TURNS"),
                ([d, r, str(n)] for (d, r), n in sorted(turns.by_reason.items())),
            )
        reused = turns.decided("reuse")
        share = f" ({reused / turns.total:.0%})" if turns.total else ""
        commits = ", ".join(f"{n} {o}" for o, n in sorted(turns.commits.items())) or "none"
        p.line(
            f"{output.plural(turns.total, 'turn')}, {reused} reused retained KV{share}, "
            f"{turns.reused_tokens} prompt tokens reused; commits: {commits}"
        )
        if turns.fallbacks:
            p.line(
                "reuse fallen back to recompute: "
                + ", ".join(f"{n} {w}" for w, n in sorted(turns.fallbacks.items()))
            )
    p.line()
    p.line(f"LAST TURNS (tenant {', '.join(tenants)}; newest first)")
    if not last:
        p.line("  no live retention")
        return
    p.table(
        ("CONVERSATION", "TURN", "TOKENS", "HOLDER", "STATE", "COMMITTED"),
        (
            [conversation_of(r), str(r.generation), str(r.num_tokens), r.node, output.state(r.state),
             f"{output.duration(max(0.0, now - _committed(r)))} ago" if r.HasField("create_time") else "-"]
            for r in last
        ),
    )  # fmt: skip


async def status(client: RegistryClient, options: Options, args: argparse.Namespace, p: Printer) -> int:
    nodes = [n async for n in client.iter_nodes()]
    gateways = [f"{host}:{port}" for host, port in args.gateway_metrics or args.gateway_metrics_env]
    args.tenants = args.tenants or [DEFAULT_TENANT]
    pools, turns, (last, truncated) = await asyncio.gather(
        read_pools(nodes, options, args.timeout),
        read_turns(gateways, args.timeout) if gateways else _none(),
        read_last_turns(client, args.tenants, args.last),
    )
    if p.json:
        p.json_doc(
            {
                "registry": args.registry,
                "nodes": [node_json(n) for n in nodes],
                "pools": [pool_json(pool) for pool in pools],
                "turns": None if turns is None else turns.to_json(),
                "last_turns": [last_turn_json(r) for r in last],
                "truncated_tenants": truncated,
            }
        )
        return 0
    print_text(p, args.registry, nodes, pools, turns, last, args.tenants)
    for tenant in truncated:
        p.line(f"(tenant {tenant}: only its first {MAX_RETENTIONS} retentions were read)")
    return 0


async def _none() -> None:
    return None


def add_command(groups: Any, parents: list[argparse.ArgumentParser], gateway_metrics: str | None) -> None:
    """Add `status` to the top-level subparsers `groups`; `gateway_metrics` is the default of
    --gateway-metrics (from the environment)."""
    help_text = "the stack at a glance: nodes, pools, turns' decisions, last turns"
    sub: argparse.ArgumentParser = groups.add_parser(
        "status",
        parents=parents,
        help=help_text,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub.add_argument(
        "--gateway-metrics",
        type=host_port,
        action="append",
        metavar="HOST:PORT",
        help=f"a gateway's metrics listener (repeatable; default: ${GATEWAY_METRICS_ENV}, comma-separated)",
    )
    sub.add_argument(
        "--tenant",
        dest="tenants",
        action="append",
        metavar="TENANT",
        help=f"whose last turns to list (repeatable; default: {DEFAULT_TENANT}, a keyless gateway's)",
    )
    sub.add_argument(
        "--last",
        type=positive_int,
        default=DEFAULT_LAST,
        metavar="N",
        help=f"how many (default: {DEFAULT_LAST})",
    )
    # Given on the command line, --gateway-metrics replaces the environment's list.
    from_env = [host_port(a) for a in (gateway_metrics or "").split(",") if a]
    sub.set_defaults(status_command=status, parser=sub, gateway_metrics_env=from_env)
