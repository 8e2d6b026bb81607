"""The registry's per-node block index: vLLM KV events in, prefix lookups by kvshuttle's chain out."""

from __future__ import annotations

import random

import pytest
from tests.support.block_events import BS, batch, removed, stored, toks
from tests.support.fixtures_vllm import live_batches, replay_batches

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.hashing import ROOT_HASH, cache_salt_digest, chain_hashes, chain_root, salted_root
from kvshuttle.core.kv_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, EventBatch
from kvshuttle.registry.block_index import BlockIndex


class Feed:
    """Sends one node's events with consecutive sequence numbers."""

    def __init__(self, index: BlockIndex, node: str) -> None:
        self.index = index
        self.node = node
        self.seq = 0

    def send(self, *events: BlockEvent) -> None:
        result = self.index.apply(self.node, [batch(self.seq, *events)])
        assert result.applied_batches == 1
        self.seq += 1


# -- storing, chaining, removing --------------------------------------------------------


def test_multi_block_store_is_keyed_by_kvshuttle_chain() -> None:
    index = BlockIndex(1000)
    tokens = toks(3)
    result = index.apply("a", [batch(0, stored((11, 12, 13), tokens))])
    assert result.applied_batches == 1
    assert result.next_seq == 1
    assert not result.gap_detected and not result.engine_restarted
    chain = chain_hashes(tokens, BS)
    assert index.lookup(chain) == [("a", 3)]
    assert index.lookup(chain[:2]) == [("a", 2)]
    # A prompt that goes on past the held blocks matches the held prefix.
    assert index.lookup(chain_hashes((*tokens, *toks(2, 100)), BS)) == [("a", 3)]
    # Other tokens in block 2: blocks 0 and 1 still match.
    assert index.lookup(chain_hashes((*tokens[:8], 9, 9, 9, 9), BS)) == [("a", 2)]
    assert index.node_block_count("a") == 3
    assert index.stats().total_blocks == 3
    assert index.stats().distinct_chains == 3


def test_parent_chaining_across_events() -> None:
    index = BlockIndex(1000)
    feed = Feed(index, "a")
    tokens = toks(5)
    feed.send(stored((11, 12), tokens[: 2 * BS]))
    feed.send(stored((13, 14, 15), tokens[2 * BS :], parent=12))
    assert index.lookup(chain_hashes(tokens, BS)) == [("a", 5)]
    # A branch from block 0: shares block 0 with the first sequence.
    other = (*tokens[:BS], *toks(1, 500))
    feed.send(stored((21,), other[BS:], parent=11))
    assert index.lookup(chain_hashes(other, BS)) == [("a", 2)]
    assert index.node_block_count("a") == 6


def test_unknown_parent_is_skipped_and_counted() -> None:
    index = BlockIndex(1000)
    tokens = toks(3)
    index.apply("a", [batch(0, stored((12, 13), tokens[BS:], parent=11))])  # 11 never seen
    assert index.node_block_count("a") == 0
    assert index.stats().unkeyed_blocks == 2
    # Neither the true chain nor the blocks' tokens rooted anywhere are found.
    assert index.lookup(chain_hashes(tokens, BS)) == []
    assert index.lookup(chain_hashes(tokens[BS:], BS)) == []


def test_remove_and_clear() -> None:
    index = BlockIndex(1000)
    feed = Feed(index, "a")
    tokens = toks(4)
    chain = chain_hashes(tokens, BS)
    feed.send(stored((11, 12, 13, 14), tokens))
    feed.send(removed(14, 13))
    assert index.lookup(chain) == [("a", 2)]
    assert index.node_block_count("a") == 2
    # Unknown hashes and other media are ignored.
    feed.send(removed(999), removed(11, medium="CPU"))
    assert index.lookup(chain) == [("a", 2)]
    feed.send(AllBlocksCleared())
    assert index.lookup(chain) == []
    assert index.node_block_count("a") == 0
    assert index.stats().total_blocks == 0
    assert index.stats().distinct_chains == 0


