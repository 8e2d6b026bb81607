"""The registry's per-node block index, fed by vLLM's KV-cache events.

Placement asks "which node already holds the longest prefix of this prompt?". vLLM's
events name blocks by vLLM's own hashes, which depend on the engine's hash function and
seed; the router only knows kvshuttle's hash chain (`kvshuttle.core.hashing`). A
`BlockStored` event carries the blocks' token ids and the vLLM hash of the block before
them, so the index re-keys every block by kvshuttle's chain:

    chain(block) = block_hash(chain(parent), tokens of block)

with the chain root `chain_root(lora_id, cache_salt_sha256)` for a sequence's first block. Per
node it keeps
vLLM hash -> chain hash (to resolve the parents of later events and to apply removals),
and one global map chain hash -> nodes holding it (a bit mask over node slots), which
`lookup` walks, AND-ing masks down the chain until no node is left.

The index is a placement hint: a missing entry only costs a local prefix hit, a wrong one
sends work to the wrong node. So whatever cannot be keyed for sure is left out: blocks
whose parent the node's index does not know (missed events), malformed events, stores
beyond the per-node bound. It is never consulted to decide what KV to serve: vLLM finds
its own local prefix hits.

LoRA: vLLM folds the adapter into its block hashes, and KV computed under an adapter
differs from the base model's for the same tokens. The index therefore roots a LoRA
sequence's chain at `chain_root(lora_id)` instead of `ROOT_HASH`: a base-model prompt's
chain (what `LookupBlocks` carries today) never matches blocks cached under an adapter,
and blocks of different adapter ids never match each other. vLLM's `lora_id` is the
engine's integer id for the adapter, assigned per serving process, so the same adapter may
get different ids on different nodes: a lookup by LoRA (not offered yet) would need the
adapter's name in the events to be reliable across nodes.

Cache salts: vLLM folds a request's `cache_salt` into its first block's hash, so blocks stored
under one salt never serve a prompt under another. Its BlockStored events say so: the first
block's `extra_keys` carry the salt (vLLM 0.32 and later), and the agent forwards its SHA-256.
The index roots such a sequence at `salted_root(digest)`, as the router roots a prompt sent
with that salt (`PlanTurnRequest.cache_salt_sha256`): a salted prompt's lookup finds only blocks
stored under its own salt, so one tenant's plan never reflects what another tenant has cached.
Events without the digest (an older agent) are keyed unsalted: salted prompts then find none of
those blocks, and unsalted ones may over-count.

Not in the chain: vLLM's other extra keys (multimodal input hashes) are not carried by the
events as the registry receives them. Blocks that differ only by those keys get the same chain
hash, so the index can over-report a hit for them; it is a hint only.

Memory: per block, one entry in the node's vLLM-hash dict (two ints) and, per distinct
chain hash, one entry in the global map whose value is a small int (the holders' bits; a
cached int object for the first 8 node slots). No per-block objects beyond the ints.

Not thread-safe: the registry serializes calls (one event loop, or a lock).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.hashing import chain_hashes, chain_root
from kvshuttle.core.kv_events import (
    AllBlocksCleared,
    ApplyResult,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

__all__ = ["BlockIndex", "BlockIndexStats", "SeqPlan", "plan_batches"]


@dataclass(frozen=True, slots=True)
class SeqPlan:
    """What the sequence rule makes of a node's batches (see `plan_batches`)."""

    apply: tuple[tuple[int, bool], ...]  # (index into the batches, clear the node first), in order
    next_seq: int | None  # the seq expected next afterwards; None: nothing applied yet, ever
    gap: bool
    restarted: bool

    def result(self) -> ApplyResult:
        return ApplyResult(len(self.apply), self.next_seq or 0, self.gap, self.restarted)


def plan_batches(next_seq: int | None, seqs: Sequence[int]) -> SeqPlan:
    """The sequence rule, for a node whose index expects `next_seq` (None: no batch yet) and
    batches of `seqs`, in the order given: a seq below the expected one was seen already and is
    skipped, except seq 0 once the node had applied a later seq: the engine restarted (or the
    agent replays from 0), so the node is cleared before that batch. A seq above the expected one
    is applied and is a gap. The first batch of a node may have any seq. One rule for the
    process's own index and for the sequence state replicas share (kvshuttle.registry.redis_blocks)."""
    apply: list[tuple[int, bool]] = []
    gap = restarted = False
    for i, seq in enumerate(seqs):
        clear = False
        if next_seq is not None and seq < next_seq:
            if seq != 0 or next_seq <= 1:
                continue  # a duplicate
            clear = restarted = True
        elif next_seq is not None and seq > next_seq:
            gap = True
        apply.append((i, clear))
        next_seq = seq + 1
    return SeqPlan(tuple(apply), next_seq, gap, restarted)


