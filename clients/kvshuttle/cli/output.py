"""How the CLI shows things: aligned tables and detail views for people, JSON for scripts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TextIO

from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from kvshuttle.core.prototime import from_timestamp, seconds_until
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.vllm.kv_transfer_params import to_vllm


def message_to_dict(message: Message) -> dict[str, Any]:
    """A message as proto3 JSON with snake_case field names and every field present."""
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def resource_of(response: Message) -> Message:
    """The resource a response carries when it carries nothing else, else the response itself.

    GetNodeResponse, RegisterNodeResponse -> the Node; GetRetentionResponse, ClaimRetentionResponse,
    RenewRetentionResponse -> the Retention; GetConversationResponse -> the Conversation. Responses
    with more to say (PutRetentionResponse's `replaced`, pages, events, counts) stay whole.
    """
    fields = response.DESCRIPTOR.fields
    if len(fields) == 1:
        field = fields[0]
        if field.message_type is not None and field.message_type.full_name.startswith("kvshuttle."):
            inner: Message = getattr(response, field.name)
            return inner
    return response


@dataclass
class Printer:
    """Where and how a command writes; `clock` is the wall clock relative times are shown against."""

    out: TextIO
    err: TextIO
    json: bool = False
    clock: Callable[[], float] = time.time

    def line(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def error(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()

    def json_doc(self, doc: Mapping[str, Any] | Message, *, compact: bool = False) -> None:
        """`doc` as JSON; a message through `resource_of` and message_to_dict."""
        data = message_to_dict(resource_of(doc)) if isinstance(doc, Message) else doc
        self.line(json.dumps(data, separators=(",", ":")) if compact else json.dumps(data, indent=2))

    def table(self, headers: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
        for text in table(headers, rows):
            self.line(text)

    def details(self, pairs: Iterable[tuple[str, str]], indent: str = "") -> None:
        items = list(pairs)
        width = max((len(k) for k, _ in items), default=0) + 1
        for key, value in items:
            self.line(f"{indent}{key + ':':<{width}} {value}".rstrip())


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    grid = [list(headers), *(list(r) for r in rows)]
    widths = [max(len(row[i]) for row in grid) for i in range(len(headers))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in grid]


def duration(seconds: float) -> str:
    """A short duration: 4.2s, 3m12s, 1h02m, 2d03h."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def expires_in(ts: Timestamp, now: float) -> str:
    """ "in 4.2s", "expired", or "-" when unset."""
    left = seconds_until(ts, now)
    if left is None:
        return "-"
    return f"in {duration(left)}" if left > 0 else "expired"


def when(ts: Timestamp, now: float) -> str:
    """An absolute local time with how long ago or ahead it is; "-" when unset."""
    left = seconds_until(ts, now)
    if left is None:
        return "-"
    stamp = datetime.fromtimestamp(from_timestamp(ts)).astimezone().isoformat(timespec="milliseconds")
    relative = f"in {duration(left)}" if left > 0 else f"{duration(-left)} ago"
    return f"{stamp} ({relative})"


def clock(ts: Timestamp) -> str:
    """Local time of day with milliseconds, for streams of events."""
    return datetime.fromtimestamp(from_timestamp(ts)).strftime("%H:%M:%S.%f")[:-3]


def size(n: int) -> str:
    """Bytes in binary units: 512 B, 1.5 KiB, 3.0 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def enum_label(name: str, prefix: str) -> str:
    """NODE_ROLE_DECODE -> decode; *_UNSPECIFIED -> -."""
    label = name.removeprefix(prefix).lower()
    return "-" if label == "unspecified" else label


def role(value: pb.NodeRole.ValueType) -> str:
    return enum_label(pb.NodeRole.Name(value), "NODE_ROLE_")


def state(value: pb.RetentionState.ValueType) -> str:
    return enum_label(pb.RetentionState.Name(value), "RETENTION_STATE_")


def change(value: pb.RetentionChange.ValueType) -> str:
    return enum_label(pb.RetentionChange.Name(value), "RETENTION_CHANGE_")


def load(node: pb.Node) -> str:
    """The node's last reported load, "-" before its first report."""
    if not node.HasField("load"):
        return "-"
    value = node.load
    text = f"run {value.running_requests} wait {value.waiting_requests} kv {value.kv_cache_usage:.0%}"
    return text if value.engine_healthy else f"{text} unhealthy"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


NODE_HEADERS = (
    "NAME", "ROLE", "MODEL", "ENGINE", "HTTP", "INCARNATION", "RETENTIONS", "RETAINED", "EXPIRES-IN", "LOAD",
)  # fmt: skip


def node_row(node: pb.Node, now: float) -> list[str]:
    return [
        node.name,
        role(node.role),
        node.model,
        node.engine_id,
        node.http_endpoint,
        str(node.incarnation),
        str(node.retention_count),
        size(node.retained_bytes),
        expires_in(node.expire_time, now),
        load(node),
    ]


def node_details(node: pb.Node, now: float) -> list[tuple[str, str]]:
    labels = ", ".join(f"{k}={v}" for k, v in sorted(node.labels.items()))
    return [
        ("name", node.name),
        ("role", role(node.role)),
        ("engine", node.engine_id),
        ("http", node.http_endpoint),
        ("side channel", f"{node.side_channel_host}:{node.side_channel_port}"),
        ("agent", node.agent_endpoint or "-"),
        ("model", node.model),
        ("block size", str(node.block_size)),
        ("kv bytes/token", str(node.kv_bytes_per_token)),
        ("labels", labels or "-"),
        ("incarnation", str(node.incarnation)),
        ("registered", when(node.register_time, now)),
        ("expires", expires_in(node.expire_time, now)),
        ("retentions", f"{node.retention_count} ({size(node.retained_bytes)})"),
        ("indexed blocks", str(node.indexed_blocks)),
        ("load", load(node)),
    ]


RETENTION_HEADERS = ("NAME", "NODE", "GEN", "TOKENS", "BLOCKS", "STATE", "EXPIRES-IN")


def retention_row(retention: pb.Retention, now: float) -> list[str]:
    return [
        retention.name,
        retention.node,
        str(retention.generation),
        str(retention.num_tokens),
        str(len(retention.block_hashes)),
        state(retention.state),
        expires_in(retention.expire_time, now),
    ]


def retention_details(retention: pb.Retention, now: float) -> list[tuple[str, str]]:
    pairs = [
        ("name", retention.name),
        ("node", retention.node),
        ("generation", str(retention.generation)),
        ("model", retention.model),
        ("block size", str(retention.block_size)),
        ("tokens", str(retention.num_tokens)),
        ("blocks", str(len(retention.block_hashes))),
        ("kv bytes", size(retention.kv_bytes)),
        ("state", state(retention.state)),
    ]
    if retention.HasField("claim"):
        claim = retention.claim
        pairs += [
            ("claim id", claim.claim_id),
            ("claim holder", claim.holder),
            ("claim expires", expires_in(claim.expire_time, now)),
        ]
    pairs += [
        ("created", when(retention.create_time, now)),
        ("expires", expires_in(retention.expire_time, now)),
        (
            "pinned until",
            when(retention.pin_expire_time, now) if retention.HasField("pin_expire_time") else "-",
        ),
    ]
    if retention.HasField("kv_transfer_params"):
        params = to_vllm(retention.kv_transfer_params)
        pairs.append(("kv_transfer_params", json.dumps(params, separators=(",", ":"))))
    return pairs


def change_line(event: pb.WatchRetentionsResponse, now: float) -> str:
    """One line for a watch event: time, change, retention, and its state at the change."""
    r = event.retention
    expiry = expires_in(r.expire_time, now)
    tail = "" if expiry == "-" else "expired" if expiry == "expired" else f"expires {expiry}"
    at = clock(event.change_time) if event.HasField("change_time") else "-"
    return (
        f"{at}  {change(event.change):<9}  {r.name}  node={r.node} gen={r.generation} "
        f"tokens={r.num_tokens} state={state(r.state)} {tail}"
    ).rstrip()