def test_removal_before_store_in_one_batch_and_restore_after_removal() -> None:
    index = BlockIndex(1000)
    feed = Feed(index, "a")
    first, second = toks(3), toks(2, 1000)
    feed.send(stored((11, 12, 13), first))
    # vLLM evicts (deepest first) before storing the new blocks, in one batch.
    feed.send(removed(13), removed(12), stored((21, 22), second))
    assert index.lookup(chain_hashes(first, BS)) == [("a", 1)]
    assert index.lookup(chain_hashes(second, BS)) == [("a", 2)]
    # The same vLLM hashes come back once the blocks are computed again.
    feed.send(stored((12, 13), first[BS:], parent=11))
    assert index.lookup(chain_hashes(first, BS)) == [("a", 3)]
    assert index.node_block_count("a") == 5


def test_store_chaining_from_a_block_removed_earlier_in_the_batch() -> None:
    index = BlockIndex(1000)
    feed = Feed(index, "a")
    tokens = toks(3)
    feed.send(stored((11, 12), tokens[: 2 * BS]))
    feed.send(removed(12), stored((13,), tokens[2 * BS :], parent=12))
    assert index.stats().unkeyed_blocks == 0
    chain = chain_hashes(tokens, BS)
    # Block 1 is gone, so only block 0 leads; block 2 is held under its true chain hash.
    assert index.lookup(chain) == [("a", 1)]
    assert index.lookup(chain[:1]) == [("a", 1)]
    feed.send(stored((12,), tokens[BS : 2 * BS], parent=11))
    assert index.lookup(chain) == [("a", 3)]
    # Past an AllBlocksCleared nothing from before it is a known parent any more.
    feed.send(removed(13), AllBlocksCleared(), stored((14,), toks(1, 40), parent=13))
    assert index.stats().unkeyed_blocks == 1
    assert index.node_block_count("a") == 0


@pytest.mark.parametrize(
    "event",
    [
        stored((11, 12), toks(1)),  # too few tokens
        stored((11,), toks(2)),  # too many tokens
        stored((11,), (), block_size=0),  # no block size
        stored((11,), (1, 2, 3, 1 << 32)),  # a token outside uint32
        stored((11,), (1, 2, 3, -1)),
    ],
)
def test_malformed_store_is_skipped_and_counted(event: BlockStored) -> None:
    index = BlockIndex(1000)
    result = index.apply("a", [batch(0, event, stored((21,), toks(1, 50)))])
    assert result.applied_batches == 1
    assert index.stats().malformed_events == 1
    assert index.node_block_count("a") == 1  # the rest of the batch still applies
    assert index.lookup(chain_hashes(toks(1, 50), BS)) == [("a", 1)]


def test_empty_store_is_a_no_op() -> None:
    index = BlockIndex(10)
    index.apply("a", [batch(0, stored((), ()))])
    assert index.stats().malformed_events == 0
    assert index.node_block_count("a") == 0


def test_same_vllm_hash_in_two_media_is_held_until_both_remove_it() -> None:
    index = BlockIndex(1000)
    feed = Feed(index, "a")
    tokens = toks(2)
    chain = chain_hashes(tokens, BS)
    feed.send(stored((11, 12), tokens))
    feed.send(stored((11, 12), tokens, medium="CPU"))  # offloaded copy
    assert index.node_block_count("a") == 4
    feed.send(removed(12, 11))
    assert index.lookup(chain) == [("a", 2)]
    # A block stored on the CPU tier chains from a GPU parent too.
    feed.send(stored((13,), toks(1, 200), parent=12, medium="CPU"))
    assert index.lookup(chain_hashes((*tokens, *toks(1, 200)), BS)) == [("a", 3)]
    feed.send(removed(13, 12, 11, medium="CPU"))
    assert index.lookup(chain) == []
    assert index.node_block_count("a") == 0
    assert index.stats().distinct_chains == 0


