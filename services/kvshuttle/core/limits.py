"""Bounds that more than one service enforces on the same values, defined once.

The registry enforces them on what it stores (its RegistryLimits default to these); the router,
the agent and the gateway check the same values with the same defaults before they send them,
so a caller learns of an oversized field at its own edge with the bound the registry applies.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "MAX_BLOCK_HASHES",
    "MAX_BLOCK_SIZE",
    "MAX_EVENTS_PER_BATCH",
    "MAX_EVENT_BATCHES",
    "MAX_EVENT_BLOCKS",
    "MAX_ID_LENGTH",
    "MAX_KV_TRANSFER_PARAMS_BYTES",
    "MAX_NUM_TOKENS",
    "MAX_PROMPT_TOKENS",
]

# Characters of one id in a resource name (tenant, conversation, node).
MAX_ID_LENGTH: Final = 128
# Serialized bytes of one retention's kvshuttle.vllm.v1.KvTransferParams (decode's params).
MAX_KV_TRANSFER_PARAMS_BYTES: Final = 64 * 1024
# Hashes in one retention's chain or one block lookup.
MAX_BLOCK_HASHES: Final = 65_536
# Tokens one engine block may hold.
MAX_BLOCK_SIZE: Final = 4096
# Tokens one retention may hold.
MAX_NUM_TOKENS: Final = 4_194_304
# Tokens of one prompt the router and the gateway accept.
MAX_PROMPT_TOKENS: Final = 262_144
# KV-event batches in one ReportBlockEvents call, events in one batch, blocks in one event.
MAX_EVENT_BATCHES: Final = 512
MAX_EVENTS_PER_BATCH: Final = 4096
MAX_EVENT_BLOCKS: Final = 4096
