"""`kvshuttle registry ...`: the registry's nodes, retentions and block index.

With --json a command prints proto3 JSON (snake_case field names, 64-bit integers as strings):
the node, retention or conversation itself where the RPC answers with just that (get,
register-node, claim, renew), otherwise the RPC's response message (put-retention, heartbeat,
deregister, release, lookup). List commands print one response with every page's items
({"nodes": [...]}, {"retentions": [...]}); watch prints one compact event per line.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvshuttle.cli import output
from kvshuttle.cli.common import (
    CONVERSATION_NAME,
    NODE_NAME,
    RETENTION_NAME,
    Command,
    UsageError,
    add_token_options,
    host_port,
    json_object,
    label,
    node_name,
    non_negative_int,
    positive_float,
    positive_int,
    token_ids,
)
from kvshuttle.cli.output import Printer
from kvshuttle.client import RegistryClient
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.core.prototime import to_timestamp
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.vllm.kv_transfer_params import from_vllm

ROLES = {
    "prefill": pb.NODE_ROLE_PREFILL,
    "decode": pb.NODE_ROLE_DECODE,
    "both": pb.NODE_ROLE_BOTH,
    "pool": pb.NODE_ROLE_POOL,
}


# Nodes


async def nodes(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    role = ROLES[args.role] if args.role else pb.NODE_ROLE_UNSPECIFIED
    found = [n async for n in client.iter_nodes(role=role, model=args.model)]
    if p.json:
        p.json_doc(pb.ListNodesResponse(nodes=found))
    else:
        now = p.clock()
        p.table(output.NODE_HEADERS, (output.node_row(n, now) for n in found))
    return 0


async def register_node(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    host, port = args.side_channel
    node = pb.Node(
        name=node_name(args.name),
        role=ROLES[args.role],
        engine_id=args.engine_id,
        http_endpoint=args.http,
        side_channel_host=host,
        side_channel_port=port,
        agent_endpoint=args.agent,
        model=args.model,
        block_size=args.block_size,
        kv_bytes_per_token=args.kv_bytes_per_token,
        labels=dict(args.label),
    )
    response = await client.register_node(node, ttl=args.ttl)
    if p.json:
        p.json_doc(response)
    else:
        p.details(output.node_details(response.node, p.clock()))
    return 0


async def heartbeat(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    name = node_name(args.name)
    response = await client.heartbeat_node(name, args.incarnation, ttl=args.ttl)
    if p.json:
        p.json_doc(response)
    else:
        p.line(f"{name} renewed, expires {output.expires_in(response.expire_time, p.clock())}")
    return 0


async def deregister(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    name = node_name(args.name)
    response = await client.deregister_node(name, incarnation=args.incarnation)
    if p.json:
        p.json_doc(response)
    else:
        p.line(f"{name} deregistered ({output.plural(response.removed_retentions, 'retention')} removed)")
    return 0


# Retentions


async def retentions(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    parent = f"tenants/{args.tenant}"
    if args.conversation:
        parent += f"/conversations/{args.conversation}"
    node = node_name(args.node) if args.node else ""
    found = [r async for r in client.iter_retentions(parent, node=node)]
    if p.json:
        p.json_doc(pb.ListRetentionsResponse(retentions=found))
    else:
        now = p.clock()
        p.table(output.RETENTION_HEADERS, (output.retention_row(r, now) for r in found))
    return 0


async def put_retention(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    tokens = token_ids(args)
    try:
        hashes = chain_hashes(tokens, args.block_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    node = node_name(args.node)
    retention = pb.Retention(
        node=node,
        generation=args.generation,
        model=args.model,
        block_size=args.block_size,
        num_tokens=len(tokens),
        block_hashes=hashes,
    )
    # Never invented here: a retention's params tell a prefill engine which blocks to read,
    # so made-up block ids would serve wrong KV.
    try:
        retention.kv_transfer_params.CopyFrom(from_vllm(args.kv_transfer_params, "--kv-transfer-params"))
    except InvalidArgument as exc:
        raise UsageError(str(exc)) from exc
    kv_bytes = args.kv_bytes
    if kv_bytes is None:
        kv_bytes = len(tokens) * (await client.get_node(node)).node.kv_bytes_per_token
    retention.kv_bytes = kv_bytes
    if args.pin_ttl is not None:
        retention.pin_expire_time.CopyFrom(to_timestamp(time.time() + args.pin_ttl))
    parent = f"tenants/{args.tenant}/conversations/{args.conversation}"
    response = await client.put_retention(parent, retention, ttl=args.ttl, request_id=args.request_id)
    if p.json:
        p.json_doc(response)
    else:
        p.details(output.retention_details(response.retention, p.clock()))
        if response.replaced:
            p.details([("replaced", response.replaced)])
    return 0


async def get(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    name: str = args.name
    response: Any
    if NODE_NAME.fullmatch(name):
        response = await client.get_node(name)
        sections = [output.node_details(response.node, p.clock())]
    elif RETENTION_NAME.fullmatch(name):
        response = await client.get_retention(name)
        sections = [output.retention_details(response.retention, p.clock())]
    elif CONVERSATION_NAME.fullmatch(name):
        response = await client.get_conversation(name)
        conversation = response.conversation
        sections = [
            [
                ("name", conversation.name),
                ("fence generation", str(conversation.fence_generation)),
                ("retention", conversation.retention.name or "none"),
            ]
        ]
        if conversation.HasField("retention"):
            sections.append(output.retention_details(conversation.retention, p.clock()))
    else:
        raise UsageError(
            f"cannot tell what {name!r} names: expected nodes/{{node}}, "
            "tenants/{tenant}/conversations/{conversation} or "
            "tenants/{tenant}/conversations/{conversation}/retentions/{generation}"
        )
    if p.json:
        p.json_doc(response)
        return 0
    for depth, pairs in enumerate(sections):
        p.details(pairs, indent="  " * depth)
    return 0


async def claim(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    response = await client.claim_retention(
        args.name, args.holder, args.claim_ttl, request_id=args.request_id
    )
    if p.json:
        p.json_doc(response)
    else:
        p.details(output.retention_details(response.retention, p.clock()))
    return 0


async def renew(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    response = await client.renew_retention(args.name, args.ttl)
    if p.json:
        p.json_doc(response)
    else:
        p.line(f"{args.name} renewed, expires {output.expires_in(response.retention.expire_time, p.clock())}")
    return 0


async def release(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    response = await client.release_retention(args.name, claim_id=args.claim_id, force=args.force)
    if p.json:
        p.json_doc(response)
    else:
        p.line(f"{args.name} released")
    return 0


async def watch(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    parent = f"tenants/{args.tenant}" if args.tenant else ""
    node = node_name(args.node) if args.node else ""
    events = client.watch_retentions(parent=parent, node=node)
    try:
        async for event in events:
            if p.json:
                p.json_doc(event, compact=True)
            else:
                p.line(output.change_line(event, p.clock()))
    finally:
        await events.aclose()
    return 0


async def lookup(client: RegistryClient, args: argparse.Namespace, p: Printer) -> int:
    tokens = token_ids(args)
    try:
        hashes = chain_hashes(tokens, args.block_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    role = ROLES[args.role] if args.role else pb.NODE_ROLE_UNSPECIFIED
    response = await client.lookup_blocks(hashes, model=args.model, role=role)
    if p.json:
        p.json_doc(response)
        return 0
    p.line(f"prefix: {len(hashes)} full blocks of {args.block_size} ({len(tokens)} tokens)")
    p.table(
        ("NODE", "MATCHED-BLOCKS", "MATCHED-TOKENS"),
        ((m.node, str(m.matched_blocks), str(m.matched_blocks * args.block_size)) for m in response.matches),
    )
    return 0


# Parsers


def _leaf(
    commands: Any, name: str, command: Command, parents: list[argparse.ArgumentParser], help_text: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, parents=parents, help=help_text, description=help_text
    )
    parser.set_defaults(command=command, parser=parser)
    return parser


def add_commands(groups: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add `registry` and its commands to the top-level subparsers `groups`."""
    group = groups.add_parser(
        "registry",
        parents=parents,
        help="nodes, retentions and the block index of the registry",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = group.add_subparsers(dest="registry_command", metavar="COMMAND", required=True)
    _add_node_commands(commands, parents)
    _add_retention_commands(commands, parents)
    _add_block_commands(commands, parents)


ROLE_CHOICES = sorted(ROLES)


def _add_node_commands(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    role_choices = ROLE_CHOICES
    sub = _leaf(commands, "nodes", nodes, parents, "list live nodes")
    sub.add_argument("--role", choices=role_choices, help="only this role (and 'both', except for 'pool')")
    sub.add_argument("--model", default="", help="only nodes serving this model")

    sub = _leaf(commands, "register-node", register_node, parents, "register a node (prints its incarnation)")
    sub.add_argument("name", metavar="NAME", help="node name (x or nodes/x)")
    sub.add_argument("--role", choices=role_choices, required=True)
    sub.add_argument("--engine-id", required=True, help="vLLM engine id")
    sub.add_argument("--http", required=True, metavar="URL", help="engine's OpenAI-compatible base URL")
    sub.add_argument(
        "--side-channel", required=True, type=host_port, metavar="HOST:PORT", help="NIXL side channel"
    )
    sub.add_argument("--model", required=True, help="served model name")
    sub.add_argument(
        "--block-size", required=True, type=positive_int, metavar="N", help="tokens per KV block"
    )
    sub.add_argument("--kv-bytes-per-token", required=True, type=non_negative_int, metavar="N")
    sub.add_argument("--agent", default="", metavar="ADDR", help="host:port of the node's kvshuttle agent")
    sub.add_argument("--label", type=label, action="append", default=[], metavar="K=V", help="repeatable")
    sub.add_argument("--ttl", type=positive_float, metavar="SECONDS", help="lease (default: the server's)")

    sub = _leaf(commands, "heartbeat", heartbeat, parents, "renew a node's lease")
    sub.add_argument("name", metavar="NAME")
    sub.add_argument("--incarnation", required=True, type=non_negative_int, metavar="N")
    sub.add_argument("--ttl", type=positive_float, metavar="SECONDS")

    sub = _leaf(commands, "deregister", deregister, parents, "end a node's lease now, with its retentions")
    sub.add_argument("name", metavar="NAME")
    sub.add_argument("--incarnation", type=non_negative_int, default=0, metavar="N", help="only this one")


def _add_retention_commands(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    sub = _leaf(commands, "retentions", retentions, parents, "list live retentions (all pages)")
    sub.add_argument("--tenant", required=True)
    sub.add_argument("--conversation", help="only this conversation of the tenant")
    sub.add_argument("--node", help="only retentions held by this node")

    sub = _leaf(
        commands,
        "put-retention",
        put_retention,
        parents,
        "record a retention; block hashes are computed from the token ids",
    )
    sub.add_argument("--tenant", required=True)
    sub.add_argument("--conversation", required=True)
    sub.add_argument("--node", required=True, help="node holding the KV (x or nodes/x)")
    sub.add_argument("--generation", required=True, type=positive_int, help="fencing generation (turn)")
    sub.add_argument("--model", required=True)
    sub.add_argument("--block-size", required=True, type=positive_int, metavar="N")
    add_token_options(sub)
    sub.add_argument(
        "--kv-transfer-params",
        type=json_object,
        required=True,
        metavar="JSON",
        help="decode's final kv_transfer_params object (as vLLM returned it), or @FILE",
    )
    sub.add_argument(
        "--kv-bytes", type=non_negative_int, metavar="N", help="default: tokens x the node's kv bytes/token"
    )
    sub.add_argument("--ttl", type=positive_float, metavar="SECONDS", help="lease (default: the server's)")
    sub.add_argument("--pin-ttl", type=positive_float, metavar="SECONDS", help="holder's guarantee from now")
    sub.add_argument("--request-id", help="idempotency key (default: a fresh uuid4)")

    sub = _leaf(
        commands,
        "get",
        get,
        parents,
        "show a node, a conversation or a retention, by name: nodes/{node}, "
        "tenants/{t}/conversations/{c} or tenants/{t}/conversations/{c}/retentions/{generation}",
    )
    sub.add_argument("name", metavar="NAME")

    sub = _leaf(commands, "claim", claim, parents, "claim a retention for one reader")
    sub.add_argument("name", metavar="NAME", help="retention name")
    sub.add_argument("--holder", required=True, help="who reads (shown in the claim)")
    sub.add_argument("--claim-ttl", type=positive_float, metavar="SECONDS", help="how long the read may take")
    sub.add_argument("--request-id", help="idempotency key (default: a fresh uuid4)")

    sub = _leaf(commands, "renew", renew, parents, "extend a retention's lease")
    sub.add_argument("name", metavar="NAME", help="retention name")
    sub.add_argument("--ttl", required=True, type=positive_float, metavar="SECONDS")

    sub = _leaf(commands, "release", release, parents, "remove a retention")
    sub.add_argument("name", metavar="NAME", help="retention name")
    sub.add_argument("--claim-id", default="", metavar="ID", help="needed when it is claimed")
    sub.add_argument("--force", action="store_true", help="release even if someone else claimed it")

    sub = _leaf(commands, "watch", watch, parents, "print retention changes until Ctrl-C (no --timeout)")
    scope = sub.add_mutually_exclusive_group(required=True)
    scope.add_argument("--tenant", help="changes of this tenant's retentions")
    scope.add_argument("--node", help="changes of this node's retentions")


def _add_block_commands(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    sub = _leaf(commands, "lookup", lookup, parents, "which nodes hold how much of a prompt's prefix")
    sub.add_argument("--model", required=True)
    sub.add_argument("--block-size", required=True, type=positive_int, metavar="N")
    sub.add_argument("--role", choices=ROLE_CHOICES)
    add_token_options(sub)
