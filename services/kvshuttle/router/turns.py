"""Turn handles: everything CommitTurn and AbortTurn need, carried by the caller, signed.

The router keeps no turn state that another replica would need: a handle names the
conversation, generation, nodes, the claim it holds, a digest of the planned prompt and the root
its chain started from (the cache salt's), and is signed with a key the replicas share
(HMAC-SHA256), so any replica can commit or abort it and nobody can forge one to write another
conversation's retention. A handle that does not verify is NOT_FOUND: the router never issued it.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import operator
from collections import OrderedDict
from dataclasses import dataclass, fields

import orjson

from kvshuttle.core.errors import InvalidArgument, NotFound
from kvshuttle.core.reasons import ErrorReason

PREFIX = "turns/"
MAX_HANDLE_LENGTH = 4096
_SIG_BYTES = 16


@dataclass(frozen=True, slots=True)
class TurnState:
    turn_id: str
    conversation: str  # "" for a request without a conversation
    generation: int
    model: str
    block_size: int
    prefill_node: str
    decode_node: str
    decode_engine_id: str
    prompt_tokens: int
    # Chain hash of the prompt's last full block (0 when it has none): CommitTurn's tokens
    # must extend exactly this prompt.
    prompt_tail_hash: int
    prompt_full_blocks: int
    reusable_tokens: int
    local_hit_tokens: int
    decision: str
    reason: str
    claimed: str
    claim_id: str
    issued_at: float
    expire_at: float
    trace_id: str
    span_id: str
    # The root of the prompt's chain (its cache salt's): CommitTurn chains the retention from it.
    # Defaulted, so handles issued before it existed still decode (they were all unsalted).
    chain_root: int = 0
    # The decode node's NIXL side channel as registered when planned: CommitTurn holds decode's
    # params to it and to decode_engine_id. Defaulted ("": only the engine id is checked), so
    # handles issued before it existed still decode.
    decode_side_channel_host: str = ""
    decode_side_channel_port: int = 0
    # The plan's expected_think_time_s hint (None: not sent): the commit's prefetch decision.
    expected_think_time_s: float | None = None
    # The plan's sampling decision: a commit sent without trace context joins the plan's trace
    # only as sampled as the plan was. Defaulted (sampled) for handles issued before it existed.
    trace_sampled: bool = True
    # `claimed` is a history the router found for this fork and started itself (an anon-
    # conversation), read shared: once this fork's commit stored its own, the commit removes it
    # unless other forks still read it (their histories continue it).
    superseded_parent: bool = False


_FIELDS = tuple(f.name for f in fields(TurnState))
_VALUES = operator.attrgetter(*_FIELDS)


class TurnCodec:
    def __init__(self, key: bytes, *, remembered: int = 4096) -> None:
        """`remembered`: handles this codec issued whose state it keeps (the newest), so that a
        commit or abort of a turn planned here skips the signature check and the JSON (the very
        string it signed needs neither); any other handle is verified in full."""
        if len(key) < 16:
            raise ValueError("the turn signing key needs at least 16 bytes")
        self._key = key
        self._remembered = remembered
        self._issued: OrderedDict[str, TurnState] = OrderedDict()

    def _sign(self, payload: bytes) -> bytes:
        return hmac.digest(self._key, payload, "sha256")[:_SIG_BYTES]  # one-shot: no HMAC object

    def encode(self, state: TurnState) -> str:
        # orjson: compact JSON, which any replica's json.loads reads (the signature covers the
        # bytes as written, whatever their formatting); about half the stdlib encoder's time.
        payload = orjson.dumps(dict(zip(_FIELDS, _VALUES(state), strict=True)))
        body = base64.urlsafe_b64encode(payload).rstrip(b"=")
        sig = base64.urlsafe_b64encode(self._sign(payload)).rstrip(b"=")
        handle = f"{PREFIX}{body.decode()}.{sig.decode()}"
        # A handle too long for decode() is not remembered: it is refused as before.
        if self._remembered and len(handle) <= MAX_HANDLE_LENGTH:
            self._issued[handle] = state
            if len(self._issued) > self._remembered:
                self._issued.popitem(last=False)
        return handle

    def decode(self, handle: str, field: str = "turn") -> TurnState:
        issued = self._issued.get(handle)
        if issued is not None:
            return issued
        if not handle:
            raise InvalidArgument(field, "required")
        if len(handle) > MAX_HANDLE_LENGTH or not handle.startswith(PREFIX) or "." not in handle:
            raise InvalidArgument(field, "must be a turn handle returned by PlanTurn")
        body, _, sig = handle[len(PREFIX) :].partition(".")
        try:
            payload = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            signature = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
        except (binascii.Error, ValueError) as exc:
            raise InvalidArgument(field, "must be a turn handle returned by PlanTurn") from exc
        if not hmac.compare_digest(signature, self._sign(payload)):
            raise NotFound(
                "unknown turn (not issued by this router deployment)", reason=ErrorReason.TURN_NOT_FOUND
            )
        try:
            return TurnState(**orjson.loads(payload))
        except (
            TypeError,
            ValueError,
        ) as exc:  # orjson.JSONDecodeError is a ValueError  # a signed handle of another router version
            raise NotFound("unknown turn format", reason=ErrorReason.TURN_NOT_FOUND) from exc
