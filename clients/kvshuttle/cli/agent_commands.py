"""`kvshuttle agent ...`: one agent sidecar, dialled at --agent (not through the registry).

    kvshuttle agent status --agent 10.0.0.7:50071 [--json]

With --json a command prints the RPC's response message as proto3 JSON (snake_case field
names, 64-bit integers as strings).
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

from kvshuttle.agent.v1 import agent_service_pb2 as pb
from kvshuttle.cli import output
from kvshuttle.cli.output import Printer
from kvshuttle.client import AgentClient

AGENT_ENV = "KVSHUTTLE_AGENT_ADDR"
DEFAULT_AGENT = "127.0.0.1:50071"

AgentCommand: TypeAlias = Callable[[AgentClient, argparse.Namespace, Printer], Awaitable[int]]
"""A subcommand of `agent`: runs with a client of the agent at --agent."""


def pool_details(pool: pb.PoolStatus) -> list[tuple[str, str]]:
    if pool.capacity_bytes == 0:
        return [("pool", "none")]
    return [
        ("pool", f"{output.size(pool.capacity_bytes)} in {pool.total_blocks} blocks"),
        ("block", f"{output.size(pool.block_bytes)} ({output.plural(pool.regions, 'region')})"),
        ("used", f"{pool.used_blocks} blocks, {output.size(pool.used_bytes)}"),
        ("free", f"{pool.free_blocks} blocks, {output.size(pool.capacity_bytes - pool.used_bytes)}"),
        (
            "retentions",
            f"{pool.parked_retentions} parked, {pool.filling_retentions} filling",
        ),
        ("expired", str(pool.expired_retentions)),
        ("refused", output.plural(pool.failed_allocations, "allocation")),
    ]


async def status(client: AgentClient, args: argparse.Namespace, p: Printer) -> int:
    response = await client.get_status()
    if p.json:
        p.json_doc(response)
        return 0
    engine, events = response.engine, response.events
    p.details(
        [
            ("node", response.node or "-"),
            ("registered", f"{'yes' if response.registered else 'no'} (incarnation {response.incarnation})"),
            ("engine", f"{engine.engine_id} at {engine.http_endpoint}"),
            (
                "engine load",
                f"{'healthy' if engine.healthy else 'unhealthy'}, {engine.running_requests} running, "
                f"{engine.waiting_requests} waiting, kv cache {engine.kv_cache_usage:.0%}",
            ),
            ("events", events.endpoint or "-"),
            (
                "batches",
                f"{events.batches_received} received, {events.batches_forwarded} forwarded, "
                f"{events.batches_dropped} dropped",
            ),
            *pool_details(response.pool),
        ]
    )
    return 0


def add_commands(groups: Any, parents: list[argparse.ArgumentParser], agent: str) -> None:
    """Add `agent` and its commands to the top-level subparsers `groups`; `agent` is the
    default of --agent."""
    group = groups.add_parser(
        "agent",
        parents=parents,
        help="one agent sidecar: its engine, event stream and block pool",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = group.add_subparsers(dest="agent_subcommand", metavar="COMMAND", required=True)
    help_text = "the agent's status: lease, engine, KV events, block pool"
    sub: argparse.ArgumentParser = commands.add_parser(
        "status", parents=parents, help=help_text, description=help_text
    )
    sub.add_argument(
        "--agent",
        metavar="ADDR",
        default=agent,
        help=f"agent host:port (default: ${AGENT_ENV} or {DEFAULT_AGENT})",
    )
    sub.set_defaults(agent_command=status, parser=sub)
