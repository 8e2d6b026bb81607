"""Virtual time: an asyncio event loop whose clock jumps to the next timer instead of waiting.

`run(main(), start=...)` runs a coroutine on a `VirtualTimeLoop`: callbacks run exactly as on a
real loop, in the same order, but when nothing is ready the loop's clock (`loop.time()`, hence
`asyncio.sleep`, `asyncio.timeout`, `call_at`) moves straight to the earliest timer. Nothing
waits on the wall clock, so a simulated hour costs only the CPU of what happens in it, and a run
is a function of its inputs alone: every policy gets identical footing, and the same seed gives
the same records.

What would make time depend on the world is refused: sockets, subprocesses, threads and
executors (`asyncio.to_thread`, `run_in_executor`) raise `VirtualTimeError`. A loop with nothing
ready and no timer left would block forever on a real selector; here that is a deadlock and
raises too.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import math
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, Final, NoReturn, TypeVar

__all__ = ["VirtualTimeError", "VirtualTimeLoop", "run"]

T = TypeVar("T")
_MAX_WAIT_S: Final = 24 * 3600.0  # asyncio's cap on one wait (base_events.MAXIMUM_SELECT_TIMEOUT)


class VirtualTimeError(RuntimeError):
    """The simulation asked for something outside virtual time (a socket, a thread), or waits
    on something that can never happen."""


class _Clock:
    def __init__(self, start: float) -> None:
        self.now = start


class _JumpingSelector(selectors.DefaultSelector):
    """The loop's selector: no file descriptor is ever ready, and waiting for the next timer
    moves the virtual clock onto that timer's time at once. The loop's own self-pipe stays
    registered (asyncio needs it), but nothing writes to it: no thread or signal reaches this
    loop."""

    def __init__(self, clock: _Clock, next_timer: Callable[[], float]) -> None:
        super().__init__()
        self._clock = clock
        self._next_timer = next_timer

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise VirtualTimeError("deadlock: nothing is ready and no timer is set")
        if timeout > 0:
            # The timer's own time, not now + (when - now): that sum can miss it by a rounding,
            # and which roundings happen would depend on which other timers the clock stopped at.
            self._clock.now = self._next_timer() if timeout < _MAX_WAIT_S else self._clock.now + timeout
        return []


class _Timer(asyncio.TimerHandle):
    """A timer that runs after those set before it for the same instant. asyncio's heap orders
    timers by time alone, so same-instant timers run in an order that depends on every other
    timer in the heap: a run's records would change with how many timers the simulator uses."""

    __slots__ = ("_seq",)

    def __init__(
        self,
        when: float,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop,
        context: contextvars.Context | None,
        seq: int,
    ) -> None:
        super().__init__(when, callback, args, loop, context)
        self._seq = seq

    def __lt__(self, other: _Timer) -> bool:  # type: ignore[override]
        when, other_when = self._when, other._when  # type: ignore[attr-defined]
        return bool(when < other_when or (when == other_when and self._seq < other._seq))


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        self._virtual = _Clock(start)
        super().__init__(_JumpingSelector(self._virtual, self._next_timer))
        self._timer_seq = itertools.count()
        self._last_timer: asyncio.TimerHandle | None = None

    def time(self) -> float:
        return self._virtual.now

    # asyncio runs the timers due before now + `_clock_resolution`: one ulp runs those due now
    # and none later. A wider window would run a timer early whenever another one stopped the
    # clock just before it, and the timers set from there would be off by as much.
    @property
    def _clock_resolution(self) -> float:
        return math.ulp(self._virtual.now)

    @_clock_resolution.setter
    def _clock_resolution(self, _: float) -> None:
        pass  # asyncio's own (the wall clock's resolution) has no meaning here

    def _next_timer(self) -> float:
        when: float = self._scheduled[0]._when  # type: ignore[attr-defined]
        return when

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        self._check_closed()  # type: ignore[attr-defined]
        timer = _Timer(when, callback, args, self, context, next(self._timer_seq))
        heapq.heappush(self._scheduled, timer)  # type: ignore[attr-defined]
        timer._scheduled = True  # type: ignore[attr-defined]
        self._last_timer = timer
        return timer

    def is_last_timer(self, timer: asyncio.TimerHandle) -> bool:
        """Whether no timer was set after `timer`: work added to its callback now runs exactly
        where a timer of its own, set now for the same time, would."""
        return timer is self._last_timer

    def _refuse(self, what: str) -> NoReturn:
        raise VirtualTimeError(f"{what} has no place in virtual time")

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> NoReturn:  # type: ignore[override]
        self._refuse("a thread (run_in_executor, to_thread)")

    async def create_connection(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("a socket (create_connection)")

    async def create_server(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("a socket (create_server)")

    async def create_datagram_endpoint(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("a socket (create_datagram_endpoint)")

    async def getaddrinfo(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("name resolution (getaddrinfo)")

    async def subprocess_exec(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("a subprocess")

    async def subprocess_shell(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("a subprocess")


def run(main: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run `main` to its end on a fresh virtual-time loop starting at `start` seconds; the loop
    is closed after (its unfinished tasks cancelled, as asyncio.run does)."""
    loop = VirtualTimeLoop(start)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
