"""What the router reasons about: its view of nodes and retentions, and the plans it makes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt

# A prefix-hash chain: uint64s, as a sequence or an array.
Hashes = Sequence[int] | npt.NDArray[np.uint64]


class Decision(StrEnum):
    REUSE = "reuse"
    RECOMPUTE = "recompute"


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


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def serves(self, wanted: Role) -> bool:
        return self is wanted or self is Role.BOTH


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    role: Role
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
    claimed: bool


@dataclass(frozen=True, slots=True)
class ClaimInfo:
    retention: RetentionInfo
    claim_id: str
    expire_at: float


@dataclass(frozen=True, slots=True)
class Estimate:
    transfer_ms: float
    prefill_ms: float

    @property
    def total_ms(self) -> float:
        return self.transfer_ms + self.prefill_ms


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
    extra: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TurnTimings:
    ttft_ms: float | None = None
    prefill_ms: float | None = None
    transfer_ms: float | None = None
    transfer_bytes: int | None = None
    decode_ms: float | None = None
    remote_cached_tokens: int | None = None
