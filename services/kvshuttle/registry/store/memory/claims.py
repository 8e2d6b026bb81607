"""The in-memory store's claim operations (kvshuttle.registry.store.memory.store): the single-use claim
with its pin, shared claims of a pool-held retention, release and giving a claim back, move to
another node, evict."""

from __future__ import annotations

import uuid

from kvshuttle.core.errors import FailedPrecondition
from kvshuttle.core.fingerprint import request_id_reused
from kvshuttle.core.limits import MAX_SHARED_CLAIMS
from kvshuttle.core.nodes import NodeRole
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.idempotency import ClaimAnswer, MoveAnswer, claim_fingerprint, move_fingerprint
from kvshuttle.registry.model import ChangeKind, Claim, Holder, Move, Retention, RetentionChange
from kvshuttle.registry.store.errors import (
    already_claimed,
    node_not_found,
    not_shareable,
    request_ended,
    retention_expired,
)
from kvshuttle.registry.store.memory.state import RETENTION, MemoryState, prune_shared, snapshot_retention

_CLAIM, _MOVE = "claim", "move"


class MemoryClaims:
    """Claims: claim (with its remembered first answer), release, give back, move, evict."""

    def __init__(self, state: MemoryState) -> None:
        self._state = state

    async def claim_retention(
        self, name: str, holder: str, claim_ttl: float, now: float, *, request_id: str, shared: bool = False
    ) -> tuple[Retention, list[RetentionChange]]:
        key = (_CLAIM, name, request_id)
        fingerprint = claim_fingerprint(holder, shared=shared) if request_id else b""
        if request_id:
            first = self._state.idempotency.get(key, now)
            if first is not None:
                if not isinstance(first, ClaimAnswer) or first.fingerprint != fingerprint:
                    raise request_id_reused()
                return self._first_claim(name, request_id, first, now), []
        record = self._state.retention(name)
        if shared:
            claim = self._share(record, holder, claim_ttl, now)
        else:
            self._state.check_claimable(record, now)
            claim = Claim(uuid.uuid4().hex, holder, now, now + claim_ttl, lease_expire_at=record.expire_at)
            record.claim = claim
            record.expire_at = claim.expire_at
            self._state.claimed += 1
            self._state.push(record.expire_at, RETENTION, name)
        snapshot = snapshot_retention(record)
        snapshot.claim = claim
        if request_id:
            self._state.idempotency.put(key, ClaimAnswer(fingerprint, claim.claim_id), now)
        return snapshot, [RetentionChange(ChangeKind.CLAIMED, snapshot, now)]

    def _share(self, record: Retention, holder: str, claim_ttl: float, now: float) -> Claim:
        """A shared claim on `record`, beside the live ones."""
        node = self._state.nodes.get(record.node)
        if node is None or node.spec.role is not NodeRole.POOL:
            raise not_shareable(record.name)
        if record.claim is not None or len(prune_shared(record, now)) >= MAX_SHARED_CLAIMS:
            raise already_claimed(record.name)
        if record.expire_at <= now:
            raise retention_expired(record.name)
        claim = Claim(uuid.uuid4().hex, holder, now, now + claim_ttl, lease_expire_at=record.expire_at)
        record.shared = (*record.shared, claim)
        if claim.expire_at > record.expire_at:  # the sweep keeps it for the claim then
            self._state.push(claim.expire_at, RETENTION, record.name)
        return claim

    def _first_claim(self, name: str, request_id: str, first: ClaimAnswer, now: float) -> Retention:
        """The retention a repeated claim took, as it is now: a claim is never renewed or given
        back, so while the retention lives and the claim holds it is the first answer. Once it
        is gone (released, lapsed), the claim has ended: RETENTION_NOT_FOUND."""
        record = self._state.retentions.get(name)
        claims = () if record is None else (record.claim, *prune_shared(record, now))
        claim = next((c for c in claims if c is not None and c.claim_id == first.claim_id), None)
        if record is None or claim is None:
            raise request_ended(name, "claim", request_id)
        snapshot = snapshot_retention(record)
        snapshot.claim = claim
        return snapshot

    async def release_retention(
        self, name: str, claim_id: str, force: bool, now: float, *, keep: bool = False
    ) -> list[RetentionChange]:
        record = self._state.retention(name)
        if not force and any(c.claim_id == claim_id for c in prune_shared(record, now)):
            return [self._unshare(record, claim_id, now)]
        if keep:
            return [self._unclaim(record, claim_id, now)]
        own = record.claim is not None and record.claim.claim_id == claim_id
        if not force and not own and (record.claim is not None or record.shared):
            holder = (
                record.claim.holder if record.claim is not None else f"{len(record.shared)} shared readers"
            )
            raise FailedPrecondition(
                f"retention {name} is claimed by {holder}",
                reason=ErrorReason.CLAIM_MISMATCH,
                metadata={"retention": name},
            )
        return [self._state.remove_retention(name, ChangeKind.RELEASED, now)]

    def _unshare(self, record: Retention, claim_id: str, now: float) -> RetentionChange:
        """One shared claim ended: the retention stays for the next reader, unless its lease
        has passed and no other shared claim holds it (EXPIRED)."""
        record.shared = tuple(c for c in record.shared if c.claim_id != claim_id)
        if not record.shared and record.expire_at <= now:
            return self._state.remove_retention(record.name, ChangeKind.EXPIRED, now)
        return RetentionChange(ChangeKind.UNCLAIMED, snapshot_retention(record), now)

    def _unclaim(self, record: Retention, claim_id: str, now: float) -> RetentionChange:
        """The claim given back unread: the retention's own lease again (EXPIRED when past)."""
        claim = record.claim
        if claim is None or claim.claim_id != claim_id:
            held = "is not claimed" if claim is None else f"is claimed by {claim.holder}"
            raise FailedPrecondition(
                f"retention {record.name} {held}: only its claim's holder gives the claim back",
                reason=ErrorReason.CLAIM_MISMATCH,
                metadata={"retention": record.name, "field": "claim_id"},
            )
        if claim.lease_expire_at <= now:
            return self._state.remove_retention(record.name, ChangeKind.EXPIRED, now)
        record.claim = None
        self._state.claimed -= 1
        record.expire_at = claim.lease_expire_at
        self._state.push(record.expire_at, RETENTION, record.name)
        return RetentionChange(ChangeKind.UNCLAIMED, snapshot_retention(record), now)

    async def move_retention(
        self, move: Move, ttl: float, now: float, *, request_id: str
    ) -> tuple[Retention, list[RetentionChange]]:
        name = move.name
        key = (_MOVE, name, request_id)
        fingerprint = move_fingerprint(move) if request_id else b""
        if request_id:
            first = self._state.idempotency.get(key, now)
            if first is not None:
                if not isinstance(first, MoveAnswer) or first.fingerprint != fingerprint:
                    raise request_id_reused()
                return self._first_move(move, request_id, first), []
        record = self._state.retention(name)
        if record.claim is None or record.claim.claim_id != move.claim_id:
            held = "is not claimed" if record.claim is None else f"is claimed by {record.claim.holder}"
            raise FailedPrecondition(
                f"retention {name} {held}: only its claim's holder moves it",
                reason=ErrorReason.CLAIM_MISMATCH,
                metadata={"retention": name, "field": "claim_id"},
            )
        if record.expire_at <= now:
            raise FailedPrecondition(
                f"retention {name}'s claim lapsed",
                reason=ErrorReason.RETENTION_EXPIRED,
                metadata={"retention": name},
            )
        target = self._state.nodes.get(move.node)
        if target is None:
            raise node_not_found(move.node)
        if target.spec.model != record.model or target.spec.block_size != record.block_size:
            raise FailedPrecondition(
                f"node {move.node} serves model {target.spec.model!r} with block size "
                f"{target.spec.block_size}, not {record.model!r} / {record.block_size}",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": move.node, "field": "node"},
            )
        mismatch = Holder.mismatch(move.holder, target.spec, "kv_transfer_params")
        if mismatch is not None:
            raise FailedPrecondition(
                f"kv_transfer_params do not name node {move.node} as registered "
                f"({mismatch.rsplit('.', 1)[-1]} differs)",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": move.node, "field": mismatch},
            )
        # Everything is checked: from here on nothing raises.
        previous = record.node
        source = self._state.nodes.get(previous)
        if source is not None:
            source.retained_bytes -= record.kv_bytes
            source.retention_count -= 1
        self._state.node_retentions[previous].discard(name)
        move.apply_to(record, now + ttl)
        self._state.claimed -= 1
        self._state.node_retentions[move.node].add(name)
        target.retained_bytes += record.kv_bytes
        target.retention_count += 1
        self._state.push(record.expire_at, RETENTION, name)
        if request_id:
            self._state.idempotency.put(key, MoveAnswer(fingerprint, record.expire_at), now)
        snapshot = snapshot_retention(record)
        return snapshot, [RetentionChange(ChangeKind.MOVED, snapshot, now, previous_node=previous)]

    def _first_move(self, move: Move, request_id: str, first: MoveAnswer) -> Retention:
        """The first response to a repeated move, rebuilt from the live retention (its name,
        generation, chain and times never change) and the repeat (same fingerprint: the same
        move). Once the retention is gone, RETENTION_NOT_FOUND."""
        record = self._state.retentions.get(move.name)
        if record is None:
            raise request_ended(move.name, "move", request_id)
        out = snapshot_retention(record)
        move.apply_to(out, first.expire_at)
        return out

    async def evict_retention(self, name: str, node: str, now: float) -> list[RetentionChange]:
        record = self._state.retention(name)
        if record.node != node:
            raise FailedPrecondition(
                f"retention {name} is held by {record.node}, not {node}",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"retention": name, "node": node, "field": "node"},
            )
        if record.claim is not None or prune_shared(record, now):
            holder = record.claim.holder if record.claim is not None else "shared readers"
            raise FailedPrecondition(
                f"retention {name} is claimed by {holder}: a reader may be reading it",
                reason=ErrorReason.RETENTION_ALREADY_CLAIMED,
                metadata={"retention": name},
            )
        return [self._state.remove_retention(name, ChangeKind.EVICTED, now)]
