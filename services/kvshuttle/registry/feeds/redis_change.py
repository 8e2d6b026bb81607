"""The change feed on Redis (kvshuttle.registry.feeds.change): one Redis Stream, `{P}:changes` (P the key
prefix, as the hash tag: the global slot), shared by every registry replica over one Redis, so
each replica's WatchRetentions streams the changes of all replicas in one order.

Why a Stream and not pub/sub: a Stream keeps its entries (persisted with the rest, AOF included)
and each has an id, so a watcher that reconnects replays from its last id (its resume token)
what it missed, an expiry included. Pub/sub delivers only to who is subscribed at that moment:
what a disconnected subscriber (a watcher, or a replica's reader during a reconnect) missed is
gone, with no way to even know it was missed.

- `publish`: XADD of each change, `MAXLEN ~ maxlen` (the stream is bounded by count; each entry
  is the WatchRetentionsResponse convert.change_to_pb writes, i.e. the Retention pb with its
  block hashes and kv_transfer_params, the change kind, time and previous_node, so memory is
  about maxlen times the mean retention's size). A replica's own changes reach its watchers
  through the stream too: one path, one order.
- `run`: the reader, one task per replica: XREAD BLOCK from the last id it delivered, and each
  change fanned out to this replica's watchers (kvshuttle.registry.feeds.watchers). After a lost
  connection it carries on from that id: nothing is skipped unless trimmed meanwhile, in which
  case (or when the stream went back, as after a Redis restart without persistence) every
  local watcher's stream ends with FAILED_PRECONDITION (WATCH_RESUME_EXPIRED).
- `replay`: the entries after a token, by XRANGE in pages, each page read in one script
  together with the check that the entry the token (or the previous page) names is still in
  the stream. The stream only loses its oldest entries (trimming; nothing is XDEL'd), so while
  that entry is there, everything after it is: the replay is gapless. Otherwise the token is
  refused: FAILED_PRECONDITION (WATCH_RESUME_EXPIRED): the watcher is further behind than
  about `maxlen` changes (its change was trimmed), or the token is of another stream or of one
  that was lost; it lists again, then watches without a token. (Conservative by one: the token
  of the newest trimmed entry is refused too. Redis 7.0's XINFO `max-deleted-entry-id`, which
  would say exactly, is not moved by trimming.)

The crash window, honestly: the XADD follows the store's script, as a separate command. The
stream key lives in another hash slot than the conversation's keys, so a Cluster-safe script
cannot do both. A replica that dies (or loses Redis) between the two loses that change's event:
the state itself is safe (the store's script committed it), but no watcher hears of it. A
failed XADD is logged and counted (`RegistryStats.feed_errors`), never failing the operation
that already committed. Watchers that must not miss anything re-list after every reconnect
(and use the token only to bound what they must re-read in the common case).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, cast

import structlog

from kvshuttle.core.cancellation import raise_if_cancelled
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.registry.api import convert
from kvshuttle.registry.feeds.change import Deliver, Fail, resume_expired
from kvshuttle.registry.feeds.watchers import Position
from kvshuttle.registry.model import RetentionChange
from kvshuttle.registry.store.redis.codec import RedisClient, scripting
from kvshuttle.registry.v1 import registry_service_pb2 as pb

__all__ = ["RedisFeed"]

log = structlog.get_logger("kvshuttle.registry")

_FIELD = b"c"
_PAGE = 1000
_ID = re.compile(r"^(\d{1,20})-(\d{1,20})$")
_U64 = 2**64

# One page of a replay, read with the check that makes it gapless, at one instant: the stream
# only ever loses its oldest entries (MAXLEN trimming; nothing is XDEL'd), so while the entry a
# token names is still there, every entry after it is. ARGV[1] '0-0' (a reader that has delivered
# nothing yet) needs no check.
_READ = """
if ARGV[1] ~= '0-0' and #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then
  return {'gone'}
