"""The registry's state behind one contract, so an in-memory store and a Redis store are
interchangeable: each enforces the same stateful rules, the ones each method states here.

Each method is one atomic domain operation: it either applies completely or raises a
KvshuttleError and changes nothing. Inputs are already validated by the Registry facade;
the store enforces the rules that depend on state (existence, incarnations, fencing,
single-use claims, capacity). `now` is the registry clock, passed in so every replica and
every test agrees on time. StoreLimits are the bounds every store enforces, the same in both.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Protocol

from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.registry.model import (
    Conversation,
    ExpiryResult,
    Found,
    Move,
    Node,
    PutResult,
    Retention,
    RetentionChange,
    StoreCounts,
)


@dataclass(frozen=True, slots=True)
class StoreLimits:
    # Capacity: live nodes, retentions in all and per tenant (past one: CAPACITY_EXCEEDED).
    max_nodes: int = 10_000
    max_retentions: int = 1_000_000
    max_retentions_per_tenant: int = 100_000
    # How long a conversation's fencing generation outlives its last retention, so a late
    # commit of an older turn is still rejected.
    fence_ttl: float = 3600.0
    # Lingering fences (their conversation holds no retention), by count and estimated bytes.
    max_lingering_fences: int = 1_000_000
    lingering_fence_max_bytes: int = 128 * 2**20
    # Request ids remembered (fingerprint and compact first answer), by age, count and bytes.
    idempotency_ttl: float = 600.0
    idempotency_max_entries: int = 100_000
    idempotency_max_bytes: int = 64 * 2**20
    # Transcripts (exact token ids kept with retentions), by bytes per tenant and in all: a put
    # past either keeps its retention and drops the transcript.
    transcript_max_bytes_per_tenant: int = 256 * 2**20
    transcript_max_bytes: int = 2 * 2**30


# Bytes one lingering fence costs beyond its name's characters: the name's string object, its
# Fence (kvshuttle.registry.store.memory.state), the dict and OrderedDict entries (measured with
# tracemalloc on CPython 3.11: 334 bytes with a 63-character name). Both stores count
# lingering_fence_max_bytes by this estimate.
FENCE_OVERHEAD = 280


class RegistryStore(Protocol):
    async def register_node(
        self, spec: NodeSpec, ttl: float, now: float
    ) -> tuple[Node, list[RetentionChange], bool]:
        """Start a new incarnation of a node's lease. Returns the node, the retentions dropped
        because the engine changed (NODE_LOST), and whether the engine changed."""
        ...

    async def heartbeat_node(
        self, name: str, incarnation: int, ttl: float, load: NodeLoad, now: float
    ) -> Node: ...

    async def deregister_node(
        self, name: str, incarnation: int | None, now: float
    ) -> list[RetentionChange]: ...

    async def get_node(self, name: str) -> Node: ...

    async def list_nodes(
        self, *, role: NodeRole | None, model: str | None, after: str, limit: int
    ) -> list[Node]:
        """Live nodes with name > after, in name order."""
        ...

    async def put_retention(
        self, retention: Retention, ttl: float, now: float, *, request_id: str
    ) -> tuple[PutResult, list[RetentionChange]]:
        """`retention.name` carries the conversation and generation; times are set here."""
        ...

    async def get_retention(self, name: str) -> Retention: ...

    async def get_conversation(self, name: str) -> Conversation: ...

    async def renew_retention(
        self, name: str, ttl: float, max_ttl: float, now: float
    ) -> tuple[Retention, list[RetentionChange]]: ...

    async def claim_retention(
        self, name: str, holder: str, claim_ttl: float, now: float, *, request_id: str, shared: bool = False
    ) -> tuple[Retention, list[RetentionChange]]:
        """Claim the retention for `holder` until now + claim_ttl; the answer's `claim` is this
        claim. Single-use (`shared` false): the retention's expire_at becomes the claim's, and it
        is removed when that lapses. Shared: only on a retention a POOL node holds
        (RETENTION_NOT_SHAREABLE), beside other live shared claims (at most MAX_SHARED_CLAIMS),
        never beside a single-use one (RETENTION_ALREADY_CLAIMED either way); the expire_at
        stays the retention's own lease, and the retention outlives it while the claim lives."""
        ...

    async def release_retention(
        self, name: str, claim_id: str, force: bool, now: float, *, keep: bool = False
    ) -> list[RetentionChange]:
        """Remove the retention (a claimed one: with its claim_id, or force); with `keep`, end
        its claim `claim_id` instead and give it back its pre-claim lease (removed as EXPIRED
        when that has passed). A live shared claim's id (keep or not) ends that claim only: the
        retention stays, unless its own lease has passed and no other shared claim is left
        (EXPIRED). Without force, a shared-claimed retention is removed by nobody else
        (CLAIM_MISMATCH)."""
        ...

    async def move_retention(
        self, move: Move, ttl: float, now: float, *, request_id: str
    ) -> tuple[Retention, list[RetentionChange]]:
        """Hand the claimed retention `move.name` to `move.node`: it must be claimed with exactly
        `move.claim_id` (CLAIM_MISMATCH; RETENTION_EXPIRED when the claim lapsed), the node live
        (NOT_FOUND, NODE_NOT_FOUND), of the retention's model and block size and named by the
        params as registered (NODE_MISMATCH). Sets node, params, holder, kv_bytes; clears the
        claim and the pin; the lease runs `ttl` from now; moves the node counts. One MOVED change
        (with the previous node). A repeat of `request_id` returns the first answer."""
        ...

    async def evict_retention(self, name: str, node: str, now: float) -> list[RetentionChange]:
        """Remove `name` if `node` holds it (NODE_MISMATCH otherwise) and it is not claimed
        (RETENTION_ALREADY_CLAIMED); NOT_FOUND when it is gone. One EVICTED change; the fence
        lingers as on expiry."""
        ...

    async def list_retentions(
        self, *, tenant: str, conversation: str | None, node: str | None, after: str, limit: int
    ) -> list[Retention]:
        """A tenant's (or one conversation's) live retentions with name > after, in name order."""
        ...

    async def find_retention(
        self,
        *,
        tenant: str,
        model: str,
        block_size: int,
        chain: array[int] | None,
        transcript_key: bytes | None,
        now: float,
    ) -> Found:
        """The tenant's live retention (lease not lapsed) of `model` found by what it holds:
        with `chain`, the one whose whole block_hashes (of `block_size`) are the longest prefix
        of it; with `transcript_key`, the latest put whose transcript has that key.
        RETENTION_NOT_FOUND when none. Another tenant's retentions are never candidates."""
        ...

    async def expire_due(self, now: float) -> ExpiryResult:
        """Remove every node, retention and claim whose lease lapsed at or before `now`."""
        ...

    def next_deadline(self) -> float | None:
        """The earliest time expire_due may have work, or None when nothing can expire."""
        ...

    def counts(self) -> StoreCounts: ...