@dataclass(frozen=True, slots=True)
class BlockIndexStats:
    nodes: int  # nodes that reported events (and were not dropped since)
    total_blocks: int  # indexed blocks, all nodes (a block held in two media counts twice)
    distinct_chains: int  # distinct chain hashes held by any node
    unkeyed_blocks: int  # stored blocks skipped: their parent was unknown on the node
    malformed_events: int  # BlockStored events skipped: token count, token ids or salt digest invalid
    dropped_over_capacity: int  # stored blocks skipped: the node was at max_blocks_per_node


class _Node:
    """One node's part of the index."""

    __slots__ = ("bit", "blocks", "media", "multi", "name", "next_seq", "slot", "started")

    def __init__(self, name: str, slot: int) -> None:
        self.name = name
        self.slot = slot  # this node's bit position in the holder masks
        self.bit = 1 << slot
        self.next_seq = 0
        self.started = False  # a batch was applied
        # medium -> vLLM block hash -> chain hash. One entry per block the engine holds.
        self.media: dict[str, dict[int, int]] = {}
        # chain hash -> number of entries in `media` with that chain, only where >= 2
        # (a block held in two media; blocks that differ by keys outside the chain).
        self.multi: dict[int, int] = {}
        self.blocks = 0  # entries in `media`, all media together


