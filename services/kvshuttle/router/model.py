"""What the router reasons about: its view of nodes and retentions, the requests it serves and
the plans it makes. Its settings are in kvshuttle.router.policy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from kvshuttle.core.hashing import TokenIds
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec

# A prefix-hash chain: uint64s, as a sequence or an array.
Hashes = Sequence[int] | npt.NDArray[np.uint64]


class Decision(StrEnum):
    REUSE = "reuse"
    RECOMPUTE = "recompute"
    # The turn runs on the decode node holding the conversation's KV: no prefill request.
    EXTEND = "extend"


class TurnEnd(StrEnum):
    """How a turn's answer ended (CommitTurn's turn_end): what its conversation does next."""

    UNSPECIFIED = "unspecified"
    TOOL_CALL = "tool_call"  # an agent runs the tool and comes back, usually within seconds
    STOP = "stop"  # the answer is a person's to read
    LENGTH = "length"  # cut at max_tokens


class Reason(StrEnum):
    REUSE_CHEAPER = "reuse_cheaper"
    NO_RETENTION = "no_retention"
    EXPIRED = "expired"
    PREFIX_MISMATCH = "prefix_mismatch"
    BELOW_THRESHOLD = "below_threshold"
    COST = "cost"
    NODE_DOWN = "node_down"
    CLAIM_LOST = "claim_lost"
    MODEL_MISMATCH = "model_mismatch"
    DISABLED = "disabled"
    FORK_UNSAFE = "fork_unsafe"
    NO_CONVERSATION = "no_conversation"
    # The registry did not answer: plain P->D on the last node list it gave, nothing claimed.
    REGISTRY_UNAVAILABLE = "registry_unavailable"
    EXTEND_CHEAPER = "extend_cheaper"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    role: NodeRole
    engine_id: str
    http_endpoint: str
    model: str
    block_size: int
    kv_bytes_per_token: int
    healthy: bool
    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0
    retained_bytes: int = 0
    # Blocks of its prefix cache in the registry's index (0: nothing to look up there).
    indexed_blocks: int = 0
    # Its engine's NIXL side channel as registered: where a prefill reads KV this node retains
    # (the plan names these, never what a retention's stored params say). "" / 0: not known,
    # and then no plan reads from the node.
    side_channel_host: str = ""
    side_channel_port: int = 0
    # The node's agent's gRPC endpoint ("host:port"; "" without an agent), and its labels (a
    # pool node's kvshuttle.io/pool-of names the engine node whose agent holds the pool).
    agent_endpoint: str = ""
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)

    @classmethod
    def of(
        cls, spec: NodeSpec, load: NodeLoad, *, retained_bytes: int = 0, indexed_blocks: int = 0
    ) -> NodeInfo:
        """The router's view of a registered node: its spec, its load and the registry's sums."""
        return cls(
            name=spec.name,
            role=spec.role,
            engine_id=spec.engine_id,
            http_endpoint=spec.http_endpoint,
            model=spec.model,
            block_size=spec.block_size,
            kv_bytes_per_token=spec.kv_bytes_per_token,
            healthy=load.engine_healthy,
            running_requests=load.running_requests,
            waiting_requests=load.waiting_requests,
            kv_cache_usage=load.kv_cache_usage,
            retained_bytes=retained_bytes,
            indexed_blocks=indexed_blocks,
            side_channel_host=spec.side_channel_host,
            side_channel_port=spec.side_channel_port,
            agent_endpoint=spec.agent_endpoint,
            labels=dict(spec.labels),
        )


@dataclass(frozen=True, slots=True)
class RetentionInfo:
    name: str
    node: str
    generation: int
    model: str
    block_size: int
    num_tokens: int
    # kvshuttle's chain over the retained tokens (uint64s; a tuple or an array).
    block_hashes: Hashes
    # vLLM's kv_transfer_params dict as decode returned it.
    kv_transfer_params: dict[str, object]
    expire_at: float
    claimed: bool  # by one reader, or by shared readers (shared_claims)
    # The retained tokens from block known_from_block to num_tokens, as this replica's commit
    # stored them (the turn's answer blocks): known only on its hint, none from the registry.
    # They let a plan cut a prefix that departs inside one of those blocks at its last equal token.
    known_from_block: int = 0
    known_tokens: npt.NDArray[np.uint32] = field(default_factory=lambda: np.zeros(0, dtype=np.uint32))
    # Live shared claims (forks of the history reading it from a pool at once).
    shared_claims: int = 0
    # Who holds its single-use claim ("" when none): a turn's plan, or a router's shuttle moving it.
    claim_holder: str = ""

    @property
    def claimed_once(self) -> bool:
        """Claimed by one reader: nobody else reads it, shared or not."""
        return self.claimed and not self.shared_claims


@dataclass(frozen=True, slots=True)
class TranscriptSpec:
    """Which of a committed sequence's ids make its transcript (its first `num_tokens`), and how
    it is found again (the registry's Transcript: `lookup_key`, the answer's digest and length)."""

    lookup_key: bytes
    num_tokens: int
    answer_sha256: bytes
    answer_chars: int


@dataclass(frozen=True, slots=True)
class TranscriptInfo:
    """The exact token ids of a retained sequence and what a reader checks before using them."""

    lookup_key: bytes
    token_ids: npt.NDArray[np.uint32]
    answer_sha256: bytes
    answer_chars: int


@dataclass(frozen=True, slots=True)
class FoundTranscript:
    # `tenants/{t}/conversations/{c}` whose retention holds it.
    conversation: str
    transcript: TranscriptInfo


@dataclass(frozen=True, slots=True)
class NewRetention:
    """Decode's retained KV as a commit stores it (RegistryPort.put_retention)."""

    # Repeated with the same id, the put returns the first answer (a retried commit).
    request_id: str
    conversation: str
    node: str
    generation: int
    model: str
    block_size: int
    num_tokens: int
    block_hashes: Hashes
    kv_transfer_params: dict[str, object]
    kv_bytes: int
    ttl: float
    # Where the blocks live in vLLM, the engine's own pin: a renewal never goes past it.
    pin_expire_at: float
    transcript: TranscriptInfo | None = None
    # Leading blocks of the turn's prompt before its last token (0: unknown): the registry finds
    # the retention by them too (a next prompt that repeats the prompt but not the answer).
    prompt_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Pooled:
    """What an agent answers when it moved a retention into its pool: the pool node that now
    holds it and the params prefill reads it with there (kvshuttle's KvTransferParams as
    vLLM's dict)."""

    node: str
    kv_transfer_params: dict[str, object]


