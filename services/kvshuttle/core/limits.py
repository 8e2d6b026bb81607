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
    "MAX_DECODE_ENDPOINTS",
    "MAX_EVENTS_PER_BATCH",
    "MAX_EVENT_BATCHES",
    "MAX_EVENT_BLOCKS",
    "MAX_EVENT_SEQ",
    "MAX_GENERATION",
    "MAX_ID_LENGTH",
    "MAX_KV_BYTES",
    "MAX_KV_BYTES_PER_TOKEN",
    "MAX_KV_TRANSFER_PARAMS_BYTES",
    "MAX_KV_TRANSFER_PARAMS_EXTRA_BYTES",
    "MAX_KV_TRANSFER_PARAMS_EXTRA_KEYS",
    "MAX_NUM_TOKENS",
    "MAX_OUTPUT_TOKENS",
    "MAX_PROMPT_TOKENS",
    "MAX_READY_DECODES",
    "MAX_SEQUENCE_TOKENS",
    "MAX_SHARED_CLAIMS",
]

# Characters of one id in a resource name (tenant, conversation, node).
MAX_ID_LENGTH: Final = 128
# Entries of PlanHints.decode_endpoints (the endpoint picker's subset hint: a pool is a few
# hundred pods), each at most kvshuttle.core.endpoints.MAX_ENDPOINT_LENGTH characters.
MAX_DECODE_ENDPOINTS: Final = 4096
# Decode engines ListReadyDecodes names, at most.
MAX_READY_DECODES: Final = 4096
# Serialized bytes of one retention's kvshuttle.vllm.v1.KvTransferParams (decode's params).
MAX_KV_TRANSFER_PARAMS_BYTES: Final = 64 * 1024
# Of those, the fields kvshuttle does not know (KvTransferParams.extra, vLLM's newer keys passed
# through): top-level keys, and serialized bytes of the Struct.
MAX_KV_TRANSFER_PARAMS_EXTRA_KEYS: Final = 32
MAX_KV_TRANSFER_PARAMS_EXTRA_BYTES: Final = 4096
# Hashes in one retention's chain or one block lookup.
MAX_BLOCK_HASHES: Final = 65_536
# Shared claims live at once on one retention (ClaimRetentionRequest.shared): forks of one
# history read together; more wait for a recompute rather than grow a record without bound.
MAX_SHARED_CLAIMS: Final = 64
# Tokens one engine block may hold.
MAX_BLOCK_SIZE: Final = 4096
# Tokens one retention may hold.
MAX_NUM_TOKENS: Final = 4_194_304
# Tokens of one prompt the router and the gateway accept.
MAX_PROMPT_TOKENS: Final = 262_144
# Tokens one turn's answer may add to its prompt; CommitTurn takes the whole sequence, so a
# prompt at MAX_PROMPT_TOKENS stays committable. A retention holds at most one sequence.
MAX_OUTPUT_TOKENS: Final = 262_144
MAX_SEQUENCE_TOKENS: Final = MAX_PROMPT_TOKENS + MAX_OUTPUT_TOKENS
assert MAX_SEQUENCE_TOKENS <= MAX_NUM_TOKENS
# Integers that are summed, incremented or echoed in uint64 fields stay below 2**63, so that
# one more (the next generation, the next event seq) or a sum of many still fits.
# A conversation's fencing generation (the router plans generation + 1).
MAX_GENERATION: Final = 2**63 - 1
# A KV-event batch's seq (the registry answers next_seq = seq + 1).
MAX_EVENT_SEQ: Final = 2**63 - 1
# KV bytes per token of one engine (all layers), and of one retention: a node's retained bytes
# are a sum of these.
MAX_KV_BYTES_PER_TOKEN: Final = 2**24
MAX_KV_BYTES: Final = MAX_NUM_TOKENS * MAX_KV_BYTES_PER_TOKEN
# KV-event batches in one ReportBlockEvents call, events in one batch, blocks in one event.
MAX_EVENT_BATCHES: Final = 512
MAX_EVENTS_PER_BATCH: Final = 4096
MAX_EVENT_BLOCKS: Final = 4096
