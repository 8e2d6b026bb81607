"""RegistryStore on Redis (redis-py asyncio): the same contract as the in-memory store
(kvshuttle.registry.store.memory.store), durable and shared by several registry replicas.

Every store operation's deciding step is ONE Lua script (kvshuttle.registry.store.redis.scripts, run by
EVALSHA through `register_script`), so the rule it enforces holds on the server no matter how
many replicas call at once: put-and-replace under the conversation's fence, the single-use
claim with its pin, shared claims, release (and giving a claim back), renew, move, evict, node
registration, heartbeat and removal. No rule is read in Python and written back.

Keys (P is the configured prefix; the braces are Redis Cluster hash tags):

- `P:{tenants/t/conversations/c}`: the conversation: its fence and `forget` time, its retention
  (one at a time; the fields of the Retention, its single-use claim and, in `sh`, its shared
  claims, at most MAX_SHARED_CLAIMS live), a tombstone of the last removed retention.
  `P:{tenants/t/conversations/c}:i:<op>:<target>:<request_id>`: a remembered first answer
  (AIP-155), in the same slot. So every retention script touches one slot.
- `P:{nodes/n}`: the node's lease record; `...:held` (retention name -> kv_bytes: its retentions,
  whose count and byte sum are the node's counts) and `...:lost` (retentions of a removed
  incarnation whose NODE_LOST cascade is not done yet), one slot per node.
- `P:{tenants/t}:names`: the tenant's retention names (a lexicographic ZSET), for listing;
  `...:ends` and `...:tx` (hashes), what find_retention looks up: (model, block size, the chain's
  last hash) and (model, transcript key) -> retention name, the latest put winning a shared field
  (kvshuttle.registry.store.redis.lookup). The transcript itself is the record's `tx` field.
- `{P}:...`, the global slot: `nodes` (node directory), `ndl`/`nver`, `rdl`/`rver` and `fdl`
  (node, retention and fence deadlines, with write versions), `rcount`/`rover` (the retention
  deadlines per tenant, which capacity counts, and those reserved past a limit), `txsz`/`txt`
  (transcript bytes reserved per retention name and per tenant), `fsz` (lingering fence sizes),
  `claimed` (claimed retention names), `idem`/`isz` (the remembered answers' index), `meta`
  (incarnation counter, lingering, remembered and transcript bytes, fences forgotten early).

Operations that touch several slots run as per-slot scripts driven from Python, each step
idempotent and each index a hint that the deciding record overrides:

- put: node record read (validation), node attach, the reservation (its expiry deadline, added
  under the capacity limits in one script, with its transcript's bytes under the transcript
  bounds: kvshuttle.registry.store.redis.bounds) and tenant-index add BEFORE the commit (so a
  replica dying after the commit still leaves a deadline that expires it), the conversation's
  commit script (a new retention past the limit refused, a replacement let in; the transcript
  stored only if its bytes fit), then the replaced retention's clean-up, the find_retention
  entries, the node check (a node gone meanwhile: the retention is dropped at once as NODE_LOST)
  and the remembered answer's indexing. A refused put gives its reservation back.
- retirement (every removal: replaced, released, expired, evicted, node lost): the record's
  script first, then its index steps (`RedisShared.retired`): detach, tenant names, its
  find_retention entries (each only while it still names it), its deadline member, whose
  removal frees its transcript bytes in the same script.
- node removal (deregister, expiry, engine change): the node script moves `held` to `lost`
  atomically with the record's removal; Python then drops each lost retention with a
  conversation script that removes it only if it is still that retention on that node, and
  clears it from `lost`. A replica dying mid-cascade leaves `lost` non-empty and the node's
  deadline in place: the next sweep of that node finishes the cascade.
- move: the conversation's script, then detach from the old node and attach to the new one.
- shared claim: the retention's node read, then whether it is a pool node (its record, another
  slot), then the conversation's script, which refuses it if the retention is on another node
  by then (ALREADY_CLAIMED: it was moved, under a single-use claim). The retention's deadline
  stays its lease: the sweep decides then.
- expiry sweeps (`expire_due`): DUE reads the due members of a deadline set; for each, the
  record's own script decides (expired and removed, still alive, or gone; past its lease, a
  retention with a live shared claim is alive until the latest one lapses), so with several
  replicas sweeping each expiry is removed, and emitted, exactly once: by the replica whose
  script removed it; the others see it gone. Deadlines only move earlier by the writers (ZADD
  LT plus a version bump); a sweeper resets a deadline later only if its version is unchanged
  since it read it, so no concurrent write is lost and a record is never swept late.
- listing: the ZSET index in name order, then each record read (a name whose record is gone or
  changed is skipped), until the page is full.
- find_retention: the tenant's `ends` (every candidate field in one HMGET, walked from the
  longest prefix) or `tx` entry, then the record it names, which decides: it must exist, own the
  entry, not have lapsed and (for a chain) hold exactly that prefix. A stale entry is skipped and
  deleted. Gaps, each a miss or a leftover, never a wrong answer: a replica dying between a
  commit and its entries' write leaves that retention unfindable (it stays usable by name); one
  dying between a record's removal and its retirement leaves its entries until a lookup meets
  them (deleted then) or a later put of the field overwrites them (the sweep that finishes the
  other index steps does not know the fields). Transcript bytes have no such gap: they go with
  the deadline member, which that sweep removes.

Time is the registry's clock, passed in as `now`; Redis's clock is used only to bound memory
(each remembered answer also gets a PEXPIRE of idempotency_ttl, besides the index's count,
bytes and age bounds).

In parts: one RedisShared (kvshuttle.registry.store.redis.shared: the client, key layout, scripts, this
replica's view and the steps the parts share) held by each part, the bounds (.bounds: capacity
reservations, the remembered answers' index), nodes (.nodes), retentions (.retentions), claims
(.claims) and expiry (.expiry); this class hands each operation to its part.

`counts()` and `next_deadline()` are sync in the protocol: they answer from a view held in this
process, refreshed from the server by every `expire_due` (the registry's expiry timer runs it
at least every `expiry_max_sleep` seconds) and moved by this replica's own operations in between.
So on one replica they are exact after each operation; with several, another replica's changes
show after this one's next sweep, read from the shared counters every replica moves (the same
figures on every replica then). `retentions` is what capacity counts: live retentions plus
puts in flight; `fenced_conversations` counts it plus lingering fences; `remembered_requests` /
`remembered_request_bytes` are the remembered answers' index (as of the sweep); `transcripts` /
`transcript_bytes` the transcript reservations (live ones plus puts in flight, as of the sweep).
"""

