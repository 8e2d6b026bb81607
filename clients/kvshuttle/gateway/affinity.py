"""Which router replica serves a conversation: rendezvous (highest-random-weight) hashing.

A router replica remembers what it served (router/turn_memory.py): the retention its last
commit stored (so the next plan claims without reading the registry) and the known tokens of
the last answer (so reuse is cut token for token, not at a block boundary). Neither is in the
registry, so a conversation's turns go to one replica: each replica's weight for a conversation
is a hash of the conversation's digest and the replica's address, and the conversation goes to
the replica of the highest weight. Every gateway given the same addresses (in any order) picks
the same replica, and losing a replica moves only the conversations it had, each to the replica
of its next weight.

The conversation enters only as a keyed digest (BLAKE2b under a key every gateway shares), which
is also all that a log line shows of it.

A replica whose call failed in transport (it did not answer) is passed over for a backoff that
doubles with each failure in a row, up to a bound, and is tried again when it ends: the first
call that succeeds brings it back, with its conversations.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Replicas", "affinity_key"]

_KEY_LABEL = b"kvshuttle.gateway.router-affinity"


def affinity_key(cache_salt_key: bytes | None) -> bytes:
    """The digest's key: from the cache-salt key, which every gateway replica shares already;
    without one, a fixed key, so that gateways still agree (the weights are then predictable,
    which only lets a client steer its own conversations)."""
    if cache_salt_key is None:
        return _KEY_LABEL
    return hmac.new(cache_salt_key, _KEY_LABEL, hashlib.sha256).digest()


@dataclass(slots=True)
class _Health:
    failures: int = 0
    down_until: float = 0.0


class Replicas:
    """The router replicas of one gateway, their order for each conversation and their health.

    `key`: the digest's key (the same on every gateway); `backoff_s` .. `max_backoff_s`: how
    long a replica that failed is passed over, doubling per failure in a row; `clock`: seconds,
    monotonic."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        key: bytes,
        backoff_s: float,
        max_backoff_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not addresses or len(set(addresses)) != len(addresses):
            raise ValueError("replicas: give at least one address, each once")
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError("replicas: 0 < backoff_s <= max_backoff_s")
        self.addresses = tuple(addresses)
        self._key = hashlib.blake2b(key, digest_size=32).digest()  # any length in, 32 bytes out
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self._health = {address: _Health() for address in self.addresses}

    def digest(self, conversation: str) -> bytes:
        """The conversation's keyed digest (16 bytes): what its weights hash, and what logs show."""
        return hashlib.blake2b(conversation.encode(), key=self._key, digest_size=16).digest()

    def ranked(self, conversation: str) -> list[str]:
        """Every replica, highest weight for `conversation` first, health aside."""
        digest = self.digest(conversation)

        def weight(address: str) -> bytes:
            return hashlib.blake2b(digest + address.encode(), digest_size=8).digest()

        return sorted(self.addresses, key=weight, reverse=True)

    def order(self, conversation: str) -> list[str]:
        """The replicas to try for `conversation`: those up in rank order, then those passed
        over (a last resort before the turn goes without the router), in rank order too."""
        now = self._clock()
        ranked = self.ranked(conversation)
        up = [a for a in ranked if self._health[a].down_until <= now]
        return up + [a for a in ranked if self._health[a].down_until > now]

    def up(self, address: str) -> bool:
        return self._health[address].down_until <= self._clock()

    def failed(self, address: str) -> float:
        """The replica did not answer: passed over for the returned seconds."""
        health = self._health[address]
        health.failures += 1
        backoff = min(self._max_backoff_s, self._backoff_s * float(2 ** min(health.failures - 1, 30)))
        health.down_until = self._clock() + backoff
        return backoff

    def succeeded(self, address: str) -> None:
        """The replica answered (whatever the answer): up again, its backoff reset."""
        health = self._health[address]
        health.failures, health.down_until = 0, 0.0