end
local count = tonumber(ARGV[2])
if count == 0 then return {'ok', {}} end
return {'ok', redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', count)}
"""
# The id the stream would put the next entry after ('0-0': no stream).
_LAST = """
if redis.call('EXISTS', KEYS[1]) == 0 then return '0-0' end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then return info[i + 1] end
end
return '0-0'
"""


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _position(token: str) -> Position:
    m = _ID.match(token)
    if m is None or int(m[1]) >= _U64 or int(m[2]) >= _U64:
        raise InvalidArgument("resume_token", "malformed")
    return int(m[1]), int(m[2])


class RedisFeed:
    """See the module docstring. `client` must be created with decode_responses=False."""

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str = "kvshuttle",
        maxlen: int = 100_000,
        block_ms: int = 1000,
    ) -> None:
        if not prefix or any(c in prefix for c in "{}"):
            raise ValueError("the key prefix must be non-empty and without braces")
        if maxlen <= 0:
            raise ValueError("maxlen must be positive")
        self._redis = client
        self.key = f"{{{prefix}}}:changes"
        self._maxlen = maxlen
        self._block_ms = block_ms
        self._read = scripting(client).register_script(_READ)
        self._last = scripting(client).register_script(_LAST)
        self._deliver: Deliver | None = None
        self._fail: Fail | None = None
        self.started = asyncio.Event()  # the reader has its starting id

    def bind(self, deliver: Deliver, fail: Fail) -> None:
        self._deliver, self._fail = deliver, fail

    async def publish(self, changes: Sequence[RetentionChange]) -> int:
        if not changes:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for change in changes:
            entry = convert.change_to_pb(change).SerializeToString()
            pipe.xadd(self.key, {_FIELD: entry}, maxlen=self._maxlen, approximate=True)
        try:
            await pipe.execute()
        except Exception as exc:  # the operation committed: its event is lost, not the state
            log.warning("feed.publish_failed", changes=len(changes), error=repr(exc))
            return len(changes)
        return 0

    def position(self, token: str) -> Position:
        return _position(token)

    async def _page(self, after: str, count: int) -> list[Any] | None:
        """Up to `count` entries after `after`; None if the stream no longer holds `after`."""
        out = await cast("Awaitable[list[Any]]", self._read(keys=[self.key], args=[after, count]))
        return None if as_str(out[0]) == "gone" else list(out[1])

    async def _last_id(self) -> str:
        return as_str(await cast("Awaitable[bytes]", self._last(keys=[self.key])))

    def _decode(self, entries: Sequence[Any]) -> list[RetentionChange]:
        out: list[RetentionChange] = []
        for raw_id, raw in entries:
            token = as_str(raw_id)
            # From the script: a flat list of pairs; from XREAD: a dict.
            fields = {raw[i]: raw[i + 1] for i in range(0, len(raw), 2)} if isinstance(raw, list) else raw
            try:
                data = bytes(fields[_FIELD])
                out.append(convert.change_from_pb(pb.WatchRetentionsResponse.FromString(data), token))
            except Exception as exc:  # not ours: skipped, never fatal to the feed
                log.warning("feed.bad_entry", id=token, error=repr(exc))
        return out

    async def replay(self, after: str) -> AsyncIterator[Sequence[RetentionChange]]:
        _position(after)
        cursor = after
        while True:
            entries = await self._page(cursor, _PAGE)
            if entries is None:
                raise resume_expired(
                    "is no longer in the change stream (further behind than it holds, or of another)"
                )
            if not entries:
                return
            yield self._decode(entries)
            if len(entries) < _PAGE:
                return
            cursor = as_str(entries[-1][0])

    async def _check_gap(self, last_id: str) -> str:
        """After a lost connection: where to carry on from, ending the local watchers' streams
        if the stream no longer holds what follows `last_id`."""
        if await self._page(last_id, 0) is not None:
            return last_id
        log.warning("feed.gap", last_delivered=last_id)
        if self._fail is not None:
            self._fail(resume_expired("lost: the change stream no longer holds what followed"))
        return await self._last_id()

    async def run(self) -> None:
        """The reader: see the module docstring. Runs until cancelled."""
        last_id: str | None = None
        delay = 0.1
        broken = False
        while True:
            raise_if_cancelled()  # a cancel redis-py swallowed (kvshuttle.core.cancellation)
            try:
                if last_id is None:
                    last_id = await self._last_id()
                    self.started.set()
                elif broken:
                    last_id = await self._check_gap(last_id)
                broken = False
                found = await self._redis.xread({self.key: last_id}, count=_PAGE, block=self._block_ms)
                delay = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                broken = True
                log.warning("feed.read_failed", error=repr(exc), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            for _key, entries in found or ():
                if not entries:
                    continue
                last_id = as_str(entries[-1][0])
                changes = self._decode(entries)
                if changes and self._deliver is not None:
                    self._deliver(changes)

    def close(self) -> None:
        pass
