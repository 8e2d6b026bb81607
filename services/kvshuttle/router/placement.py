"""Where a turn's prefill and decode run.

Prefill: the node where the prompt is expected to finish soonest: its local prefix-cache hits
(the registry's block index, keyed by kvshuttle's chain) shorten the work, and the prefill
already queued there lengthens it, in milliseconds: this replica's own placements the node has
not reported yet, or its reported requests at a typical prefill's cost, whichever is more
(kvshuttle.router.ledger). Decode: the least loaded node by its requests (reported, and this
replica's own turns placed there that a report may not show yet), the pressure on its KV cache
(kv_pressure: a node about to run out of blocks weighs as a long queue) and the KV it holds for
other conversations' retentions.

A long prefill (`long_prefill_ms` or more on every node) stays off the short lane: the
`short_lane_fraction` of the prefill nodes with the least work queued. vLLM schedules a running
prefill's chunks before a later request's, so a turn that computes a few hundred new tokens behind a
first turn of 100k waits for all of it; keeping some nodes free of long work bounds what a short
turn waits (size-interval assignment). Long turns queue longer for it.

Nodes within `near_tie_ms` (or `near_tie_fraction`) of the best are near-ties: the prefill node
whose agent's pool holds the conversation's retention (`prefer`, so that its read stays on the
machine), then the conversation's previous node (a hint, never the policy) win among them, else
one is drawn at random, so that replicas planning at once on the same stale loads do not all
pick the same node (and a burst of first turns does not pile onto the first name). Only healthy
nodes serving the model are candidates (a pool node never is); for decode, only those whose HTTP
endpoint the caller allows (`allowed`: PlanHints.decode_endpoints), when it names any.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence

from kvshuttle.core.endpoints import EndpointSet
from kvshuttle.core.errors import Unavailable
from kvshuttle.core.nodes import POOL_OF_LABEL, NodeRole
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.router.cost import CostModel
from kvshuttle.router.ledger import PlacementLedger
from kvshuttle.router.model import NodeInfo
from kvshuttle.router.policy import PlacementWeights

# Past this a cache counts as full (kv_pressure's ceiling: 99).
_FULL = 0.99
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


def ready_decodes(
    nodes: Sequence[NodeInfo], model: str, weights: PlacementWeights, ledger: PlacementLedger
) -> list[NodeInfo]:
    """The healthy decode nodes of `model`, least loaded first (choose_decode's measure)."""
    pool = _serving(nodes, NodeRole.DECODE, model)
    return sorted(pool, key=lambda n: (_decode_load(n, weights, ledger), n.name))


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


def _near_best(
    pool: Sequence[NodeInfo],
    score: Callable[[NodeInfo], float],
    rng: random.Random,
    *firsts: str,
    margin: float,
    fraction: float = 0.0,
) -> NodeInfo:
    """The node of least score, or among those within `margin` (or `fraction` of the best
    score, whichever is more) of it the first of `firsts` there ("" skipped), else one at
    random; with no margin at all, exact ties go to the first by name (no draw)."""
    scores = [(score(n), n) for n in pool]
    best = min(s for s, _ in scores)
    near = [n for s, n in scores if s <= best + max(margin, fraction * best)]
    for name in firsts:
        chosen = next((n for n in near if name and n.name == name), None)
        if chosen is not None:
            return chosen
    if len(near) == 1 or (margin <= 0 and fraction <= 0):
        return min(near, key=lambda n: n.name)
    return rng.choice(near)


def choose_prefill(
    nodes: Sequence[NodeInfo],
    *,
    model: str,
    prompt_tokens: int,
    local_hit_blocks: Mapping[str, int],
    cost: CostModel,
    weights: PlacementWeights,
    ledger: PlacementLedger,
    rng: random.Random,
    hint: str = "",
    prefer: str = "",
) -> tuple[NodeInfo, int]:
    """The prefill node and its local prefix hits in tokens."""
    pool = candidates(nodes, NodeRole.PREFILL, model)

    def hits(node: NodeInfo) -> int:
        # vLLM hits at most prompt - 1 tokens locally: the last one is always computed.
        return min(local_hit_blocks.get(node.name, 0) * node.block_size, max(prompt_tokens - 1, 0))

    if len(pool) == 1:
        return pool[0], hits(pool[0])
    own = {n.name: cost.recompute(prompt_tokens, hits(n), node=n.name).total_ms for n in pool}
    queued = {
        n.name: ledger.queued_ms(n.name, n.running_requests + n.waiting_requests, unknown_ms=own[n.name])
        for n in pool
    }
    lane = min(int(len(pool) * weights.short_lane_fraction), len(pool) - 1)
    if lane > 0 and min(own.values()) >= weights.long_prefill_ms:
        # The lane: the `lane` nodes with the least queued, those of them short turns use.
        by_queued = sorted(pool, key=lambda n: (queued[n.name], n.name))
        window_s = weights.short_lane_window_s
        kept = {n.name for n in by_queued[:lane] if ledger.took_short_within(n.name, window_s)}
        pool = [n for n in by_queued if n.name not in kept]
    best = _near_best(
        pool,
        lambda n: own[n.name] + queued[n.name],
        rng,
        prefer,
        hint,
        margin=weights.near_tie_ms,
        fraction=weights.near_tie_fraction,
    )
    return best, hits(best)


def _decode_load(
    node: NodeInfo, weights: PlacementWeights, ledger: PlacementLedger, holder: str = "", held_bytes: int = 0
) -> float:
    requests = node.running_requests + node.waiting_requests + ledger.unreported(node.name)
    retained = node.retained_bytes - (held_bytes if node.name == holder else 0)
    return (
        requests
        + weights.kv_usage_weight * kv_pressure(node.kv_cache_usage)
        + weights.retained_gib_weight * max(retained, 0) / 2**30
    )


def kv_pressure(usage: float) -> float:
    """A decode node's KV cache in use (0-1) as queueing weighs it: usage / (1 - usage), near
    `usage` itself while the cache has room (0.1: 0.11), 1 at half, 9 at 90 %, 99 full. A node
    out of free blocks queues every answer it admits until one ends; counted linearly, a full
    cache weighed no more than a few requests and a fleet balanced by request counts filled
    some decodes while others idled (the agent loop at 8 sessions/s: one decode engine had 2.8x
    another's slow turns)."""
    u = min(max(usage, 0.0), _FULL)
    return u / (1.0 - u)


def choose_decode(
    nodes: Sequence[NodeInfo],
    *,
    model: str,
    weights: PlacementWeights,
    ledger: PlacementLedger,
    rng: random.Random,
    avoid: str = "",
    hint: str = "",
    allowed: EndpointSet | None = None,
    holder: str = "",
    held_bytes: int = 0,
) -> NodeInfo:
    """The decode node: the least loaded of the healthy ones `allowed` (None: all) names;
    Unavailable (NO_DECODE_NODE) when there is none. `holder`, a decode node holding the
    conversation's retention of `held_bytes`, comes first among near-ties, and that retention
    does not count against it: its prefix cache holds the history, so prefill hands it only the
    new tokens' KV, and the retention is this turn's own, reused or superseded."""
    pool = _allowed(candidates(nodes, NodeRole.DECODE, model), allowed)
    if not pool:
        raise Unavailable(
            f"no healthy decode node serves model {model!r} on an endpoint hints.decode_endpoints allows",
            reason=ErrorReason.NO_DECODE_NODE,
            metadata={"model": model, "decode_endpoints": str(len(allowed or ()))},
        )
    if len(pool) == 1:
        return pool[0]
    # A kv_both node that already runs this turn's prefill is the last resort for decode.
    others = [n for n in pool if n.name != avoid] or pool
    load = functools.partial(
        _decode_load, weights=weights, ledger=ledger, holder=holder, held_bytes=held_bytes
    )
    return _near_best(others, load, rng, holder, hint, margin=weights.near_tie_requests)


def pool_owner_of(nodes: Sequence[NodeInfo], holder: str) -> str:
    """The engine node whose agent's pool is `holder` (its pool-of label), or "" when `holder`
    is not a pool node in `nodes`."""
    node = next((x for x in nodes if x.name == holder), None)
    if node is None or node.role is not NodeRole.POOL:
        return ""
    return node.labels.get(POOL_OF_LABEL, "")
