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
import selectors
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

__all__ = ["VirtualTimeError", "VirtualTimeLoop", "run"]

T = TypeVar("T")


class VirtualTimeError(RuntimeError):
    """The simulation asked for something outside virtual time (a socket, a thread), or waits
    on something that can never happen."""


class _Clock:
    def __init__(self, start: float) -> None:
        self.now = start


class _JumpingSelector(selectors.DefaultSelector):
    """The loop's selector: no file descriptor is ever ready, and waiting `timeout` seconds
    advances the virtual clock by that much at once. The loop's own self-pipe stays registered
    (asyncio needs it), but nothing writes to it: no thread or signal reaches this loop."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise VirtualTimeError("deadlock: nothing is ready and no timer is set")
        if timeout > 0:
            self._clock.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        self._virtual = _Clock(start)
        super().__init__(_JumpingSelector(self._virtual))
        # Timers within this of now run now: float noise must not cost an extra iteration.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._virtual.now

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
