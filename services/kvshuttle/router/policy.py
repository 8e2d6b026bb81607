"""The router's settings: placement weights, parking, extend, retention by what comes next, and
the rest of RouterPolicy. Built once from the router's config (kvshuttle.router.config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvshuttle.core.limits import MAX_ID_LENGTH, MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS


@dataclass(frozen=True, slots=True)
class PlacementWeights:
    # Prefill nodes expected to finish a turn within this many ms (or this fraction) of the
    # best are near-ties, one drawn at random (kvshuttle.router.placement)...
    near_tie_ms: float = 20.0
    near_tie_fraction: float = 0.05
    # ...and decode nodes within this many requests' load of the least loaded. All three 0:
    # no draws, exact ties go to the first node by name (repeatable placement, for debugging).
    near_tie_requests: float = 0.5
    # Decode: the KV cache's pressure (kvshuttle.router.placement.kv_pressure: usage / (1 -
    # usage)) counts as this many running/queued requests per unit: half full, 4; 90 %, 36...
    kv_usage_weight: float = 4.0
    # ...and as much as this many GiB of KV held in retentions.
    retained_gib_weight: float = 1.0
    # Prefill's short lane: a turn whose prefill is expected to take at least long_prefill_ms
    # on every node stays off this fraction of the prefill nodes (rounded down; the ones with
    # the least work queued), so a later turn's few new tokens find a node without a long
    # prefill ahead: vLLM runs a running prefill's chunks before those of any request admitted
    # after it, so a 100-token suffix waits out a 100k-token first turn (the fleet simulator's
    # Mooncake at 8 sessions/s: later-turn TTFT p90 6.6 s without the lane, 1.3-1.5 s with it).
    # 0: no lane.
    short_lane_fraction: float = 0.375
    long_prefill_ms: float = 1000.0
    # A lane node is kept only while short turns use it: one that took no short prefill from
    # this replica in this long is open to long turns. Where short turns stay on the node that
    # caches their history (Claude Code's 60k-100k-token sessions), a lane they never use would
    # idle three nodes and pile the long turns onto the rest, the short turns behind them.
    short_lane_window_s: float = 5.0


@dataclass(frozen=True, slots=True)
class ParkingPolicy:
    """When the shuttle (kvshuttle.router.shuttle) moves a conversation's retention off its
    decode engine into an agent's DRAM pool (park), or next to the prefill node its next turn
    will use (prefetch). Only this replica's own commits are scheduled."""

    # Park retentions of this replica's commits (needs agents with a pool registered as nodes:
    # without one a park is skipped, skipped_no_pool). On: HBM a retention holds idle is what a
    # decode engine's running answers lack (docs/benchmarks/fleet.md).
    enabled: bool = True
    # Park a retention once its conversation has been idle this long (an agent between tool
    # calls comes back within seconds, and its next prefill reads the pool's copy as fast as
    # decode's: the fleet simulator's agent loop at 8 sessions/s cut 209 turns parking at 30 s,
    # none at 1-5 s)...
    park_after_idle_s: float = 2.0
    # ...or at once, oldest idle first, while its decode node's kv_cache_usage is above this...
    park_kv_usage_above: float = 0.85
    # ...and at the latest this long before the engine's pin ends, when the conversation may
    # come back after it (max_idle_s reaches past decoder_kv_blocks_ttl).
    park_before_pin_s: float = 20.0
    # A conversation idle this long is not coming back: a moved retention's lease (its
    # registry ttl) ends max_idle_s after the conversation's last commit.
    max_idle_s: float = 600.0
    # Prefetch to the conversation's last prefill node's agent at commit time when the plan's
    # expected_think_time_s is at least prefetch_margin times the estimated move time.
    prefetch_enabled: bool = False
    prefetch_margin: float = 1.5
    # Moves in flight at once (each is one agent READ of a whole retention): a fleet ending
    # tens of turns a second parks as many (the fleet simulator's agent loop at 8 sessions/s
    # over 8 decode engines, seed 1: later-turn TTFT p90 3.3 s and decode HBM at 95 % at 16,
    # 1.6 s at 64).
    max_in_flight: int = 64
    # Conversations scheduled at once; past it the oldest scheduled is dropped.
    max_scheduled: int = 100_000
    # How often the shuttle looks at its schedule and the decode nodes' kv_cache_usage.
    tick_s: float = 1.0
    # A move whose lease would be shorter than this is not worth it (skipped_idle_over).
    min_ttl_s: float = 15.0
    # Before a plan sends prefill to read from an agent's pool, the agent must answer within
    # this (its pool node's lease outlives a killed agent by up to the lease TTL, and vLLM 0.32's
    # prefill hangs on a READ from a dead peer): no answer plans a recompute (NODE_DOWN).
    holder_probe_timeout_s: float = 0.25
    # A plan for a conversation whose retention this replica is moving (the move holds its
    # claim) waits at most this long for the move, then plans on where it went; without the
    # wait the turn would recompute (CLAIM_LOST) when it comes back while its KV is in flight.
    move_wait_s: float = 2.0