from __future__ import annotations

from array import array

from redis.commands.core import AsyncScript

from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.registry.model import (
    Conversation,
    ExpiryResult,
    Found,
    Move,
    Node,
    PutResult,
    Retention,
    RetentionChange,
    StoreCounts,
)
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.redis.bounds import RedisBounds
from kvshuttle.registry.store.redis.claims import RedisClaims
from kvshuttle.registry.store.redis.codec import RedisClient
from kvshuttle.registry.store.redis.expiry import RedisExpiry
from kvshuttle.registry.store.redis.keys import RedisKeys
from kvshuttle.registry.store.redis.lookup import RedisLookup
from kvshuttle.registry.store.redis.nodes import RedisNodes
from kvshuttle.registry.store.redis.retentions import RedisRetentions
from kvshuttle.registry.store.redis.shared import RedisShared

__all__ = ["RedisClient", "RedisStore"]


class RedisStore:
    """See the module docstring. `client` must be created with decode_responses=False."""

    def __init__(
        self,
        client: RedisClient,
        limits: StoreLimits | None = None,
        *,
        prefix: str = "kvshuttle",
        incarnation_base: int = 0,
    ) -> None:
        keys = RedisKeys(prefix)
        self._shared = RedisShared(client, limits or StoreLimits(), keys, incarnation_base=incarnation_base)
        self.bounds = RedisBounds(self._shared)
        self._nodes = RedisNodes(self._shared)
        self._retentions = RedisRetentions(self._shared, self.bounds)
        self._claims = RedisClaims(self._shared, self.bounds)
        self._expiry = RedisExpiry(self._shared, self.bounds)
        self._lookup = RedisLookup(self._shared)

    @property
    def client(self) -> RedisClient:
        return self._shared.client

    @property
    def keys(self) -> RedisKeys:
        return self._shared.keys

    @property
    def scripts(self) -> dict[str, AsyncScript]:
        """The registered scripts by name (each one's `sha` is what EVALSHA sends)."""
        return self._shared.scripts

    # ---- nodes -----------------------------------------------------------------------------

    async def register_node(
        self, spec: NodeSpec, ttl: float, now: float
    ) -> tuple[Node, list[RetentionChange], bool]:
        return await self._nodes.register_node(spec, ttl, now)

    async def heartbeat_node(
        self, name: str, incarnation: int, ttl: float, load: NodeLoad, now: float
    ) -> Node:
        return await self._nodes.heartbeat_node(name, incarnation, ttl, load, now)

    async def deregister_node(self, name: str, incarnation: int | None, now: float) -> list[RetentionChange]:
        return await self._nodes.deregister_node(name, incarnation, now)

    async def get_node(self, name: str) -> Node:
        return await self._nodes.get_node(name)

    async def list_nodes(
        self, *, role: NodeRole | None, model: str | None, after: str, limit: int
    ) -> list[Node]:
        return await self._nodes.list_nodes(role=role, model=model, after=after, limit=limit)

    # ---- retentions ------------------------------------------------------------------------

    async def put_retention(
        self, retention: Retention, ttl: float, now: float, *, request_id: str
    ) -> tuple[PutResult, list[RetentionChange]]:
        return await self._retentions.put_retention(retention, ttl, now, request_id=request_id)

    async def get_retention(self, name: str) -> Retention:
        return await self._retentions.get_retention(name)

    async def get_conversation(self, name: str) -> Conversation:
        return await self._retentions.get_conversation(name)

    async def renew_retention(
        self, name: str, ttl: float, max_ttl: float, now: float
    ) -> tuple[Retention, list[RetentionChange]]:
        return await self._retentions.renew_retention(name, ttl, max_ttl, now)

    async def list_retentions(
        self, *, tenant: str, conversation: str | None, node: str | None, after: str, limit: int
    ) -> list[Retention]:
        return await self._retentions.list_retentions(
            tenant=tenant, conversation=conversation, node=node, after=after, limit=limit
        )

    async def find_retention(
        self,
        *,
        tenant: str,
        model: str,
        block_size: int,
        chain: array[int] | None,
        transcript_key: bytes | None,
        now: float,
    ) -> Found:
        return await self._lookup.find_retention(
            tenant=tenant,
            model=model,
            block_size=block_size,
            chain=chain,
            transcript_key=transcript_key,
            now=now,
        )

    # ---- claims ----------------------------------------------------------------------------

    async def claim_retention(
        self, name: str, holder: str, claim_ttl: float, now: float, *, request_id: str, shared: bool = False
    ) -> tuple[Retention, list[RetentionChange]]:
        return await self._claims.claim_retention(
            name, holder, claim_ttl, now, request_id=request_id, shared=shared
        )

    async def release_retention(
        self, name: str, claim_id: str, force: bool, now: float, *, keep: bool = False
    ) -> list[RetentionChange]:
        return await self._claims.release_retention(name, claim_id, force, now, keep=keep)

    async def move_retention(
        self, move: Move, ttl: float, now: float, *, request_id: str
    ) -> tuple[Retention, list[RetentionChange]]:
        return await self._claims.move_retention(move, ttl, now, request_id=request_id)

    async def evict_retention(self, name: str, node: str, now: float) -> list[RetentionChange]:
        return await self._claims.evict_retention(name, node, now)

    # ---- expiry and this replica's view ----------------------------------------------------

    async def expire_due(self, now: float) -> ExpiryResult:
        return await self._expiry.expire_due(now)

    def next_deadline(self) -> float | None:
        return self._shared.deadline

    def counts(self) -> StoreCounts:
        return self._shared.counts
