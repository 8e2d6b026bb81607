"""The change feed: where the registry facade hands each applied change (`publish`) and whence
this process's watchers (kvshuttle.registry.feeds.watchers) get them, each with a resume token, in the
feed's one order.

Two feeds:

- `LocalFeed` (the in-memory store): delivers at once, in this process; tokens are a per-process
  counter (`<process epoch>.<seq>`), valid only for the process that issued them. It keeps the
  last `history` changes, so a watcher that reconnects to the same process can resume.
- `kvshuttle.registry.feeds.redis_change.RedisFeed` (the Redis store): one Redis Stream shared by every
  replica, so each replica's watchers see the changes of all of them, in one order.

A token the feed no longer covers (older than what it holds, or of another process or stream)
is refused with FAILED_PRECONDITION (WATCH_RESUME_EXPIRED): the watcher lists again and watches
without one. A malformed token is INVALID_ARGUMENT naming `resume_token`.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Protocol

from kvshuttle.core.errors import FailedPrecondition, InvalidArgument, KvshuttleError
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.feeds.watchers import Position
from kvshuttle.registry.model import RetentionChange

__all__ = ["ChangeFeed", "Deliver", "Fail", "LocalFeed", "resume_expired"]

# This process's fan-out: the feed calls it with changes that carry their tokens.
Deliver = Callable[[Sequence[RetentionChange]], None]
# Ends every watch stream of this process with the error (the feed lost changes they need).
Fail = Callable[[KvshuttleError], None]


def resume_expired(detail: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"resume_token {detail}: list again, then watch without a token",
        reason=ErrorReason.WATCH_RESUME_EXPIRED,
    )


class ChangeFeed(Protocol):
    def bind(self, deliver: Deliver, fail: Fail) -> None:
        """This process's watchers, for the feed to deliver to; called once by the facade."""
        ...

    async def publish(self, changes: Sequence[RetentionChange]) -> int:
        """Append the changes of one applied operation (they reach `deliver` with tokens).
        Returns how many could not be appended (their events are lost; never raises: the
        operation has committed)."""
        ...

    def position(self, token: str) -> Position:
        """A token's place in the feed; InvalidArgument("resume_token") if malformed."""
        ...

    def replay(self, after: str) -> AsyncIterator[Sequence[RetentionChange]]:
        """The changes after token `after`, in pages; FailedPrecondition (WATCH_RESUME_EXPIRED)
        if the feed no longer holds all of them."""
        ...

    async def run(self) -> None:
        """What the feed needs running (a reader), until cancelled."""
        ...

    def close(self) -> None: ...


class LocalFeed:
    """The in-memory feed: see the module docstring."""

    def __init__(self, history: int = 1000) -> None:
        self._epoch = secrets.token_hex(4)
        self._seq = 0
        self._history: deque[RetentionChange] = deque(maxlen=history) if history > 0 else deque(maxlen=0)
        self._deliver: Deliver | None = None

    def bind(self, deliver: Deliver, fail: Fail) -> None:
        self._deliver = deliver

    async def publish(self, changes: Sequence[RetentionChange]) -> int:
        out: list[RetentionChange] = []
        for change in changes:
            self._seq += 1
            out.append(replace(change, token=f"{self._epoch}.{self._seq}"))
        self._history.extend(out)
        if self._deliver is not None:
            self._deliver(out)
        return 0

    def _parse(self, token: str) -> tuple[str, int]:
        epoch, dot, seq = token.partition(".")
        if not dot or not epoch or not seq.isascii() or not seq.isdigit() or len(seq) > 19:
            raise InvalidArgument("resume_token", "malformed")
        return epoch, int(seq)

    def position(self, token: str) -> Position:
        return (self._parse(token)[1],)

    async def replay(self, after: str) -> AsyncIterator[Sequence[RetentionChange]]:
        epoch, seq = self._parse(after)
        if epoch != self._epoch:
            raise resume_expired("is of another registry process")
        first = self._seq - len(self._history) + 1  # the oldest change held
        if seq > self._seq or seq < first - 1:
            raise resume_expired("is older than the changes this registry still holds")
        yield list(self._history)[len(self._history) - (self._seq - seq) :]

    async def run(self) -> None:
        await asyncio.Event().wait()  # nothing to read: changes are delivered as published

    def close(self) -> None:
        pass
