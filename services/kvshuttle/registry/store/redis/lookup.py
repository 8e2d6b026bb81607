"""The Redis store's find_retention (kvshuttle.registry.store.redis.store): a tenant's retentions
found by what they hold, through the tenant's two index hashes (kvshuttle.registry.store.redis.keys
`lookup`): chain ends, (model, block size, the chain's last hash or its prompt's) -> retention
name, and transcript keys,
(model, key) -> retention name. Each entry is a hint: the record it names decides (it exists, it
is still the one that owns the entry, its lease has not lapsed, it holds what was asked for). An
entry whose record is gone or no longer owns it is skipped and deleted (only if it still names
that retention); one whose record has lapsed but is not swept yet is skipped and kept (the sweep
retires it with its entries)."""

from __future__ import annotations

from array import array
from collections.abc import Awaitable
from typing import cast

from kvshuttle.registry.model import Found, Retention
from kvshuttle.registry.store.errors import retention_not_found
from kvshuttle.registry.store.redis.codec import (
    as_str,
    end_field,
    key_field,
    lookup_args,
    reachable,
)
from kvshuttle.registry.store.redis.shared import RedisShared


class RedisLookup:
    """find_retention over the tenant's index hashes (see the module docstring)."""

    def __init__(self, shared: RedisShared) -> None:
        self._shared = shared
        self._redis = shared.client
        self._keys = shared.keys

    @reachable
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
        keys = self._keys.lookup(tenant)
        if chain is not None:
            fields = [end_field(model, block_size, h) for h in chain]
            names = await self._hmget(keys[0], fields)
            # From the longest prefix: the first whose record's chain starts with chain[:i + 1].
            for i in range(len(chain) - 1, -1, -1):
                raw = names[i]
                if raw is None:
                    continue
                record = await self._verified(tenant, as_str(raw), now, (fields[i], b""))
                if record is not None and record.block_hashes[: i + 1] == chain[: i + 1]:
                    return Found(record, i + 1)
        elif transcript_key is not None:
            field = key_field(model, transcript_key)
            (raw,) = await self._hmget(keys[1], [field])
            if raw is not None:
                record = await self._verified(tenant, as_str(raw), now, (b"", field))
                if record is not None:
                    return Found(record)
        raise retention_not_found(f"tenants/{tenant}")

    async def _hmget(self, key: str, fields: list[bytes]) -> list[bytes | None]:
        if not fields:
            return []
        return await cast("Awaitable[list[bytes | None]]", self._redis.hmget(key, fields))

    async def _verified(
        self, tenant: str, name: str, now: float, entry: tuple[bytes, bytes]
    ) -> Retention | None:
        """The record `name` if it owns `entry` (the chain-end field or the transcript-key field
        that named it, the other b"") and its lease has not lapsed. An entry no record backs (the
        record gone, replaced, another tenant's, or no longer the entry's owner) is deleted if it
        still names `name`; a lapsed record's entry is left to its sweep."""
        record = None
        if name.startswith(f"tenants/{tenant}/"):
            record = await self._shared.read_retention(name)
        if record is None or not _owns(record, entry):
            await self._shared.run("unindex", self._keys.lookup(tenant), [name, *entry, b""])
            return None
        return record if record.expire_at > now else None


def _owns(record: Retention, entry: tuple[bytes, bytes]) -> bool:
    """Whether `record`'s own index entries include `entry`'s field."""
    _, end, key, prompt_end = lookup_args(record)
    return (entry[0] != b"" and entry[0] in (end, prompt_end)) or (entry[1] != b"" and key == entry[1])
