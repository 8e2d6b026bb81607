"""The header contract between kvshuttle's endpoint picker (the EPP writes these on the request
Envoy forwards to the decode pod) and the decode-side sidecar (kvshuttle.sidecar reads
them). One module, so the two sides cannot drift apart.

- `x-prefiller-host-port`: the prefill engine as `host:port` (`[addr]:port` for IPv6), llm-d's
  own header, so a plain llm-d sidecar understands a kvshuttle EPP too. Absent on an extend plan
  (the decode node runs the whole turn).
- `x-kvshuttle-turn`: the plan's turn handle (`turns/...`): what the sidecar commits or aborts.
- `x-kvshuttle-plan`: the whole kvshuttle.router.v1.PlanTurnResponse, serialized and base64url
  encoded without padding (decision, prefill's kv_transfer_params, both placements, generation).
- `x-kvshuttle-prompt`: SHA-256 of the prompt ids the plan was made for (uint32 little-endian),
  base64url without padding. The sidecar runs the plan only on exactly those ids: its own
  tokenization (a transcript it found, or not) that differs is served plain, never with the
  plan's KV.

Parsing here is strict and bounded: a header that does not parse is the sidecar's reason to
serve the turn plain, never an error the user sees.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import sys
from array import array
from collections.abc import Sequence

from google.protobuf.message import DecodeError

from kvshuttle.router.v1 import router_service_pb2 as pb

__all__ = [
    "KVSHUTTLE_HEADERS",
    "MAX_PLAN_HEADER_BYTES",
    "PLAN_HEADER",
    "PREFILLER_HOST_PORT_HEADER",
    "PROMPT_HEADER",
    "TURN_HEADER",
    "decode_plan",
    "encode_plan",
    "prompt_digest",
]

PREFILLER_HOST_PORT_HEADER = "x-prefiller-host-port"
TURN_HEADER = "x-kvshuttle-turn"
PLAN_HEADER = "x-kvshuttle-plan"
PROMPT_HEADER = "x-kvshuttle-prompt"
# kvshuttle's own: a client must never be able to send them through the gateway unchanged (the
# EPP overwrites or removes them on every request).
KVSHUTTLE_HEADERS = (TURN_HEADER, PLAN_HEADER, PROMPT_HEADER)
# A plan is a few hundred bytes (a reuse plan's block ids make it grow with the prompt: 4 bytes a
# block, 64k blocks at most); Envoy's default header limit is 60 KiB all told.
MAX_PLAN_HEADER_BYTES = 48 * 1024


def prompt_digest(ids: Sequence[int]) -> str:
    """The `x-kvshuttle-prompt` value of a prompt's ids."""
    packed = array("I", ids)  # 32-bit on every platform CPython supports
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    digest = hashlib.sha256(packed.tobytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


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
