"""The registry's bounds on every request, all configurable (KVSHUTTLE_REGISTRY_LIMITS__*).
The bounds other services check too default to kvshuttle.core.limits."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvshuttle.core import limits
from kvshuttle.core.errors import InvalidArgument

__all__ = ["RegistryLimits", "TtlRange"]


@dataclass(frozen=True, slots=True)
class TtlRange:
    """The TTLs a request may ask for; an unset (or zero) TTL gets the default."""

    # Seconds: the TTL of a request that asks for none, and the range one may ask for.
    default: float
    minimum: float
    maximum: float

    def pick(self, ttl: float | None, field_name: str) -> float:
        if ttl is None or ttl == 0:
            return self.default
        if not math.isfinite(ttl) or ttl < self.minimum or ttl > self.maximum:
            raise InvalidArgument(field_name, f"must be between {self.minimum:g}s and {self.maximum:g}s")
        return ttl


@dataclass(frozen=True, slots=True)
class RegistryLimits:
    """Bounds on every request."""

    # Request bounds: ids, endpoints, labels, block and hash lists, params bytes, token and KV
    # counts, page sizes, event batches, lookups and watchers (past one: INVALID_ARGUMENT).
    max_id_length: int = limits.MAX_ID_LENGTH
    max_endpoint_length: int = 256
    max_labels: int = 16
    max_label_length: int = 128
    max_block_size: int = limits.MAX_BLOCK_SIZE
    max_block_hashes: int = limits.MAX_BLOCK_HASHES
    max_kv_transfer_params_bytes: int = limits.MAX_KV_TRANSFER_PARAMS_BYTES
    max_num_tokens: int = limits.MAX_NUM_TOKENS
    max_kv_bytes: int = limits.MAX_KV_BYTES
    max_page_size: int = 1000
    default_page_size: int = 100
    max_event_batches: int = limits.MAX_EVENT_BATCHES
    max_events_per_batch: int = limits.MAX_EVENTS_PER_BATCH
    max_event_blocks: int = limits.MAX_EVENT_BLOCKS
    max_lookup_hashes: int = limits.MAX_BLOCK_HASHES
    max_watchers: int = 256
    watch_queue_size: int = 1024
    # Changes the in-memory change feed keeps for watchers resuming (kvshuttle.registry.feeds.change);
    # the Redis feed's bound is RedisSettings.change_stream_maxlen.
    watch_history: int = 1000
    node_ttl: TtlRange = TtlRange(default=10.0, minimum=1.0, maximum=300.0)
    retention_ttl: TtlRange = TtlRange(default=300.0, minimum=1.0, maximum=3600.0)
    claim_ttl: TtlRange = TtlRange(default=30.0, minimum=0.1, maximum=300.0)
