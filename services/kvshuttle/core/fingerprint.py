"""Fingerprints of requests, for request-id idempotency (AIP-155): a request repeated with its
request_id gets its first answer; the same id with another body is refused. Shared by the
registry's idempotency cache and the router's turn memory."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.reasons import ErrorReason

__all__ = ["fingerprint", "request_id_reused"]


def fingerprint(person: bytes, parts: Iterable[bytes | str]) -> bytes:
    """BLAKE2b-128 of `parts` under the domain tag `person`; each part is length-prefixed, so no
    two requests hash alike by shifting bytes from one part to the next."""
    h = hashlib.blake2b(digest_size=16, person=person)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()


def request_id_reused() -> InvalidArgument:
    """What a request gets whose request_id was used before with another body."""
    return InvalidArgument(
        "request_id", "was used before with another request body", reason=ErrorReason.REQUEST_ID_REUSED
    )
