"""The registry's domain records: node leases, retentions, claims and the changes they go through.

Times are seconds on the registry's clock. Records returned by the store are snapshots:
callers may keep them; the store never mutates a record it handed out.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from enum import StrEnum

from kvshuttle.core.nodes import NodeLoad, NodeSpec


@dataclass(slots=True)
class Node:
    spec: NodeSpec
    incarnation: int
    register_time: float
    expire_at: float
    load: NodeLoad
    retained_bytes: int = 0
    retention_count: int = 0

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(slots=True)
class Claim:
    claim_id: str
    holder: str
    claim_time: float
    expire_at: float
    # The retention's own lease when it was claimed: what it gets back if the claim is given
    # back unread.
    lease_expire_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Holder:
    """The engine a retention's kv_transfer_params send readers to: `remote_engine_id`,
    `remote_host` and `remote_port` (its NIXL side channel). A put is refused (NODE_MISMATCH)
    unless they are the node's as registered (NodeSpec engine_id, side_channel_host,
    side_channel_port): KV is read only from nodes the registry knows."""

    engine_id: str
    side_channel_host: str
    side_channel_port: int

    @classmethod
    def of(cls, spec: NodeSpec) -> Holder:
        return cls(spec.engine_id, spec.side_channel_host, spec.side_channel_port)

    @staticmethod
    def mismatch(
        holder: Holder | None, spec: NodeSpec, params_field: str = "retention.kv_transfer_params"
    ) -> str | None:
        """The first kv_transfer_params field (under `params_field`) by which `holder` does not
        name the node `spec` as registered, or None when it does."""
        registered = Holder.of(spec)
        if holder is None or holder.engine_id != registered.engine_id:
            return f"{params_field}.remote_engine_id"
        if holder.side_channel_host != registered.side_channel_host:
            return f"{params_field}.remote_host"
        if holder.side_channel_port != registered.side_channel_port:
            return f"{params_field}.remote_port"
        return None


@dataclass(frozen=True, slots=True)
class Transcript:
    """The exact token ids of a retained sequence (prompt and answer), found by `lookup_key`
    within the retention's tenant and model (RegistryStore.find_retention); `answer_sha256` and
    `answer_chars` let a reader check its request's text holds the answer after the key's text.
    `token_ids` is an array of uint32 (treat as immutable)."""

    lookup_key: bytes
    token_ids: array[int]
    answer_sha256: bytes
    answer_chars: int

    @property
    def nbytes(self) -> int:
        """What a tenant's transcript bytes count for it: the ids and the fixed fields."""
        return 4 * len(self.token_ids) + len(self.lookup_key) + TRANSCRIPT_OVERHEAD


# Bytes a transcript costs beyond its ids and key: the array's header, the record, the answer's
# digest and the index entry (measured with tracemalloc on CPython 3.11, the in-memory store: 367
# bytes beyond 4 a token with a 32-byte key).
TRANSCRIPT_OVERHEAD = 336


class RetentionState(StrEnum):
    ACTIVE = "active"
    CLAIMED = "claimed"


@dataclass(slots=True)
class Retention:
    """KV one node keeps for a conversation's next turn.

    `block_hashes` is kvshuttle's prefix-hash chain (array of uint64, treat as immutable);
    `kv_transfer_params` is the serialized kvshuttle.vllm.v1.KvTransferParams the reader hands
    to its prefill engine, kept opaque here so the registry neither parses nor rewrites it;
    `holder` is who those params name, read from them by the servicer (None: they name none).
    """

    name: str  # tenants/{t}/conversations/{c}/retentions/{generation}
    node: str  # nodes/{node}
    generation: int
    model: str
    block_size: int
    num_tokens: int
    block_hashes: array[int]
    kv_transfer_params: bytes
    kv_bytes: int
    pin_expire_at: float | None
    create_time: float = 0.0
    expire_at: float = 0.0
    claim: Claim | None = None
    holder: Holder | None = None
    transcript: Transcript | None = None
    # Leading block_hashes of the turn's prompt before its last token (0: none told): what
    # find_retention finds the retention by besides its whole chain.
    prompt_blocks: int = 0
    # Shared claims (the forks of one history reading a pool-held retention at once); while any
    # is live the retention is neither removed at its expire_at nor evicted. Lapsed ones are
    # dropped by the store as it meets them (live_shared).
    shared: tuple[Claim, ...] = ()

    def live_shared(self, now: float) -> tuple[Claim, ...]:
        """The shared claims still live at `now`."""
        return tuple(c for c in self.shared if c.expire_at > now)

    def lookup_blocks(self) -> tuple[int, ...]:
        """How many leading hashes of its chain find_retention finds it by: the whole chain's,
        and its prompt's when that is shorter (distinct, longest first)."""
        n = len(self.block_hashes)
        if not n:
            return ()
        return (n, self.prompt_blocks) if 0 < self.prompt_blocks < n else (n,)

    @property
    def conversation(self) -> str:
        return self.name.rsplit("/", 2)[0]

    @property
    def tenant(self) -> str:
        return self.name.split("/", 2)[1]

    @property
    def state(self) -> RetentionState:
        return RetentionState.CLAIMED if self.claim is not None or self.shared else RetentionState.ACTIVE


