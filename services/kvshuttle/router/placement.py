"""Where a turn's prefill and decode run.

Prefill: the node where the prompt is expected to finish soonest: its local prefix-cache hits
(the registry's block index, keyed by kvshuttle's chain) shorten the work, queued and running
requests lengthen it. Decode: the least loaded node, counting the KV memory it already holds
for other conversations' retentions. A conversation's previous nodes only break ties: a hint,
never the policy, and ahead of them the prefill node whose agent's pool holds the
conversation's retention (`prefer`), so that its read stays on the machine. Only healthy nodes
serving the model are candidates (a pool node never is); for decode, only those whose HTTP
endpoint the caller allows (`allowed`: PlanHints.decode_endpoints), when it names any.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvshuttle.core.endpoints import EndpointSet
from kvshuttle.core.errors import Unavailable
from kvshuttle.core.nodes import POOL_OF_LABEL, NodeRole
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.router.cost import CostModel
from kvshuttle.router.model import NodeInfo, PlacementWeights

_NO_NODE = {NodeRole.PREFILL: ErrorReason.NO_PREFILL_NODE, NodeRole.DECODE: ErrorReason.NO_DECODE_NODE}


def _serving(nodes: Sequence[NodeInfo], role: NodeRole, model: str) -> list[NodeInfo]:
    return [n for n in nodes if n.healthy and n.model == model and n.role.serves(role)]


def placeable(nodes: Sequence[NodeInfo], model: str, allowed: EndpointSet | None = None) -> bool:
    """Whether `nodes` has a healthy prefill and a healthy (allowed) decode candidate for `model`."""
    return bool(_serving(nodes, NodeRole.PREFILL, model)) and bool(
        _allowed(_serving(nodes, NodeRole.DECODE, model), allowed)
    )


def _allowed(pool: list[NodeInfo], allowed: EndpointSet | None) -> list[NodeInfo]:
    return pool if allowed is None else [n for n in pool if allowed.allows_url(n.http_endpoint)]


def ready_decodes(nodes: Sequence[NodeInfo], model: str, weights: PlacementWeights) -> list[NodeInfo]:
    """The healthy decode nodes of `model`, in choose_decode's order (least loaded first)."""
    return sorted(_serving(nodes, NodeRole.DECODE, model), key=lambda n: (_decode_load(n, weights), n.name))


def candidates(nodes: Sequence[NodeInfo], role: NodeRole, model: str) -> list[NodeInfo]:
    """The healthy nodes serving `model` in `role`; Unavailable (NO_PREFILL_NODE or
    NO_DECODE_NODE) when there is none."""
    pool = _serving(nodes, role, model)
    if not pool:
        raise Unavailable(
            f"no healthy {role} node serves model {model!r}",
            reason=_NO_NODE[role],
            metadata={"model": model},
        )
    return pool


def choose_prefill(
    nodes: Sequence[NodeInfo],
    *,
    model: str,
    prompt_tokens: int,
    local_hit_blocks: Mapping[str, int],
    cost: CostModel,
    weights: PlacementWeights,
    hint: str = "",
    prefer: str = "",
) -> tuple[NodeInfo, int]:
    """The prefill node and its local prefix hits in tokens."""
    pool = candidates(nodes, NodeRole.PREFILL, model)

    def hits(node: NodeInfo) -> int:
        # vLLM hits at most prompt - 1 tokens locally: the last one is always computed.
        return min(local_hit_blocks.get(node.name, 0) * node.block_size, max(prompt_tokens - 1, 0))

    def score(node: NodeInfo) -> tuple[float, bool, bool, str]:
        ms = cost.recompute(prompt_tokens, hits(node)).total_ms
        ms += weights.load_penalty_ms * (node.running_requests + node.waiting_requests)
        return ms, node.name != prefer, node.name != hint, node.name

    best = pool[0] if len(pool) == 1 else min(pool, key=score)  # one candidate: nothing to score
    return best, hits(best)


def _decode_load(node: NodeInfo, weights: PlacementWeights) -> float:
    return (
        node.running_requests
        + node.waiting_requests
        + weights.kv_usage_weight * node.kv_cache_usage
        + weights.retained_gib_weight * node.retained_bytes / 2**30
    )


def choose_decode(
    nodes: Sequence[NodeInfo],
    *,
    model: str,
    weights: PlacementWeights,
    avoid: str = "",
    hint: str = "",
    allowed: EndpointSet | None = None,
) -> NodeInfo:
    """The decode node: the least loaded of the healthy ones `allowed` (None: all) names;
    Unavailable (NO_DECODE_NODE) when there is none."""
    pool = _allowed(candidates(nodes, NodeRole.DECODE, model), allowed)
    if not pool:
        raise Unavailable(
            f"no healthy decode node serves model {model!r} on an endpoint hints.decode_endpoints allows",
            reason=ErrorReason.NO_DECODE_NODE,
            metadata={"model": model, "decode_endpoints": str(len(allowed or ()))},
        )

    def score(node: NodeInfo) -> tuple[bool, float, bool, str]:
        # A kv_both node that already runs this turn's prefill is the last resort for decode.
        return node.name == avoid, _decode_load(node, weights), node.name != hint, node.name

    return pool[0] if len(pool) == 1 else min(pool, key=score)


def pool_owner_of(nodes: Sequence[NodeInfo], holder: str) -> str:
    """The engine node whose agent's pool is `holder` (its pool-of label), or "" when `holder`
    is not a pool node in `nodes`."""
    node = next((x for x in nodes if x.name == holder), None)
    if node is None or node.role is not NodeRole.POOL:
        return ""
    return node.labels.get(POOL_OF_LABEL, "")
