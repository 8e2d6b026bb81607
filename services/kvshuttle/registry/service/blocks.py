"""The Registry's block index operations (kvshuttle.registry.service.registry): an agent's event reports,
bounded and accepted only from the node's current incarnation, handed to the index feed; and
lookups of which live nodes hold given blocks, answered from this process's block index."""

from __future__ import annotations

from collections.abc import Sequence

from kvshuttle.core.errors import FailedPrecondition, InvalidArgument
from kvshuttle.core.kv_events import ApplyResult, BlockStored, EventBatch
from kvshuttle.core.limits import MAX_EVENT_SEQ
from kvshuttle.core.nodes import NodeRole
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.service.shared import RegistryShared


class RegistryBlocks:
    """Block events in, block lookups out."""

    def __init__(self, shared: RegistryShared) -> None:
        self._shared = shared
        self._store = shared.store
        self._index_feed = shared.index_feed
        self._index = shared.index
        self._limits = shared.limits
        self._check = shared.checks
        self._stats = shared.stats

    def indexed_blocks(self, node: str) -> int:
        return self._index.node_block_count(node)

    async def report_block_events(
        self, node: str, incarnation: int, batches: Sequence[EventBatch]
    ) -> ApplyResult:
        self._check.node_name(node, "node")
        if incarnation <= 0:
            raise InvalidArgument("incarnation", "required")
        if len(batches) > self._limits.max_event_batches:
            raise InvalidArgument("batches", f"at most {self._limits.max_event_batches} batches")
        for i, batch in enumerate(batches):
            # Below 2**63: the answer's next_seq is seq + 1, in a uint64.
            if not 0 <= batch.seq <= MAX_EVENT_SEQ:
                raise InvalidArgument(f"batches[{i}].seq", f"must be 0..{MAX_EVENT_SEQ}")
            if len(batch.events) > self._limits.max_events_per_batch:
                raise InvalidArgument(
                    f"batches[{i}].events", f"at most {self._limits.max_events_per_batch} events"
                )
            for j, event in enumerate(batch.events):
                blocks = getattr(event, "block_hashes", ())
                if len(blocks) > self._limits.max_event_blocks:
                    raise InvalidArgument(
                        f"batches[{i}].events[{j}].block_hashes",
                        f"at most {self._limits.max_event_blocks} blocks",
                    )
                if isinstance(event, BlockStored) and (
                    len(event.token_ids) > self._limits.max_event_blocks * self._limits.max_block_size
                ):
                    raise InvalidArgument(f"batches[{i}].events[{j}].token_ids", "too many tokens")
        # The node must be alive and this incarnation current: events of a dead or replaced
        # agent would resurrect blocks the registry already dropped.
        known = await self._store.get_node(node)
        if known.incarnation != incarnation:
            raise FailedPrecondition(
                f"node {node} is at incarnation {known.incarnation}",
                reason=ErrorReason.NODE_INCARNATION_MISMATCH,
                metadata={"node": node, "incarnation": str(known.incarnation)},
            )
        result = await self._index_feed.report(node, incarnation, batches)
        self._stats.event_batches += result.applied_batches
        self._stats.event_gaps += result.gap_detected
        self._stats.engine_restarts += result.engine_restarted
        return result

    async def lookup_blocks(
        self, block_hashes: Sequence[int], *, model: str, role: NodeRole | None
    ) -> list[tuple[str, int]]:
        if len(block_hashes) > self._limits.max_lookup_hashes:
            raise InvalidArgument("block_hashes", f"at most {self._limits.max_lookup_hashes}")
        self._check.bounded(model, "model", required=False)
        if not block_hashes:
            return []
        nodes: list[str] = []
        after = ""
        while True:
            page = await self._store.list_nodes(
                role=role, model=model or None, after=after, limit=self._limits.max_page_size
            )
            nodes.extend(n.name for n in page)
            if len(page) < self._limits.max_page_size:
                break
            after = page[-1].name
        return self._index.lookup(block_hashes, nodes)