def test_same_chain_under_two_vllm_hashes_is_reference_counted() -> None:
    # E.g. two requests with different cache_salt: vLLM hashes differ, the tokens do not.
    index = BlockIndex(1000)
    feed = Feed(index, "a")
    tokens = toks(2)
    chain = chain_hashes(tokens, BS)
    feed.send(stored((11, 12), tokens))
    feed.send(stored((31, 32), tokens))
    feed.send(removed(12, 11))
    assert index.lookup(chain) == [("a", 2)]
    feed.send(removed(32))
    assert index.lookup(chain) == [("a", 1)]
    feed.send(removed(31))
    assert index.lookup(chain) == []
    assert index.stats().distinct_chains == 0


def test_restored_vllm_hash_with_other_tokens_replaces_the_entry() -> None:
    index = BlockIndex(1000)
    feed = Feed(index, "a")
    feed.send(stored((11,), toks(1)))
    feed.send(stored((11,), toks(1, 70)))  # a missed removal, then other content
    assert index.lookup(chain_hashes(toks(1), BS)) == []
    assert index.lookup(chain_hashes(toks(1, 70), BS)) == [("a", 1)]
    assert index.node_block_count("a") == 1


# -- LoRA -------------------------------------------------------------------------------


def test_lora_blocks_live_in_their_own_chain_namespace() -> None:
    index = BlockIndex(1000)
    tokens = toks(3)
    index.apply("base", [batch(0, stored((11, 12, 13), tokens))])
    index.apply("lora7", [batch(0, stored((41, 42), tokens[: 2 * BS], lora_id=7))])
    index.apply("lora7", [batch(1, stored((43,), tokens[2 * BS :], parent=42, lora_id=7))])
    index.apply("lora8", [batch(0, stored((51, 52, 53), tokens, lora_id=8))])

    assert chain_root(None) == ROOT_HASH
    assert len({chain_root(None), chain_root(7), chain_root(8), chain_root(-1)}) == 4
    # A base-model prompt never matches KV computed under an adapter.
    assert index.lookup(chain_hashes(tokens, BS)) == [("base", 3)]
    assert index.lookup(chain_hashes(tokens, BS, parent=chain_root(7))) == [("lora7", 3)]
    assert index.lookup(chain_hashes(tokens, BS, parent=chain_root(8))) == [("lora8", 3)]


def test_salted_blocks_live_in_their_salts_chain_namespace() -> None:
    """vLLM never serves blocks stored under one cache salt to a request under another: nor does
    the index count them as a prompt's local hits (the router chains a salted prompt the same way)."""
    index = BlockIndex(1000)
    tokens = toks(3)
    salt_a, salt_b = cache_salt_digest("tenant-a"), cache_salt_digest("tenant-b")
    index.apply("plain", [batch(0, stored((11, 12, 13), tokens))])
    index.apply("a", [batch(0, stored((21, 22), tokens[: 2 * BS], salt=salt_a))])
    # The next event chains from its parent: vLLM reports the salt only with the first block.
    index.apply("a", [batch(1, stored((23,), tokens[2 * BS :], parent=22))])
    index.apply("b", [batch(0, stored((31, 32, 33), tokens, salt=salt_b))])
    index.apply("lora-a", [batch(0, stored((41, 42, 43), tokens, lora_id=7, salt=salt_a))])

    assert index.lookup(chain_hashes(tokens, BS)) == [("plain", 3)]
    assert index.lookup(chain_hashes(tokens, BS, parent=salted_root(salt_a))) == [("a", 3)]
    assert index.lookup(chain_hashes(tokens, BS, parent=salted_root(salt_b))) == [("b", 3)]
    assert index.lookup(chain_hashes(tokens, BS, parent=chain_root(7, salt_a))) == [("lora-a", 3)]
    assert index.lookup(chain_hashes(tokens, BS, parent=chain_root(7))) == []


def test_a_malformed_salt_digest_is_skipped_and_counted() -> None:
    index = BlockIndex(1000)
    index.apply("n", [batch(0, stored((11,), toks(1), salt=b"short"))])
    assert index.stats().malformed_events == 1 and index.node_block_count("n") == 0


# -- sequence numbers -------------------------------------------------------------------


