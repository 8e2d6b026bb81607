"""What the registry remembers of request ids (AIP-155): a request repeated with its request_id
gets its first answer; the same request_id with another request body is refused
(INVALID_ARGUMENT, REQUEST_ID_REUSED, field `request_id`).

An entry is a fingerprint of the request and a compact answer (names, times, a claim id), never
a whole retention: a repeated put carries the retention itself, so its first response is rebuilt
from it, a repeated claim answers from the live, claimed record, and a repeated move is rebuilt
from the live record's immutable fields and the repeat itself. The cache is bounded in
entries, in bytes and in age; the oldest entries go first.

Not part of a request's identity: the lease it asks for (PutRetention's ttl and
pin_expire_time, ClaimRetention's claim_ttl, MoveRetention's ttl). A retry may compute those
again (the router's commit derives them from its clock), and the first request's lease stands.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeAlias

from kvshuttle.core.fingerprint import fingerprint
from kvshuttle.registry.model import Move, Retention, Transcript

__all__ = [
    "Answer",
    "ClaimAnswer",
    "IdempotencyCache",
    "Key",
    "MoveAnswer",
    "PutAnswer",
    "claim_fingerprint",
    "move_fingerprint",
    "put_fingerprint",
]

# Bytes one entry costs beyond its strings' characters: the key tuple, the answer object, the
# fingerprint, the floats, the OrderedDict's node, and 49 bytes per string object (measured with
# tracemalloc on CPython 3.11: 910 bytes a put entry, 643 a claim entry, with uuid-based names).
PUT_OVERHEAD = 460
CLAIM_OVERHEAD = 360
MOVE_OVERHEAD = 340
_STR_OVERHEAD = 49

# (operation, target name, request id): an id is scoped by what it acts on, so another
# conversation (or tenant) reusing an id gets its own answer.
Key: TypeAlias = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class PutAnswer:
    """PutRetention's first response, less what the repeated request carries itself."""

    fingerprint: bytes
    name: str
    create_time: float
    expire_at: float
    pin_expire_at: float | None
    replaced: str  # "" when it replaced nothing


@dataclass(frozen=True, slots=True)
class ClaimAnswer:
    """ClaimRetention's first response: the claim it made."""

    fingerprint: bytes
    claim_id: str


@dataclass(frozen=True, slots=True)
class MoveAnswer:
    """MoveRetention's first response, less what the repeated request and the (immutable) rest
    of the retention carry: the lease it set."""

    fingerprint: bytes
    expire_at: float


Answer: TypeAlias = PutAnswer | ClaimAnswer | MoveAnswer


def _size(key: Key, answer: Answer) -> int:
    """An entry's estimated bytes (the strings are ASCII: names and ids are)."""
    strings = [key[1], key[2]]
    if isinstance(answer, PutAnswer):
        strings += [answer.name, answer.replaced]
        base = PUT_OVERHEAD
    elif isinstance(answer, ClaimAnswer):
        strings.append(answer.claim_id)
        base = CLAIM_OVERHEAD
    else:
        base = MOVE_OVERHEAD
    return base + sum(_STR_OVERHEAD + len(x) for x in strings)


def put_fingerprint(retention: Retention) -> bytes:
    """What identifies a put: the retention as given (node, generation, model, block size, tokens,
    chain, params, bytes); not its lease."""
    # Bounded below 2**64 by the facade's checks before the store sees them.
    numbers = struct.pack(
        "<QQQQ", retention.generation, retention.block_size, retention.num_tokens, retention.kv_bytes
    )
    return fingerprint(
        b"kvs.put",
        [
            retention.node,
            retention.model,
            numbers,
            retention.block_hashes.tobytes(),
            retention.kv_transfer_params,
            *_transcript_parts(retention.transcript),
            # As before prompt_blocks: a put without them keeps its fingerprint.
            *([struct.pack("<Q", retention.prompt_blocks)] if retention.prompt_blocks else []),
        ],
    )


def _transcript_parts(transcript: Transcript | None) -> list[bytes]:
    if transcript is None:
        return []  # as before transcripts: a put without one keeps its fingerprint
    return [
        transcript.lookup_key,
        transcript.token_ids.tobytes(),
        transcript.answer_sha256,
        struct.pack("<Q", transcript.answer_chars),
    ]


def claim_fingerprint(holder: str, *, shared: bool = False) -> bytes:
    """What identifies a claim of a retention (the name is in the key): who claims it, and
    whether it shares it."""
    return fingerprint(b"kvs.claim", [holder, b"shared"] if shared else [holder])


def move_fingerprint(move: Move) -> bytes:
    """What identifies a move of a retention (the name is in the key): the claim it ends, the new
    holder, its params and bytes; not the lease."""
    return fingerprint(
        b"kvs.move", [move.claim_id, move.node, move.kv_transfer_params, struct.pack("<Q", move.kv_bytes)]
    )


class IdempotencyCache:
    """First answers by key, bounded in count, bytes and age. Every entry lives `ttl` seconds
    from its write, so insertion order is expiry order: the oldest are at the front."""

    def __init__(self, ttl: float, max_entries: int, max_bytes: int) -> None:
        self._ttl = ttl
        self._max = max_entries
        self._max_bytes = max_bytes
        self._entries: OrderedDict[Key, tuple[float, int, Answer]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """The entries' estimated size in bytes (what `max_bytes` bounds)."""
        return self._bytes

    def get(self, key: Key, now: float) -> Answer | None:
        hit = self._entries.get(key)
        if hit is None:
            return None
        if hit[0] <= now:
            self._drop(key)
            return None
        return hit[2]

    def put(self, key: Key, answer: Answer, now: float) -> None:
        if key in self._entries:
            self._drop(key)
        size = _size(key, answer)
        self._entries[key] = (now + self._ttl, size, answer)
        self._bytes += size
        while self._entries and (len(self._entries) > self._max or self._bytes > self._max_bytes):
            self._pop_oldest()
        self.expire(now)

    def expire(self, now: float) -> None:
        """Forget every entry whose time is up."""
        while self._entries:
            first = next(iter(self._entries.values()))
            if first[0] > now:
                break
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, (_, size, _) = self._entries.popitem(last=False)
        self._bytes -= size

    def _drop(self, key: Key) -> None:
        _, size, _ = self._entries.pop(key)
        self._bytes -= size
