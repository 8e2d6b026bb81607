"""A KV link between engines (NixlConnector's READ), timed by an engine profile's `[profile.link]`:
a read of n bytes takes the link's fixed cost, then moves its bytes at the bandwidth the reads
overlapping on the link share equally (processor sharing: n active reads get bandwidth / n each),
so two equal reads together take about twice as long as one alone.

`ProcessorSharing` is the pure part (the caller's clock, in seconds); `Link` drives it in an event
loop, with time scaled by `time_scale` (0.1: ten times faster than the profile's hardware).
"""

from __future__ import annotations

import asyncio
from typing import Final, Generic, TypeVar

from kvshuttle.router.cost import LinkModel

__all__ = ["Link", "ProcessorSharing"]

_Key = TypeVar("_Key")
# A transfer this close to its end is done: the loop's clock, divided by a time scale, is off by
# a little, and a wake-up a nanosecond early must not become another wake-up.
_SLACK_S: Final = 1e-9


class ProcessorSharing(Generic[_Key]):
    """Transfers sharing `bytes_per_s` equally, advanced by the caller's clock."""

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError("bandwidth must be positive")
        self.bytes_per_s = bytes_per_s
        self._left: dict[_Key, float] = {}  # bytes still to move
        self._at = 0.0  # when `_left` was last brought up to date

    def __len__(self) -> int:
        return len(self._left)

    def add(self, key: _Key, nbytes: float, now: float) -> list[_Key]:
        """A transfer joins at `now`; the ones that finished by then (and left)."""
        done = self.advance(now)
        self._left[key] = float(nbytes)
        return done

    def remove(self, key: _Key, now: float) -> list[_Key]:
        """A transfer given up (its reader went away): the others speed up. The ones that
        finished by `now` (and left)."""
        done = self.advance(now)
        self._left.pop(key, None)
        return done

    def advance(self, now: float) -> list[_Key]:
        """Move every transfer on to `now`; the ones that finished (and left)."""
        if self._left and now > self._at:
            moved = (now - self._at) * self.bytes_per_s / len(self._left)
            for key in self._left:
                self._left[key] -= moved
        self._at = max(self._at, now)
        slack = self.bytes_per_s * _SLACK_S
        done = [key for key, left in self._left.items() if left <= slack]
        for key in done:
            del self._left[key]
        return done

    def next_done(self) -> float | None:
        """When the first active transfer finishes if nothing joins or leaves."""
        if not self._left:
            return None
        return self._at + min(self._left.values()) * len(self._left) / self.bytes_per_s


class Link:
    """One link in an event loop: `await transfer(nbytes)` takes the modelled time."""

    def __init__(self, model: LinkModel, *, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.model = model
        self.time_scale = time_scale
        self._sharing: ProcessorSharing[asyncio.Future[None]] = ProcessorSharing(model.bandwidth_gb_s * 1e9)
        self._timer: asyncio.TimerHandle | None = None
        self.transfers = 0
        self.bytes_moved = 0

    def _now(self) -> float:
        """The link's clock: the loop's, in profile seconds."""
        return asyncio.get_running_loop().time() / self.time_scale

    async def transfer(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        await asyncio.sleep(self.model.fixed_ms / 1e3 * self.time_scale)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Joining (or leaving) brings the others up to now: those it finds finished are done.
        self._finish(self._sharing.add(done, nbytes, self._now()))
        self._schedule()
        try:
            await done
        except asyncio.CancelledError:
            self._finish(self._sharing.remove(done, self._now()))
            self._schedule()
            raise
        self.transfers += 1
        self.bytes_moved += nbytes

    @staticmethod
    def _finish(futures: list[asyncio.Future[None]]) -> None:
        for future in futures:
            if not future.done():
                future.set_result(None)

    def _schedule(self) -> None:
        """Finish what is due; wake again when the next transfer will be."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._finish(self._sharing.advance(self._now()))
        at = self._sharing.next_done()
        if at is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(at * self.time_scale, self._schedule)