def test_duplicate_batches_are_skipped() -> None:
    index = BlockIndex(1000)
    tokens = toks(2)
    chain = chain_hashes(tokens, BS)
    assert index.apply("a", [batch(0, stored((11, 12), tokens))]).next_seq == 1
    # Seq 0 again right after seq 0: a resend, not a restart.
    result = index.apply("a", [batch(0, removed(12, 11)), batch(1, stored((21,), toks(1, 90)))])
    assert (result.applied_batches, result.next_seq) == (1, 2)
    assert not result.engine_restarted and not result.gap_detected
    assert index.lookup(chain) == [("a", 2)]
    result = index.apply("a", [batch(1, removed(12, 11)), batch(2, removed(21))])
    assert (result.applied_batches, result.next_seq) == (1, 3)
    assert index.lookup(chain) == [("a", 2)]
    assert index.node_block_count("a") == 2
    assert index.next_seq("a") == 3


def test_gap_is_applied_and_reported() -> None:
    index = BlockIndex(1000)
    # A node's first batch may have any seq.
    first = index.apply("a", [batch(7, stored((11,), toks(1)))])
    assert (first.applied_batches, first.next_seq, first.gap_detected) == (1, 8, False)
    result = index.apply("a", [batch(8, stored((12,), toks(1, 4), parent=11)), batch(10, removed(12))])
    assert (result.applied_batches, result.next_seq, result.gap_detected) == (2, 11, True)
    assert index.node_block_count("a") == 1
    assert not index.apply("a", [batch(11)]).gap_detected


def test_restart_at_seq_0_clears_the_node_first() -> None:
    index = BlockIndex(1000)
    old, new = toks(2), toks(2, 300)
    index.apply("a", [batch(0, stored((11, 12), old)), batch(1), batch(2)])
    index.apply("b", [batch(0, stored((91, 92), old))])
    result = index.apply("a", [batch(0, stored((61, 62), new)), batch(1)])
    assert result.engine_restarted
    assert (result.applied_batches, result.next_seq) == (2, 2)
    assert index.lookup(chain_hashes(old, BS)) == [("b", 2)]
    assert index.lookup(chain_hashes(new, BS)) == [("a", 2)]
    assert index.node_block_count("a") == 2


def test_restart_in_the_middle_of_a_call() -> None:
    index = BlockIndex(1000)
    old, new = toks(1), toks(1, 300)
    result = index.apply(
        "a",
        [batch(40, stored((11,), old)), batch(41), batch(0, stored((61,), new)), batch(1)],
    )
    assert result.engine_restarted and not result.gap_detected
    assert (result.applied_batches, result.next_seq) == (4, 2)
    assert index.lookup(chain_hashes(old, BS)) == []
    assert index.lookup(chain_hashes(new, BS)) == [("a", 1)]


def test_invalid_input_changes_nothing() -> None:
    index = BlockIndex(1000)
    with pytest.raises(InvalidArgument) as err:
        index.apply("a", [batch(0, stored((11,), toks(1))), batch(-1)])
    assert err.value.field == "batches[1].seq"
    with pytest.raises(InvalidArgument) as err:
        index.apply("", [batch(0)])
    assert err.value.field == "node"
    with pytest.raises(InvalidArgument) as err:
        index.apply("a", [batch(0, "BlockStored")])  # type: ignore[arg-type]
    assert err.value.field == "batches[0].events[0]"
    assert index.stats().nodes == 0
    assert index.next_seq("a") is None
    with pytest.raises(ValueError):
        BlockIndex(0)


def test_empty_apply_for_unknown_node_creates_nothing() -> None:
    index = BlockIndex(10)
    assert index.apply("a", []) == index.apply("a", [])
    assert index.stats().nodes == 0


# -- bounds and nodes -------------------------------------------------------------------