@dataclass(frozen=True, slots=True)
class NextTurnPolicy:
    """How long a committed retention stays on its decode engine before the shuttle parks it,
    from how its answer ended (a tool call, a stop, a cut) and the gaps learnt online after such
    ends, per conversation and per tenant (kvshuttle.router.next_turn). Without enough gaps
    learnt, or with this off, parking_policy's park_after_idle_s decides."""

    # On (the fleet simulator, 8/s agent loop, seeds 1-3: later-turn TTFT p90 1.70 / 2.29 /
    # 1.65 s with the timer alone, 1.52 / 1.86 / 1.48 s with this).
    enabled: bool = True
    # The retention stays on decode only while its next turn is likely soon: at least
    # min_return_p of the turns after this kind of end came back within keep_max_s...
    keep_max_s: float = 5.0
    min_return_p: float = 0.5
    # ...and then for this quantile of those gaps (the conversation's own once it has
    # min_conversation_gaps of them, else its tenant's), after which it parks. A next turn
    # unlikely soon parks at once: its HBM goes back to the running answers. (0.9 and 10 s held
    # more HBM for little: Claude Code's ITL p99 18 -> 23 ms; 0.5 and 5 s: 17 ms.)
    keep_quantile: float = 0.5
    # Gaps learnt before the tenant's figures decide (fewer: park_after_idle_s), and before a
    # conversation's own do.
    min_samples: int = 8
    min_conversation_gaps: int = 3
    # Older gaps weigh half once this many newer ones were learnt (a tenant's agents change).
    half_life: int = 1000
    # Conversations and tenants remembered, the least recently used going first. Measured with
    # tracemalloc at their largest (all three end kinds learnt, 150-character names): ~950 bytes
    # a conversation, ~1,100 a tenant, so at most ~48 MB and ~11 MB.
    max_conversations: int = 50_000
    max_tenants: int = 10_000


@dataclass(frozen=True, slots=True)
class ExtendPolicy:
    """When a turn runs on the decode node that holds its conversation's KV (Decision.EXTEND):
    that node's prefix cache serves the history and it computes only the new tokens, so no KV
    moves. Off by default: it puts prefill work on decode nodes, which a P/D split exists to keep
    off them, so an operator opts in. Needs prefix caching on the decode engines (vLLM's
    default); a block the holder evicted is only computed again, never read wrong."""

    # Extend on the holder at all; off by default: it puts prefill work on decode nodes.
    enabled: bool = False
    # While the holder prefills, each of its running decodes waits about as long: that delay
    # counts this much per request against extending (1.0: a running decode's delay weighs as
    # much as this turn's own time to first token).
    interference_weight: float = 0.1
    # The holder takes the turn only with fewer requests than this running and waiting...
    max_batch: int = 64
    # ...and only a prefill expected to take at most this long (its batch's longest stall)...
    max_prefill_ms: float = 250.0
    # ...on a holder whose KV cache is at most this full (vLLM's kv_cache_usage_perc): the turn
    # stays there and grows, and a decode engine out of blocks queues every answer it admits
    # (the fleet's agent loop at 4 sessions/s, extend on: later-turn TTFT p90 36 s ungated,
    # 0.9 s at 0.5).
    max_kv_usage: float = 0.5


