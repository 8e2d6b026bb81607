"""The Registry's retention operations (kvshuttle.registry.service.registry): each checks the whole
request (names, request ids, the retention's geometry, params and bytes, TTLs), then applies it
to the store, which enforces the rules that depend on state."""

from __future__ import annotations

import math
from array import array

import structlog

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.limits import MAX_GENERATION
from kvshuttle.core.names import (
    parse_conversation,
    parse_retention,
    parse_tenant,
    parse_tenant_or_conversation,
)
from kvshuttle.registry.model import Conversation, Found, Move, PutResult, Retention, Transcript
from kvshuttle.registry.service.shared import RegistryShared

log = structlog.get_logger("kvshuttle.registry")


class RegistryRetentions:
    """Retentions: put, read (and a conversation's fence), renew, claim, release (and give a claim
    back), move, evict, list."""

    def __init__(self, shared: RegistryShared) -> None:
        self._shared = shared
        self._store = shared.store
        self._clock = shared.clock
        self._limits = shared.limits
        self._check = shared.checks
        self._stats = shared.stats
        self._wake = shared.wake

    def _check_retention(self, retention: Retention) -> None:
        self._check.node_name(retention.node, "retention.node")
        # Below 2**63: the router plans generation + 1 into a uint64.
        if not 0 < retention.generation <= MAX_GENERATION:
            raise InvalidArgument("retention.generation", f"must be 1..{MAX_GENERATION}")
        self._check.bounded(retention.model, "retention.model")
        if not 0 < retention.block_size <= self._limits.max_block_size:
            raise InvalidArgument("retention.block_size", f"must be 1..{self._limits.max_block_size}")
        if not 0 < retention.num_tokens <= self._limits.max_num_tokens:
            raise InvalidArgument("retention.num_tokens", f"must be 1..{self._limits.max_num_tokens}")
        if len(retention.block_hashes) > self._limits.max_block_hashes:
            raise InvalidArgument("retention.block_hashes", f"at most {self._limits.max_block_hashes}")
        if len(retention.block_hashes) != retention.num_tokens // retention.block_size:
            raise InvalidArgument("retention.block_hashes", "must hold one hash per full block of num_tokens")
        if not retention.kv_transfer_params:
            raise InvalidArgument("retention.kv_transfer_params", "required")
        if len(retention.kv_transfer_params) > self._limits.max_kv_transfer_params_bytes:
            raise InvalidArgument(
                "retention.kv_transfer_params",
                f"larger than {self._limits.max_kv_transfer_params_bytes} bytes",
            )
        # A node's retained_bytes is a sum of these.
        if not 0 <= retention.kv_bytes <= self._limits.max_kv_bytes:
            raise InvalidArgument("retention.kv_bytes", f"must be 0..{self._limits.max_kv_bytes}")
        if retention.prompt_blocks > len(retention.block_hashes):
            raise InvalidArgument("retention.prompt_blocks", "must be at most the number of block_hashes")
        if retention.transcript is not None:
            self._check_transcript(retention.transcript)

    def _check_transcript(self, transcript: Transcript) -> None:
        _check_key(transcript.lookup_key, "retention.transcript.lookup_key")
        if not 0 < len(transcript.token_ids) <= self._limits.max_num_tokens:
            raise InvalidArgument(
                "retention.transcript.token_ids", f"must hold 1..{self._limits.max_num_tokens} ids"
            )
        if len(transcript.answer_sha256) != 32:
            raise InvalidArgument("retention.transcript.answer_sha256", "must be 32 bytes (SHA-256)")

    def _request_id(self, request_id: str) -> str:
        if request_id:
            self._check.id(request_id, "request_id")
        return request_id

    async def put_retention(
        self, *, request_id: str, parent: str, retention: Retention, ttl: float | None
    ) -> PutResult:
        self._request_id(request_id)
        conversation = parse_conversation(parent, "parent", max_length=self._limits.max_id_length)
        self._check_retention(retention)
        lease = self._limits.retention_ttl.pick(ttl, "ttl")
        if retention.pin_expire_at is not None and not math.isfinite(retention.pin_expire_at):
            raise InvalidArgument("retention.pin_expire_time", "must be a finite time")
        retention.name = conversation.retention(retention.generation)
        result, changes = await self._store.put_retention(
            retention, lease, self._clock.now(), request_id=request_id
        )
        if changes:
            self._stats.puts += 1
            self._stats.replaced += bool(result.replaced)
        await self._shared.publish(changes)
        self._wake.set()
        return result

    def _retention_name(self, name: str, field_name: str = "name") -> str:
        parse_retention(name, field_name, max_length=self._limits.max_id_length)
        return name

    async def get_retention(self, name: str) -> Retention:
        return await self._store.get_retention(self._retention_name(name))

    async def get_conversation(self, name: str) -> Conversation:
        parse_conversation(name, "name", max_length=self._limits.max_id_length)
        return await self._store.get_conversation(name)

    async def renew_retention(self, name: str, ttl: float | None) -> Retention:
        self._retention_name(name)
        lease = self._limits.retention_ttl.pick(ttl, "ttl")
        retention, changes = await self._store.renew_retention(
            name, lease, self._limits.retention_ttl.maximum, self._clock.now()
        )
        await self._shared.publish(changes)
        return retention

    async def claim_retention(
        self, *, request_id: str, name: str, holder: str, claim_ttl: float | None, shared: bool = False
    ) -> Retention:
        self._request_id(request_id)
        self._retention_name(name)
        self._check.bounded(holder, "holder")
        lease = self._limits.claim_ttl.pick(claim_ttl, "claim_ttl")
        try:
            retention, changes = await self._store.claim_retention(
                name, holder, lease, self._clock.now(), request_id=request_id, shared=shared
            )
        except Exception as exc:
            self._stats.claims[getattr(exc, "reason", "ERROR")] += 1
            raise
        self._stats.claims["GRANTED"] += 1
        await self._shared.publish(changes)
        self._wake.set()
        return retention

    async def release_retention(self, name: str, *, claim_id: str, force: bool, keep: bool = False) -> None:
        self._retention_name(name)
        self._check.bounded(claim_id, "claim_id", required=keep)
        if keep and force:
            raise InvalidArgument("keep", "gives a claim back: not with force")
        changes = await self._store.release_retention(name, claim_id, force, self._clock.now(), keep=keep)
        await self._shared.publish(changes)
        if keep:
            self._wake.set()  # its lease is the expiry timer's again

    async def move_retention(self, *, request_id: str, move: Move, ttl: float | None) -> Retention:
        """Hand a claimed retention to another node (an agent's pool node) in one step."""
        self._request_id(request_id)
        self._retention_name(move.name)
        self._check.bounded(move.claim_id, "claim_id")
        self._check.node_name(move.node, "node")
        if not move.kv_transfer_params:
            raise InvalidArgument("kv_transfer_params", "required")
        if len(move.kv_transfer_params) > self._limits.max_kv_transfer_params_bytes:
            raise InvalidArgument(
                "kv_transfer_params", f"larger than {self._limits.max_kv_transfer_params_bytes} bytes"
            )
        if not 0 <= move.kv_bytes <= self._limits.max_kv_bytes:
            raise InvalidArgument("kv_bytes", f"must be 0..{self._limits.max_kv_bytes}")
        lease = self._limits.retention_ttl.pick(ttl, "ttl")
        retention, changes = await self._store.move_retention(
            move, lease, self._clock.now(), request_id=request_id
        )
        if changes:
            self._stats.moves += 1
            log.info("retention.moved", node=move.node, previous_node=changes[0].previous_node)
        await self._shared.publish(changes)
        self._wake.set()
        return retention

    async def evict_retention(self, name: str, *, node: str) -> None:
        """Remove a retention its holder `node` needs the room of (never a claimed one)."""
        self._retention_name(name)
        self._check.node_name(node, "node")
        changes = await self._store.evict_retention(name, node, self._clock.now())
        self._stats.evictions += len(changes)
        await self._shared.publish(changes)

    async def find_retention(
        self, *, parent: str, model: str, block_size: int, block_hashes: array[int], transcript_key: bytes
    ) -> Found:
        """The tenant's retention covering the longest prefix of `block_hashes`, or the one whose
        transcript has `transcript_key` (exactly one of the two)."""
        tenant = parse_tenant(parent, "parent", max_length=self._limits.max_id_length)
        self._check.bounded(model, "model")
        if bool(block_hashes) == bool(transcript_key):
            raise InvalidArgument("block_hashes", "set exactly one of block_hashes and transcript_key")
        if block_hashes:
            if len(block_hashes) > self._limits.max_lookup_hashes:
                raise InvalidArgument("block_hashes", f"at most {self._limits.max_lookup_hashes}")
            if not 0 < block_size <= self._limits.max_block_size:
                raise InvalidArgument("block_size", f"must be 1..{self._limits.max_block_size}")
        else:
            _check_key(transcript_key, "transcript_key")
        return await self._store.find_retention(
            tenant=tenant,
            model=model,
            block_size=block_size,
            chain=block_hashes or None,
            transcript_key=transcript_key or None,
            now=self._clock.now(),
        )

    async def list_retentions(
        self, *, parent: str, node: str, page_size: int, page_token: str
    ) -> tuple[list[Retention], str]:
        tenant, conversation = parse_tenant_or_conversation(
            parent, "parent", max_length=self._limits.max_id_length
        )
        if node:
            self._check.node_name(node, "node")
        scope = f"{parent}|{node}"
        size, after = self._check.page(page_size, page_token, scope)
        conv_name = f"tenants/{tenant}/conversations/{conversation}" if conversation else None
        retentions = await self._store.list_retentions(
            tenant=tenant, conversation=conv_name, node=node or None, after=after, limit=size
        )
        return retentions, self._check.next_token(scope, [r.name for r in retentions], size)


def _check_key(key: bytes, field_name: str) -> None:
    if not 16 <= len(key) <= 64:
        raise InvalidArgument(field_name, "must be 16 to 64 bytes")