def test_capacity_bound_drops_and_counts() -> None:
    index = BlockIndex(5)
    feed = Feed(index, "a")
    tokens = toks(6)
    feed.send(stored((11, 12, 13), tokens[: 3 * BS]))
    feed.send(stored((14, 15, 16), tokens[3 * BS :], parent=13))
    assert index.node_block_count("a") == 5
    assert index.stats().dropped_over_capacity == 1
    assert index.lookup(chain_hashes(tokens, BS)) == [("a", 5)]
    # Children of the dropped block cannot be keyed; storing more stays bounded.
    feed.send(stored((17,), toks(1, 500), parent=16))
    feed.send(stored((21, 22), toks(2, 700)))
    assert index.node_block_count("a") == 5
    assert index.stats().unkeyed_blocks == 1
    assert index.stats().dropped_over_capacity == 3
    # Re-storing what is held needs no room; removals make room.
    feed.send(stored((11,), tokens[:BS]))
    assert index.stats().dropped_over_capacity == 3
    feed.send(removed(15, 14))
    feed.send(stored((21, 22), toks(2, 700)))
    assert index.node_block_count("a") == 5
    assert index.lookup(chain_hashes(toks(2, 700), BS)) == [("a", 2)]
    # The bound is per node.
    index.apply("b", [batch(0, stored((11, 12, 13), tokens[: 3 * BS]))])
    assert index.node_block_count("b") == 3


def test_drop_node() -> None:
    index = BlockIndex(1000)
    tokens = toks(3)
    index.apply("a", [batch(0, stored((11, 12, 13), tokens))])
    index.apply("b", [batch(0, stored((11, 12), tokens[: 2 * BS]))])
    index.apply("c", [batch(0, stored((11, 12), tokens[: 2 * BS]))])
    chain = chain_hashes(tokens, BS)
    assert index.lookup(chain) == [("a", 3), ("b", 2), ("c", 2)]
    index.drop_node("a")
    index.drop_node("b")
    index.drop_node("nobody")
    assert index.lookup(chain) == [("c", 2)]
    assert index.node_block_count("a") == 0
    assert index.stats().nodes == 1
    assert index.stats().total_blocks == 2
    assert index.next_seq("a") is None
    # A new node takes a freed slot without inheriting anything of the dropped ones.
    index.apply("d", [batch(0, stored((71,), toks(1, 800)))])
    assert index.lookup(chain) == [("c", 2)]
    assert index.lookup(chain_hashes(toks(1, 800), BS)) == [("d", 1)]
    # A dropped node starts afresh: any seq is its first.
    assert not index.apply("a", [batch(9, stored((11,), tokens[:BS]))]).gap_detected
    assert index.lookup(chain) == [("c", 2), ("a", 1)]
    assert index.lookup(chain, nodes={"a", "d", "gone"}) == [("a", 1)]


# -- lookup -----------------------------------------------------------------------------


def test_lookup_counts_leading_blocks_only() -> None:
    index = BlockIndex(1000)
    tokens = toks(4)
    chain = chain_hashes(tokens, BS)
    index.apply("full", [batch(0, stored((11, 12, 13, 14), tokens))])
    index.apply("part", [batch(0, stored((11, 12), tokens[: 2 * BS]))])
    index.apply("also-part", [batch(0, stored((11, 12), tokens[: 2 * BS]))])
    # "hole" holds blocks 1..3 but lost block 0 (evicted before its children).
    index.apply("hole", [batch(0, stored((11, 12, 13, 14), tokens), removed(11))])
    assert index.node_block_count("hole") == 3

    assert index.lookup(chain) == [("full", 4), ("also-part", 2), ("part", 2)]
    assert index.lookup(chain, nodes={"part", "hole"}) == [("part", 2)]
    assert index.lookup(chain, nodes=["hole"]) == []
    assert index.lookup(chain, nodes=()) == []
    # Same tokens after a different first block: no leading block matches.
    assert index.lookup(chain_hashes((*toks(1, 900), *tokens[BS:]), BS)) == []
    assert index.lookup([]) == []
    assert index.lookup([12345]) == []


def test_lookup_long_chain_many_nodes_matches_brute_force() -> None:
    rng = random.Random(7)
    index = BlockIndex(10_000)
    bs = 16
    tokens = tuple(rng.randrange(50_000) for _ in range(750 * bs))
    chain = chain_hashes(tokens, bs)
    want: dict[str, int] = {}
    for n in range(40):
        node = f"node-{n:02d}"
        held = rng.choice([0, 1, 2, 100, 333, 749, 750, rng.randrange(751)])
        if held:
            hashes = tuple(range(n * 1000, n * 1000 + held))
            index.apply(node, [batch(0, stored(hashes, tokens[: held * bs], block_size=bs))])
            want[node] = held
    expected = sorted(want.items(), key=lambda item: (-item[1], item[0]))
    assert index.lookup(chain) == expected
    some = {f"node-{n:02d}" for n in range(0, 40, 3)}
    assert index.lookup(chain, nodes=some) == [(name, m) for name, m in expected if name in some]


