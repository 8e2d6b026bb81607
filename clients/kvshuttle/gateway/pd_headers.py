"""The header contract between kvshuttle's endpoint picker (the EPP writes these on the request
Envoy forwards to the decode pod) and the decode-side sidecar (kvshuttle.gateway.sidecar reads
them). One module, so the two sides cannot drift apart.

- `x-prefiller-host-port`: the prefill engine as `host:port` (`[addr]:port` for IPv6), llm-d's
  own header, so a plain llm-d sidecar understands a kvshuttle EPP too. Absent on an extend plan
  (the decode node runs the whole turn).
- `x-kvshuttle-turn`: the plan's turn handle (`turns/...`): what the sidecar commits or aborts.
- `x-kvshuttle-plan`: the whole kvshuttle.router.v1.PlanTurnResponse, serialized and base64url
  encoded without padding (decision, prefill's kv_transfer_params, both placements, generation).

Parsing here is strict and bounded: a header that does not parse is the sidecar's reason to
serve the turn plain, never an error the user sees.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
from urllib.parse import urlsplit

from google.protobuf.message import DecodeError

from kvshuttle.router.v1 import router_service_pb2 as pb

__all__ = [
    "KVSHUTTLE_HEADERS",
    "MAX_PLAN_HEADER_BYTES",
    "PLAN_HEADER",
    "PREFILLER_HOST_PORT_HEADER",
    "TURN_HEADER",
    "decode_plan",
    "encode_plan",
    "endpoint_host_port",
    "host_port",
    "parse_host_port",
]

PREFILLER_HOST_PORT_HEADER = "x-prefiller-host-port"
TURN_HEADER = "x-kvshuttle-turn"
PLAN_HEADER = "x-kvshuttle-plan"
# kvshuttle's own: a client must never be able to send them through the gateway unchanged (the
# EPP overwrites or removes them on every request).
KVSHUTTLE_HEADERS = (TURN_HEADER, PLAN_HEADER)
# A plan is a few hundred bytes (a reuse plan's block ids make it grow with the prompt: 4 bytes a
# block, 64k blocks at most); Envoy's default header limit is 60 KiB all told.
MAX_PLAN_HEADER_BYTES = 48 * 1024


def encode_plan(plan: pb.PlanTurnResponse) -> str:
    """The `x-kvshuttle-plan` value of `plan`."""
    return base64.urlsafe_b64encode(plan.SerializeToString()).rstrip(b"=").decode("ascii")


def decode_plan(value: str) -> pb.PlanTurnResponse:
    """The plan an `x-kvshuttle-plan` value carries. Raises ValueError saying what is wrong."""
    if len(value) > MAX_PLAN_HEADER_BYTES:
        raise ValueError(f"the plan header exceeds {MAX_PLAN_HEADER_BYTES} bytes")
    if "=" in value or not value:
        raise ValueError("the plan header must be unpadded, non-empty base64url")
    try:
        # validate: the stdlib would otherwise skip characters outside the alphabet.
        raw = base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the plan header is not base64url") from None
    plan = pb.PlanTurnResponse()
    try:
        plan.ParseFromString(raw)
    except DecodeError:
        raise ValueError("the plan header is not a PlanTurnResponse") from None
    return plan


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 address in brackets; IP addresses in their canonical form and
    names lower-cased, so two spellings of one endpoint compare equal."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return f"{host.lower().rstrip('.')}:{port}"
    return f"[{address.compressed}]:{port}" if address.version == 6 else f"{address.compressed}:{port}"


def parse_host_port(value: str) -> str:
    """The canonical form of a `host:port` header value (see host_port). Raises ValueError for
    anything else: a scheme, a path, user info, a missing or out-of-range port, an unbracketed
    IPv6 address."""
    if not value or len(value) > 300 or any(c in value for c in "/@?# \t\\"):
        raise ValueError("must be host:port")
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        if not sep:
            raise ValueError("an IPv6 address must be [addr]:port")
        try:
            if ipaddress.ip_address(host).version != 6:
                raise ValueError("only an IPv6 address goes in brackets")
        except ValueError:
            raise ValueError("the bracketed host is not an IPv6 address") from None
    else:
        host, sep, port = value.rpartition(":")
        if not sep or not host or ":" in host:
            raise ValueError("must be host:port (an IPv6 address as [addr]:port)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("the port must be 1..65535")
    return host_port(host, int(port))


def endpoint_host_port(endpoint: str) -> str | None:
    """The canonical `host:port` of an engine's base URL ("http://10.0.0.5:8000",
    "http://[fd00::5]:8000/v1"); None when it names no host or port."""
    try:
        parts = urlsplit(endpoint)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return host_port(parts.hostname, port)
