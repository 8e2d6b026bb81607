"""RegistryStore on Redis (redis-py asyncio): the same contract as the in-memory store
(kvshuttle.registry.store.memory.store), durable and shared by several registry replicas.

Every store operation's deciding step is ONE Lua script (kvshuttle.registry.store.redis.scripts, run by
EVALSHA through `register_script`), so the rule it enforces holds on the server no matter how
many replicas call at once: put-and-replace under the conversation's fence, the single-use
claim with its pin, release (and giving a claim back), renew, move, evict, node registration,
heartbeat and removal. No rule is read in Python and written back.

Keys (P is the configured prefix; the braces are Redis Cluster hash tags):

- `P:{tenants/t/conversations/c}`: the conversation: its fence and `forget` time, its retention
  (one at a time; the fields of the Retention and its claim), a tombstone of the last removed
  retention. `P:{tenants/t/conversations/c}:i:<op>:<target>:<request_id>`: a remembered first
  answer (AIP-155), in the same slot. So every retention script touches one slot.
- `P:{nodes/n}`: the node's lease record; `...:held` (retention name -> kv_bytes: its retentions,
  whose count and byte sum are the node's counts) and `...:lost` (retentions of a removed
  incarnation whose NODE_LOST cascade is not done yet), one slot per node.
- `P:{tenants/t}:names`: the tenant's retention names (a lexicographic ZSET), for listing.
- `{P}:...`, the global slot: `nodes` (node directory), `ndl`/`nver`, `rdl`/`rver` and `fdl`
  (node, retention and fence deadlines, with write versions), `rcount`/`rover` (the retention
  deadlines per tenant, which capacity counts, and those reserved past a limit), `fsz`
  (lingering fence sizes), `claimed` (claimed retention names), `idem`/`isz` (the remembered
  answers' index), `meta` (incarnation counter, lingering and remembered bytes, fences forgotten
  early).

Operations that touch several slots run as per-slot scripts driven from Python, each step
idempotent and each index a hint that the deciding record overrides:

- put: node record read (validation), node attach, the reservation (its expiry deadline, added
  under the capacity limits in one script: kvshuttle.registry.store.redis.bounds) and tenant-index add
  BEFORE the commit (so a replica dying after the commit still leaves a deadline that expires
  it), the conversation's commit script (a new retention past the limit refused, a replacement
  let in), then the replaced retention's clean-up, the node check (a node gone meanwhile: the
  retention is dropped at once as NODE_LOST) and the remembered answer's indexing. A refused put
  gives its reservation back.
- node removal (deregister, expiry, engine change): the node script moves `held` to `lost`
  atomically with the record's removal; Python then drops each lost retention with a
  conversation script that removes it only if it is still that retention on that node, and
  clears it from `lost`. A replica dying mid-cascade leaves `lost` non-empty and the node's
  deadline in place: the next sweep of that node finishes the cascade.
- move: the conversation's script, then detach from the old node and attach to the new one.
- expiry sweeps (`expire_due`): DUE reads the due members of a deadline set; for each, the
  record's own script decides (expired and removed, still alive, or gone), so with several
  replicas sweeping each expiry is removed, and emitted, exactly once: by the replica whose
  script removed it; the others see it gone. Deadlines only move earlier by the writers (ZADD
  LT plus a version bump); a sweeper resets a deadline later only if its version is unchanged
  since it read it, so no concurrent write is lost and a record is never swept late.
- listing: the ZSET index in name order, then each record read (a name whose record is gone or
  changed is skipped), until the page is full.

Time is the registry's clock, passed in as `now`; Redis's clock is used only to bound memory
(each remembered answer also gets a PEXPIRE of idempotency_ttl, besides the index's count,
bytes and age bounds).

`counts()` and `next_deadline()` are sync in the protocol: they answer from a view held in this
process, refreshed from the server by every `expire_due` (the registry's expiry timer runs it
at least every `expiry_max_sleep` seconds) and moved by this replica's own operations in between.
So on one replica they are exact after each operation; with several, another replica's changes
show after this one's next sweep, read from the shared counters every replica moves (the same
figures on every replica then). `retentions` is what capacity counts: live retentions plus
puts in flight; `fenced_conversations` counts it plus lingering fences; `remembered_requests` /
`remembered_request_bytes` are the remembered answers' index (as of the sweep).
"""

from __future__ import annotations

from kvshuttle.registry.store.redis.codec import RedisClient
from kvshuttle.registry.store.redis.expiry import RedisExpiry

__all__ = ["RedisClient", "RedisStore"]


class RedisStore(RedisExpiry):
    """See the module docstring: nodes (redis_nodes), retentions (redis_retentions), claims
    (redis_claims), expiry (redis_expiry) over the keys and shared steps of redis_keys and the
    codec of redis_codec. `client` must be created with decode_responses=False."""
