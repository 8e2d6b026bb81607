"""Shared reads of an agent's pool: the forks of one history read one published allocation.

A pool publication is read by the prefill that names its read id (`remote_request_id`) and freed
by that reader's read-done notification: single use, like a decode engine's blocks. A reader
holding a shared claim (the registry's ClaimRetentionRequest.shared) names the read id with its
own suffix instead; the pool counts such a reader's heartbeats and read-done as the
publication's, but its read-done frees nothing: the allocation stays for the next reader until
its own expiry, or until the pool evicts it once the registry dropped the retention.

vLLM carries the id opaquely, splitting a notification at its last colon and a heartbeat's ids
at commas: a suffix holds neither.
"""

from __future__ import annotations

import hashlib
from typing import Final

__all__ = ["SHARED_READ_MARK", "read_of", "shared_read_id"]

SHARED_READ_MARK: Final = ".shared-"


def shared_read_id(read_id: str, claim_id: str) -> str:
    """The id a shared reader holding claim `claim_id` notifies `read_id`'s holder by."""
    return f"{read_id}{SHARED_READ_MARK}{hashlib.sha256(claim_id.encode()).hexdigest()[:16]}"


def read_of(request_id: str) -> tuple[str, bool]:
    """The publication's read id a notification names, and whether a shared reader sent it."""
    read_id, mark, _ = request_id.rpartition(SHARED_READ_MARK)
    return (read_id, True) if mark and read_id else (request_id, False)