@dataclass(frozen=True, slots=True)
class RouterPolicy:
    # How long a claim pins a retention for the prefill's read.
    claim_ttl_s: float = 30.0
    # A retention must outlive the read by this much: vLLM's prefill declines a remote read
    # whose deadline is within 5 s (an HTTP 500 without kv_load_failure_policy=recompute).
    claim_headroom_s: float = 6.0
    turn_ttl_s: float = 600.0
    # Decode keeps retained blocks this long (vLLM's decoder_kv_blocks_ttl), counted from
    # decode's answer; kvshuttle's lease ends margin_s earlier.
    decoder_kv_blocks_ttl_s: float = 480.0
    retention_margin_s: float = 30.0
    # The node list in hand is refreshed in the background once it is node_refresh_s old; a
    # plan waits for the registry only when it is node_max_age_s old (or missing).
    node_refresh_s: float = 0.5
    node_max_age_s: float = 5.0
    # A plan the list in hand cannot place (no healthy prefill or decode node: one that just
    # registered is not in it yet) reads the registry's list at once, unless the last read
    # began less than this ago: a role really missing costs the registry at most one ListNodes
    # per this many seconds from each replica.
    node_miss_refresh_s: float = 0.1
    # With the registry unreachable, plans fall back to the last node list it gave while that
    # list is younger than this (plain P->D, REGISTRY_UNAVAILABLE); older, PlanTurn is
    # UNAVAILABLE. 0: no fallback.
    degraded_nodes_max_age_s: float = 60.0
    # CommitTurn's and AbortTurn's registry calls give up after this long: a dead registry
    # does not hold a commit (nor the conversation's next turn, which waits for it) for longer.
    # The retention is then not stored (commit.not_stored reason=REGISTRY_UNAVAILABLE).
    commit_registry_timeout_s: float = 1.0
    # A plan waits at most this long for its conversation's commit in flight on this replica.
    commit_wait_s: float = 2.0
    reuse_enabled: bool = True
    # A recomputing turn releases the retention it supersedes (kvshuttle.router.planner): its
    # holder frees the blocks now, not at decoder_kv_blocks_ttl. Off: they stay pinned until then.
    release_superseded: bool = True
    # Forks of one history share its retention (kvshuttle.router.fork_reads): a turn that forks
    # (a parent hint, or a turn of no conversation continuing a found one) reads a pool-held
    # retention under a shared claim, after parking a decode-held one first. Off: the first
    # fork consumes it and the others recompute (FORK_UNSAFE).
    share_forks: bool = True
    # ...parking a decode-held one first (off: only what the shuttle parked anyway is shared).
    # A park costs one more move than a read of decode's copy, on every turn of a conversation
    # without an id; it buys reuse for every fork of it.
    park_for_forks: bool = True
    # A history the router found (a turn of no conversation) and parked for its forks is kept
    # in the pool this long (its registry ttl), not parking.max_idle_s: each such turn is a new
    # conversation, so a linear one would leave a pooled copy of each turn's history behind.
    found_fork_window_s: float = 120.0
    # Cut the verified prefix at its last verified token, not at its last full block, where the
    # retention's tokens there are known (its commit's answer blocks, on this replica's hint).
    token_granular_reuse: bool = True
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    # CommitTurn takes prompt plus output: at most max_prompt_tokens + max_output_tokens tokens.
    max_output_tokens: int = MAX_OUTPUT_TOKENS
    max_id_length: int = MAX_ID_LENGTH
    chain_cache_bytes: int = 256 * 2**20
    # The retentions this replica's commits stored, for the conversations' next plans.
    retention_hint_bytes: int = 256 * 2**20
    # Entries in each of TurnMemory's tables: plans and commits by request id, finished turns,
    # conversations' last nodes.
    remembered_turns: int = 100_000
    # Estimated bytes of the plans remembered by request id (each holds prefill's block ids).
    remembered_plan_bytes: int = 64 * 2**20
    # The prompts of the turns planned here and not yet finished (uint32 each), so that a
    # commit need not send its prompt again (CommitTurn's output_token_ids); the oldest go first.
    held_prompt_bytes: int = 128 * 2**20
    weights: PlacementWeights = field(default_factory=PlacementWeights)
    parking: ParkingPolicy = field(default_factory=ParkingPolicy)
    extend: ExtendPolicy = field(default_factory=ExtendPolicy)
    next_turn: NextTurnPolicy = field(default_factory=NextTurnPolicy)