class ChangeKind(StrEnum):
    PUT = "put"
    RENEWED = "renewed"
    CLAIMED = "claimed"
    RELEASED = "released"
    EXPIRED = "expired"
    REPLACED = "replaced"
    NODE_LOST = "node_lost"
    MOVED = "moved"  # handed to another node (MoveRetention): `previous_node` held it
    EVICTED = "evicted"
    UNCLAIMED = "unclaimed"  # removed by its holder to make room (EvictRetention)


@dataclass(frozen=True, slots=True)
class RetentionChange:
    kind: ChangeKind
    retention: Retention
    at: float
    # MOVED: the node that held the retention before; "" otherwise.
    previous_node: str = ""
    # Its position in the change feed (kvshuttle.registry.feeds.change), set when the feed delivers it
    # to watchers; "" before. A watcher resumes after it (WatchRetentions resume_token).
    token: str = ""


@dataclass(slots=True)
class Move:
    """A claimed retention handed to another holder (MoveRetention): the node that holds the
    blocks from now on, and the params (opaque, as in Retention) that send readers there."""

    name: str  # tenants/{t}/conversations/{c}/retentions/{generation}
    claim_id: str
    node: str  # nodes/{node}
    kv_transfer_params: bytes
    kv_bytes: int
    holder: Holder | None = None

    def apply_to(self, retention: Retention, expire_at: float) -> None:
        """`retention` as this move leaves it: held by the new node under its params, unclaimed,
        with no engine pin, lapsing at `expire_at`."""
        retention.node = self.node
        retention.kv_transfer_params = self.kv_transfer_params
        retention.holder = self.holder
        retention.kv_bytes = self.kv_bytes
        retention.claim = None
        retention.pin_expire_at = None
        retention.expire_at = expire_at


@dataclass(frozen=True, slots=True)
class Conversation:
    name: str
    fence_generation: int
    retention: Retention | None


@dataclass(frozen=True, slots=True)
class PutResult:
    retention: Retention
    # The name of the retention this one replaced; "" when none.
    replaced: str


@dataclass(frozen=True, slots=True)
class NodeExpiry:
    """A node whose lease lapsed, and the retentions that went with it."""

    node: Node
    changes: tuple[RetentionChange, ...]


@dataclass(frozen=True, slots=True)
class ExpiryResult:
    nodes: tuple[NodeExpiry, ...]
    retentions: tuple[RetentionChange, ...]

    def changes(self) -> list[RetentionChange]:
        out = [c for n in self.nodes for c in n.changes]
        out.extend(self.retentions)
        return out


@dataclass(frozen=True, slots=True)
class Found:
    """What RegistryStore.find_retention found: the retention and, when found by a chain, how
    many of the chain's hashes it covers."""

    retention: Retention
    matched_blocks: int = 0


@dataclass(frozen=True, slots=True)
class StoreCounts:
    nodes: int
    retentions: int
    claimed: int
    fenced_conversations: int
    # Fences of conversations without a retention, their estimated bytes, and how many were
    # forgotten before fence_ttl because the lingering bounds were reached.
    lingering_fences: int = 0
    lingering_fence_bytes: int = 0
    fences_forgotten_early: int = 0
    # Request ids remembered for idempotency, and their estimated bytes.
    remembered_requests: int = 0
    remembered_request_bytes: int = 0
    # Transcripts kept with retentions, and their bytes (Transcript.nbytes).
    transcripts: int = 0
    transcript_bytes: int = 0
