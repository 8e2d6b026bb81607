"""A loop that runs until cancelled, kept to it on Python 3.11.

There, `asyncio.wait_for` returns the inner call's result instead of raising CancelledError when
the task is cancelled in the step the inner call finished (CPython gh-86296; 3.12 rebuilt
wait_for on asyncio.timeout). redis-py sends every command under wait_for when the client has a
socket timeout, so a reader cancelled as it sends its next read (right after handing a change to
a waiting watcher: the usual moment) carries on reading, and whoever awaits its end waits
forever. The cancel request still shows in `Task.cancelling()`: the loop checks it each turn.
"""

from __future__ import annotations

import asyncio

__all__ = ["raise_if_cancelled"]


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task was asked to stop (and nothing withdrew that)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
