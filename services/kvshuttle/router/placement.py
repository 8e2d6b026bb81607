"""Where a turn's prefill and decode run.

Prefill: the node where the prompt is expected to finish soonest: its local prefix-cache hits
(the registry's block index, keyed by kvshuttle's chain) shorten the work, queued and running
requests lengthen it. Decode: the least loaded node, counting the KV memory it already holds
for other conversations' retentions. A conversation's previous nodes only break ties: a hint,
never the policy. Only healthy nodes serving the model are candidates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvshuttle.core.errors import Unavailable
from kvshuttle.router.cost import CostModel
from kvshuttle.router.model import NodeInfo, Role


@dataclass(frozen=True, slots=True)
class PlacementWeights:
    # Expected wait per request already running or queued on a node.
    load_penalty_ms: float = 50.0
    # Decode: one running/queued request weighs as much as this fraction of KV cache in use...
    kv_usage_weight: float = 4.0
    # ...and as much as this many GiB of KV held in retentions.
    retained_gib_weight: float = 1.0


def candidates(nodes: Sequence[NodeInfo], role: Role, model: str) -> list[NodeInfo]:
    return [n for n in nodes if n.healthy and n.model == model and n.role.serves(role)]


def choose_prefill(
    nodes: Sequence[NodeInfo],
    *,
    model: str,
    prompt_tokens: int,
    local_hit_blocks: Mapping[str, int],
    cost: CostModel,
    weights: PlacementWeights,
    hint: str = "",
) -> tuple[NodeInfo, int]:
    """The prefill node and its local prefix hits in tokens."""
    pool = candidates(nodes, Role.PREFILL, model)
    if not pool:
        raise Unavailable(
            f"no healthy prefill node serves model {model!r}",
            reason="NO_PREFILL_NODE",
            metadata={"model": model},
        )

    def hits(node: NodeInfo) -> int:
        # vLLM hits at most prompt - 1 tokens locally: the last one is always computed.
        return min(local_hit_blocks.get(node.name, 0) * node.block_size, max(prompt_tokens - 1, 0))

    def score(node: NodeInfo) -> tuple[float, bool, str]:
        ms = cost.recompute(prompt_tokens, hits(node)).total_ms
        ms += weights.load_penalty_ms * (node.running_requests + node.waiting_requests)
        return ms, node.name != hint, node.name

    best = min(pool, key=score)
    return best, hits(best)


def choose_decode(
    nodes: Sequence[NodeInfo], *, model: str, weights: PlacementWeights, avoid: str = "", hint: str = ""
) -> NodeInfo:
    pool = candidates(nodes, Role.DECODE, model)
    if not pool:
        raise Unavailable(
            f"no healthy decode node serves model {model!r}",
            reason="NO_DECODE_NODE",
            metadata={"model": model},
        )

    def score(node: NodeInfo) -> tuple[bool, float, bool, str]:
        load = (
            node.running_requests
            + node.waiting_requests
            + weights.kv_usage_weight * node.kv_cache_usage
            + weights.retained_gib_weight * node.retained_bytes / 2**30
        )
        # A kv_both node that already runs this turn's prefill is the last resort for decode.
        return node.name == avoid, load, node.name != hint, node.name

    return min(pool, key=score)