class BlockIndex:
    """Which node holds which blocks, keyed by kvshuttle's hash chain. See the module doc."""

    def __init__(self, max_blocks_per_node: int) -> None:
        if max_blocks_per_node <= 0:
            raise ValueError("max_blocks_per_node must be positive")
        self._max = max_blocks_per_node
        self._nodes: dict[str, _Node] = {}
        # chain hash -> bit mask of the nodes holding it (bit = _Node.slot); never 0.
        self._holders: dict[int, int] = {}
        # slot -> node name (None: free). Freed slots are reused, lowest first, to keep
        # masks small; a node's bits are all cleared before its slot is freed.
        self._slots: list[str | None] = []
        self._free_slots: list[int] = []  # a heap
        self._total = 0
        self._unkeyed = 0
        self._malformed = 0
        self._dropped = 0

    # -- events ------------------------------------------------------------------------

    def apply(self, node: str, batches: Sequence[EventBatch]) -> ApplyResult:
        """Apply a node's event batches, in the order given (the agent sends them in
        sequence order).

        In `plan_batches`' sequence order: duplicates skipped, the node cleared at a restart
        (seq back to 0), gaps applied and reported.

        Raises InvalidArgument (and changes nothing) for an empty node name, a negative
        seq or an event of an unknown type.
        """
        if not node:
            raise InvalidArgument("node", "must not be empty")
        for i, batch in enumerate(batches):
            if batch.seq < 0:
                raise InvalidArgument(f"batches[{i}].seq", "must not be negative")
            for j, event in enumerate(batch.events):
                if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
                    raise InvalidArgument(f"batches[{i}].events[{j}]", "unknown event type")

        state = self._nodes.get(node)
        if state is None:
            if not batches:
                return ApplyResult(0, 0, False, False)
            state = self._nodes[node] = _Node(node, self._take_slot(node))
        plan = plan_batches(state.next_seq if state.started else None, [b.seq for b in batches])
        for i, clear in plan.apply:
            if clear:
                self._clear(state)
            self._apply_batch(state, batches[i])
            state.started = True
        if plan.next_seq is not None:
            state.next_seq = plan.next_seq
        return plan.result()

    def clear(self) -> None:
        """Forget every node (a replica that missed part of the shared stream starts over)."""
        for node in list(self._nodes):
            self.drop_node(node)

    def drop_node(self, node: str) -> None:
        """Forget everything about a node (lease lapsed, deregistered, engine restarted)."""
        state = self._nodes.pop(node, None)
        if state is not None:
            self._clear(state)
            self._slots[state.slot] = None
            heapq.heappush(self._free_slots, state.slot)

    # -- queries -------------------------------------------------------------------------

    def lookup(self, chain: Sequence[int], nodes: Collection[str] | None = None) -> list[tuple[str, int]]:
        """Per node (only those in `nodes`, when given), how many leading blocks of `chain`
        it holds. Nodes holding none are left out; most blocks first, then by name."""
        if not chain:
            return []
        holders = self._holders
        mask = holders.get(chain[0], 0)
        if mask and nodes is not None:
            allowed = 0
            for name in nodes:
                state = self._nodes.get(name)
                if state is not None:
                    allowed |= state.bit
            mask &= allowed
        if not mask:
            return []
        matched: list[tuple[str, int]] = []
        depth = 1
        for h in itertools.islice(chain, 1, None):
            held = holders.get(h, 0) & mask
            if held != mask:
                self._collect(mask & ~held, depth, matched)
                mask = held
                if not mask:
                    break
            depth += 1
        self._collect(mask, depth, matched)
        matched.sort(key=lambda item: (-item[1], item[0]))
        return matched

    def node_block_count(self, node: str) -> int:
        """Blocks indexed for a node (0 for an unknown node)."""
        state = self._nodes.get(node)
        return 0 if state is None else state.blocks

    def next_seq(self, node: str) -> int | None:
        """The seq the index expects next from a node; None before its first batch."""
        state = self._nodes.get(node)
        return state.next_seq if state is not None and state.started else None

    def stats(self) -> BlockIndexStats:
        return BlockIndexStats(
            nodes=len(self._nodes),
            total_blocks=self._total,
            distinct_chains=len(self._holders),
            unkeyed_blocks=self._unkeyed,
            malformed_events=self._malformed,
            dropped_over_capacity=self._dropped,
        )

    # -- internals -----------------------------------------------------------------------

    def _apply_batch(self, state: _Node, batch: EventBatch) -> None:
        # vLLM hash -> chain hash of blocks removed earlier in this batch: a store later in
        # the batch may still chain from one of them (the mapping stays valid: the engine,
        # and so its hash seed, is the same within a batch).
        removed: dict[int, int] = {}
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(state, event, removed)
            elif isinstance(event, BlockRemoved):
                self._remove(state, event, removed)
            else:
                self._clear(state)
                removed.clear()

    def _store(self, state: _Node, event: BlockStored, removed: dict[int, int]) -> None:
        n = len(event.block_hashes)
        if n == 0:
            return
        if event.block_size <= 0 or len(event.token_ids) != event.block_size * n:
            self._malformed += 1
            return
        if event.parent_block_hash is None:
            try:
                parent = chain_root(event.lora_id, event.cache_salt_sha256)
            except ValueError:  # a salt digest of the wrong length
                self._malformed += 1
                return
        else:
            found = self._resolve(state, event.parent_block_hash, event.medium)
            if found is None:
                found = removed.get(event.parent_block_hash)
            if found is None:  # missed events: the chain cannot be known
                self._unkeyed += n
                return
            parent = found
        try:
            chains = chain_hashes(event.token_ids, event.block_size, parent)
        except (ValueError, TypeError):  # a token id outside uint32
            self._malformed += 1
            return
        table = state.media.get(event.medium)
        if table is None:
            table = state.media[event.medium] = {}
        for i, (vllm_hash, chain) in enumerate(zip(event.block_hashes, chains, strict=True)):
            old = table.get(vllm_hash)
            if old is not None:
                if old != chain:  # same vLLM hash, other tokens: trust the newest event
                    table[vllm_hash] = chain
                    self._unhold(state, old)
                    self._hold(state, chain)
                continue
            if state.blocks >= self._max:
                # The rest of the event chains from this block: leave it all out.
                self._dropped += n - i
                break
            table[vllm_hash] = chain
            state.blocks += 1
            self._total += 1
            self._hold(state, chain)

    def _remove(self, state: _Node, event: BlockRemoved, removed: dict[int, int]) -> None:
        table = state.media.get(event.medium)
        if table is None:
            return
        for vllm_hash in event.block_hashes:
            chain = table.pop(vllm_hash, None)
            if chain is None:
                continue  # never indexed (unkeyed, dropped, or before our first batch)
            removed[vllm_hash] = chain
            state.blocks -= 1
            self._total -= 1
            self._unhold(state, chain)
        if not table:
            del state.media[event.medium]

    @staticmethod
    def _resolve(state: _Node, vllm_hash: int, medium: str) -> int | None:
        table = state.media.get(medium)
        if table is not None:
            chain = table.get(vllm_hash)
            if chain is not None:
                return chain
        for other, table in state.media.items():
            if other != medium:
                chain = table.get(vllm_hash)
                if chain is not None:
                    return chain
        return None

    def _hold(self, state: _Node, chain: int) -> None:
        """One more entry of `state` maps to `chain`."""
        mask = self._holders.get(chain, 0)
        if mask & state.bit:
            state.multi[chain] = state.multi.get(chain, 1) + 1
        else:
            self._holders[chain] = mask | state.bit

    def _unhold(self, state: _Node, chain: int) -> None:
        """One entry fewer of `state` maps to `chain`."""
        count = state.multi.get(chain)
        if count is not None:
            if count <= 2:
                del state.multi[chain]
            else:
                state.multi[chain] = count - 1
            return
        self._release(state.bit, chain)

    def _release(self, bit: int, chain: int) -> None:
        """The node of `bit` no longer holds `chain` at all (idempotent)."""
        mask = self._holders.get(chain, 0) & ~bit
        if mask:
            self._holders[chain] = mask
        else:
            self._holders.pop(chain, None)

    def _take_slot(self, node: str) -> int:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
            self._slots[slot] = node
        else:
            slot = len(self._slots)
            self._slots.append(node)
        return slot

    def _collect(self, mask: int, depth: int, out: list[tuple[str, int]]) -> None:
        """Append (name, depth) for every node whose bit is set in `mask`."""
        slots = self._slots
        while mask:
            low = mask & -mask
            name = slots[low.bit_length() - 1]
            assert name is not None
            out.append((name, depth))
            mask ^= low

    def _clear(self, state: _Node) -> None:
        bit = state.bit
        for table in state.media.values():
            for chain in table.values():
                self._release(bit, chain)  # idempotent: a chain held twice is released once
        self._total -= state.blocks
        state.media.clear()
        state.multi.clear()
        state.blocks = 0