def test_random_operations_keep_the_index_consistent() -> None:
    """Against a model: per node, medium -> vLLM hash -> tokens of the whole prefix."""
    rng = random.Random(1234)
    index = BlockIndex(60)
    nodes = ["n0", "n1", "n2"]
    seqs = dict.fromkeys(nodes, 0)
    vocab = 3  # few distinct tokens, so nodes share blocks
    model: dict[str, dict[str, dict[int, tuple[int, ...]]]] = {n: {} for n in nodes}
    # A global vLLM hash per prefix, as vLLM's hashes are equal across instances.
    vllm_of: dict[tuple[int, ...], int] = {}

    def vllm_hash(prefix: tuple[int, ...]) -> int:
        return vllm_of.setdefault(prefix, len(vllm_of) + 1)

    for _ in range(3000):
        node = rng.choice(nodes)
        medium = rng.choice(["GPU", "GPU", "CPU"])
        held = model[node].setdefault(medium, {})
        op = rng.random()
        events: list[BlockEvent] = []
        if op < 0.55:
            # Extend a held prefix (or start one) by 1..3 blocks.
            base: tuple[int, ...] = ()
            if held and rng.random() < 0.7:
                base = rng.choice(list(held.values()))
            new = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 3) * BS))
            hashes = tuple(vllm_hash(base + new[: (i + 1) * BS]) for i in range(len(new) // BS))
            parent = vllm_hash(base) if base else None
            events.append(stored(hashes, new, parent, medium=medium))
            size = sum(len(t) for t in model[node].values())
            for i, h in enumerate(hashes):
                prefix = base + new[: (i + 1) * BS]
                if h not in held and size >= 60:
                    break
                if h not in held:
                    size += 1
                held[h] = prefix
        elif op < 0.95 and held:
            victims = rng.sample(sorted(held), rng.randint(1, min(3, len(held))))
            events.append(removed(*victims, medium=medium))
            for h in victims:
                del held[h]
        elif op < 0.97:
            events.append(AllBlocksCleared())
            model[node] = {}
        else:
            index.drop_node(node)
            model[node] = {}
            continue
        index.apply(node, [batch(seqs[node], *events)])
        seqs[node] += 1

    def brute(tokens: tuple[int, ...]) -> list[tuple[str, int]]:
        out = []
        for name in nodes:
            prefixes = {p for table in model[name].values() for p in table.values()}
            m = 0
            while (m + 1) * BS <= len(tokens) and tokens[: (m + 1) * BS] in prefixes:
                m += 1
            if m:
                out.append((name, m))
        return sorted(out, key=lambda item: (-item[1], item[0]))

    all_prefixes = {p for per_node in model.values() for t in per_node.values() for p in t.values()}
    for prefix in all_prefixes:
        assert index.lookup(chain_hashes(prefix, BS)) == brute(prefix)
    for name in nodes:
        assert index.node_block_count(name) == sum(len(t) for t in model[name].values())
    assert index.stats().unkeyed_blocks == 0


# -- real vLLM frames -------------------------------------------------------------------

FIXTURE_BLOCK_SIZE = 32


def _stored_events(batches: list[EventBatch]) -> list[BlockStored]:
    return [e for b in batches for e in b.events if isinstance(e, BlockStored)]


def test_fixture_decodes() -> None:
    live = live_batches()
    assert [b.seq for b in live] == list(range(15))
    events = [e for b in live for e in b.events]
    assert sum(isinstance(e, BlockStored) for e in events) == 15
    assert sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved)) == 19
    assert sum(isinstance(e, AllBlocksCleared) for e in events) == 1
    assert replay_batches() == live


