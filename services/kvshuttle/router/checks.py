"""Bounds on what a caller sends the router, checked before anything is read or changed.

Each check raises InvalidArgument naming the request's field; those that return a value return
it in the form the domain uses.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvshuttle.core.endpoints import MAX_ENDPOINT_LENGTH, EndpointSet
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.hashing import TokenIds, salted_root, token_array
from kvshuttle.core.limits import MAX_DECODE_ENDPOINTS
from kvshuttle.core.names import parse_conversation, parse_tenant
from kvshuttle.router.cost import CostModel
from kvshuttle.router.model import TranscriptInfo, TranscriptSpec, TurnTimings

_TIMINGS = ("ttft_ms", "prefill_ms", "transfer_ms", "decode_ms", "transfer_bytes", "remote_cached_tokens")


def cost_model(costs: Mapping[str, CostModel], model: str) -> CostModel:
    """The cost model of the model a request names."""
    if not model:
        raise InvalidArgument("model", "required")
    cost = costs.get(model)
    if cost is None:
        raise InvalidArgument("model", f"no model profile for {model[:200]!r}")
    return cost


def token_ids(tokens: TokenIds, field: str, *, max_tokens: int) -> np.ndarray[Any, Any]:
    """A non-empty uint32 array of at most `max_tokens` token ids."""
    try:
        arr = token_array(tokens)
    except ValueError as exc:
        raise InvalidArgument(field, str(exc)) from exc
    if arr.size == 0:
        raise InvalidArgument(field, "required")
    if arr.size > max_tokens:
        raise InvalidArgument(field, f"more than {max_tokens} tokens")
    if arr is not tokens and arr.base is None:
        # Built here (not the caller's array): frozen, so the caches may keep it uncopied.
        arr.flags.writeable = False
    return arr


@functools.lru_cache(maxsize=4096)
def _checked_conversation(conversation: str, max_id_length: int) -> str:
    """A conversation name, checked (remembered: a conversation's every turn names it again;
    a name that fails is not remembered and fails again)."""
    return str(parse_conversation(conversation, "conversation", max_length=max_id_length))


def conversations(conversation: str, parent: str, *, max_id_length: int) -> tuple[str, str]:
    """The conversation and the parent it forks from, "" where not given. A parent needs a
    conversation in its own tenant."""
    checked = _checked_conversation(conversation, max_id_length) if conversation else ""
    if not parent:
        return checked, ""
    parsed = parse_conversation(parent, "hints.parent_conversation", max_length=max_id_length)
    if not checked:
        raise InvalidArgument("hints.parent_conversation", "needs a conversation")
    if parsed.tenant != parse_conversation(checked).tenant:
        raise InvalidArgument("hints.parent_conversation", "must be in the conversation's tenant")
    return checked, str(parsed)


def tenant(tenant: str, conversation: str, *, max_id_length: int) -> str:
    """The tenant id a request acts for ("" for none): `tenant` (`tenants/{tenant}`), which a
    request with a conversation may leave empty or set to the conversation's own."""
    if not tenant:
        return parse_conversation(conversation).tenant if conversation else ""
    checked = parse_tenant(tenant, "tenant", max_length=max_id_length)
    if conversation and parse_conversation(conversation).tenant != checked:
        raise InvalidArgument("tenant", "must be the conversation's tenant")
    return checked


def lookup_key(key: bytes, field: str) -> bytes:
    if not 16 <= len(key) <= 64:
        raise InvalidArgument(field, "must be 16 to 64 bytes")
    return key


def transcript(spec: TranscriptSpec | None, tokens: np.ndarray[Any, Any]) -> TranscriptInfo | None:
    """The committed sequence's transcript (its first spec.num_tokens ids), checked."""
    if spec is None:
        return None
    lookup_key(spec.lookup_key, "transcript.lookup_key")
    if not 0 < spec.num_tokens <= tokens.size:
        raise InvalidArgument("transcript.num_tokens", f"must be 1..{tokens.size} (the sequence's length)")
    if len(spec.answer_sha256) != 32:
        raise InvalidArgument("transcript.answer_sha256", "must be 32 bytes (SHA-256)")
    if spec.answer_chars < 0:
        raise InvalidArgument("transcript.answer_chars", "must not be negative")
    ids = np.asarray(tokens[: spec.num_tokens], dtype=np.uint32)
    return TranscriptInfo(spec.lookup_key, ids, spec.answer_sha256, spec.answer_chars)


def chain_root(salt_sha256: bytes) -> int:
    """The root the prompt's chain starts from: its cache salt's (kvshuttle.core.hashing)."""
    try:
        return salted_root(salt_sha256)
    except ValueError:
        raise InvalidArgument(
            "cache_salt_sha256", "must be 32 bytes (SHA-256 of the cache salt) or empty"
        ) from None


def decode_endpoints(entries: Sequence[str]) -> EndpointSet | None:
    """The decode endpoints a plan may place on (None: any): at most MAX_DECODE_ENDPOINTS
    entries, each a `host:port` or a bare host (kvshuttle.core.endpoints)."""
    field = "hints.decode_endpoints"
    if not entries:
        return None
    if len(entries) > MAX_DECODE_ENDPOINTS:
        raise InvalidArgument(field, f"more than {MAX_DECODE_ENDPOINTS} entries")
    for i, entry in enumerate(entries):
        if len(entry) > MAX_ENDPOINT_LENGTH:
            raise InvalidArgument(field, f"entry {i} is longer than {MAX_ENDPOINT_LENGTH} characters")
    allowed, bad = EndpointSet.parse(entries)
    if bad:
        raise InvalidArgument(
            field, f"entry {bad[0]} is neither host:port (an IPv6 address as [addr]:port) nor a host"
        )
    return allowed


def think_time(seconds: float | None) -> None:
    if seconds is not None and (not math.isfinite(seconds) or seconds < 0):
        raise InvalidArgument("hints.expected_think_time", "must not be negative")


def timings(t: TurnTimings) -> None:
    for name in _TIMINGS:
        value = getattr(t, name)
        if value is not None and (not math.isfinite(value) or value < 0):
            raise InvalidArgument(f"timings.{name.removesuffix('_ms')}", "must not be negative")