@dataclass(frozen=True, slots=True)
class ClaimInfo:
    retention: RetentionInfo
    claim_id: str
    expire_at: float


@dataclass(frozen=True, slots=True)
class Estimate:
    transfer_ms: float
    prefill_ms: float
    # Extend only: the holder's running decodes' delay while it prefills, weighted.
    interference_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.transfer_ms + self.prefill_ms + self.interference_ms


@dataclass(frozen=True, slots=True)
class PlanRequest:
    model: str
    prompt_token_ids: TokenIds
    conversation: str = ""
    request_id: str = ""
    parent_conversation: str = ""
    expected_think_time_s: float | None = None
    disable_reuse: bool = False
    # SHA-256 of the vLLM cache_salt the caller sends the engines (b"": none): the prompt's
    # chain starts from its salted root (kvshuttle.core.hashing.salted_root).
    cache_salt_sha256: bytes = b""
    # Seconds the caller still waited for the plan when its call arrived (its RPC deadline;
    # None: none). A plan that is ready only after that claims nothing (Planner._claim).
    deadline_s: float | None = None
    # The decode engines the plan may place decode on (hints.decode_endpoints: `host:port`s or
    # bare hosts, as the caller spelled them; checked by checks.decode_endpoints); empty: any.
    decode_endpoints: Sequence[str] = ()
    # `tenants/{tenant}` of a request without a conversation: the router finds the conversation
    # by the prompt's chain, or starts one (Plan.conversation names it).
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    turn: str
    generation: int
    prefill: NodeInfo
    decode: NodeInfo
    prefill_kv_transfer_params: dict[str, object]
    decision: Decision
    reason: Reason
    reusable_tokens: int
    tokens_to_compute: int
    reuse_cost: Estimate | None
    recompute_cost: Estimate
    expire_at: float
    # The retention this turn claimed (and must release or consume), if any.
    claimed: str = ""
    # Running the turn on the retention's decode holder, where one could.
    extend_cost: Estimate | None = None
    # The conversation the turn belongs to ("" for a request of neither conversation nor tenant).
    conversation: str = ""


@dataclass(frozen=True, slots=True)
class TurnTimings:
    ttft_ms: float | None = None
    prefill_ms: float | None = None
    transfer_ms: float | None = None
    transfer_bytes: int | None = None
    decode_ms: float | None = None
    remote_cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class CommitRequest:
    turn: str
    token_ids: TokenIds
    decode_kv_transfer_params: dict[str, Any] | None
    timings: TurnTimings = field(default_factory=TurnTimings)
    request_id: str = ""
    # Instead of token_ids: the output alone, after the prompt this replica holds for the turn.
    output_token_ids: TokenIds | None = None
    turn_end: TurnEnd = TurnEnd.UNSPECIFIED
    transcript: TranscriptSpec | None = None


@dataclass(frozen=True, slots=True)
class CommitResult:
    # "" when nothing was retained (no conversation, decode kept nothing, its node is gone, the
    # registry unreachable: the turn is committed all the same, and the next turn recomputes).
    retention: str
    expire_at: float | None
    # Why nothing was retained when the reason is an outage ("registry_unavailable"), not the
    # turn itself: the commits metric tells the two apart.
    not_stored: str = ""
