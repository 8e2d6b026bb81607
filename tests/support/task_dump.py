"""On a pytest-timeout, the stack of every asyncio task as well as every thread's, so a hung async
test says which await it hangs on; and the test's event loop stopped, so the timeout fails it
even where the loop swallows the timeout's exception.

pytest-timeout dumps the threads only: for an async test that is the event loop idling in
select(), which names no await. Here its `pytest_timeout_set_timer` is wrapped: with the signal
method (this project's), the SIGALRM handler it installs is preceded by a dump of the running
loop's tasks, each as its chain of awaits down to the future it waits on (Task.print_stack shows
only a suspended task's outermost frame). With the thread method the loop belongs to another
thread and is left alone.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import traceback
from collections.abc import Generator
from types import FrameType
from typing import Any

import pytest

__all__ = ["format_tasks", "pytest_timeout_set_timer"]

_MAX_DEPTH = 100  # awaits followed down one task's chain


def _await_chain(task: asyncio.Task[Any]) -> list[FrameType]:
    """The frames of the coroutines `task` is suspended in, outermost first."""
    frames: list[FrameType] = []
    awaited: object | None = task.get_coro()
    for _ in range(_MAX_DEPTH):
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        frame = frame or getattr(awaited, "ag_frame", None)
        if frame is None:
            break
        frames.append(frame)
        nxt = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        awaited = nxt or getattr(awaited, "ag_await", None)
    return frames


def format_tasks(loop: asyncio.AbstractEventLoop) -> str:
    """Every task of `loop`: its repr (with the future it waits for), its awaits (file:line,
    innermost last) and the object the innermost one is a method of (a Lock with its waiters,
    a Connection, ...)."""
    lines: list[str] = []
    for task in sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name()):
        lines.append(f"--- {task!r}")
        frames = _await_chain(task)
        summary = traceback.StackSummary.extract((f, f.f_lineno) for f in frames)
        lines.extend(line.rstrip("\n") for line in summary.format())
        if frames and "self" in frames[-1].f_locals:
            lines.append(f"  in {frames[-1].f_locals['self']!r}")
    return "\n".join(lines)


def _dump_then(previous: Any, item: pytest.Item) -> Any:
    def handler(signum: int, frame: FrameType | None) -> None:
        __tracebackhide__ = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None  # a sync test: the threads' stacks say it all
        if loop is not None:
            terminal = item.config.get_terminal_writer()
            terminal.sep("+", title="asyncio tasks at the timeout")
            terminal.write(format_tasks(loop) + "\n")
            terminal.flush()
            # The timeout's exception is raised in whatever frame the signal lands in: inside
            # a callback or another task's step the loop swallows it (logged, the test hangs
            # on). Stopping the loop fails the test either way ("Event loop stopped before
            # Future completed" when the exception was swallowed).
            loop.stop()
        previous(signum, frame)

    return handler


@pytest.hookimpl(wrapper=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> Generator[None, object, object]:
    result = yield
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return result  # pytest-timeout used a timer thread: no handler of its to precede
    installed = signal.getsignal(signal.SIGALRM)
    if callable(installed):
        signal.signal(signal.SIGALRM, _dump_then(installed, item))
    return result