def test_real_vllm_events_prompt_and_extension_are_found() -> None:
    live = live_batches()
    first, extension = _stored_events(live[:2])
    assert first.parent_block_hash is None
    assert extension.parent_block_hash == first.block_hashes[-1]  # the 70-token extension
    assert {first.block_size, extension.block_size} == {FIXTURE_BLOCK_SIZE}
    prompt = first.token_ids  # the 100-token prompt's 3 full blocks
    extended = prompt + extension.token_ids  # 170 tokens: 5 full blocks

    index = BlockIndex(1000)
    result = index.apply("p", live[:2])
    assert (result.applied_batches, result.next_seq, result.gap_detected) == (2, 2, False)
    assert index.lookup(chain_hashes(prompt, FIXTURE_BLOCK_SIZE)) == [("p", 3)]
    assert index.lookup(chain_hashes(extended, FIXTURE_BLOCK_SIZE)) == [("p", 5)]
    # A third turn extending the conversation: the 5 blocks lead.
    third = extended + tuple(range(64))
    assert index.lookup(chain_hashes(third, FIXTURE_BLOCK_SIZE)) == [("p", 5)]
    assert index.stats().unkeyed_blocks == 0

    # The unrelated prompts evict the conversation's blocks (deepest first).
    index.apply("p", live[2:14])
    assert index.lookup(chain_hashes(extended, FIXTURE_BLOCK_SIZE)) == []
    assert index.node_block_count("p") == 41 - 19  # stored minus removed
    for event in _stored_events(live[2:14])[-2:]:  # the latest prompts are still cached
        assert index.lookup(chain_hashes(event.token_ids, FIXTURE_BLOCK_SIZE)) == [("p", 3)]

    # POST /reset_prefix_cache: AllBlocksCleared, then one more request in the same batch.
    last = live[14]
    assert isinstance(last.events[0], AllBlocksCleared)
    cleared_only = EventBatch(seq=last.seq, engine_time=last.engine_time, events=last.events[:1])
    index.apply("p", [cleared_only])
    assert index.node_block_count("p") == 0
    assert index.stats().total_blocks == 0
    assert index.stats().distinct_chains == 0

    # The full batch (a duplicate seq now, so use a fresh index) leaves only the new request.
    full = BlockIndex(1000)
    full.apply("p", live)
    (after_reset,) = _stored_events(live[14:])
    assert full.node_block_count("p") == 1
    assert full.lookup(chain_hashes(after_reset.token_ids, FIXTURE_BLOCK_SIZE)) == [("p", 1)]
    for event in _stored_events(live[:14]):
        assert full.lookup(chain_hashes(event.token_ids, FIXTURE_BLOCK_SIZE)) == []


def _snapshot(index: BlockIndex, batches: list[EventBatch]) -> list[list[tuple[str, int]]]:
    """Lookups of every prefix the fixture ever stored (root events, and the extension)."""
    events = _stored_events(batches)
    chains = [chain_hashes(e.token_ids, FIXTURE_BLOCK_SIZE) for e in events if e.parent_block_hash is None]
    chains.append(chain_hashes(events[0].token_ids + events[1].token_ids, FIXTURE_BLOCK_SIZE))
    return [index.lookup(c) for c in chains]


def test_real_vllm_replay_gives_the_live_state() -> None:
    live, replay = live_batches(), replay_batches()
    from_live, from_replay = BlockIndex(1000), BlockIndex(1000)
    for n in range(1, len(live) + 1):  # after every prefix of the stream, not only the end
        from_live = BlockIndex(1000)
        from_live.apply("p", live[:n])
        from_replay = BlockIndex(1000)
        from_replay.apply("p", replay[:n])
        assert _snapshot(from_live, live) == _snapshot(from_replay, live)
        assert from_live.stats() == from_replay.stats()

    # The agent reconnects and replays from 0 onto the same node: the index is rebuilt.
    result = from_live.apply("p", replay)
    assert result.engine_restarted
    assert (result.applied_batches, result.next_seq) == (15, 15)
    assert _snapshot(from_live, live) == _snapshot(from_replay, live)
    assert from_live.node_block_count("p") == from_replay.node_block_count("p") == 1
