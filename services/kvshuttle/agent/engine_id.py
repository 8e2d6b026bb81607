"""The engine id from a file (node.engine_id_file), waited for at start and followed after.

Whatever starts the engine beside the agent (in Kubernetes the vLLM container's entry point)
draws a fresh NixlConnector engine id at every start and writes it to the file, replacing it
whole (write a temporary file, rename it over). A new id means a new engine: readers cache a
remote engine's NIXL metadata by its id, and the old engine's KV is gone with it. The agent
reads the file every `interval`; on a change it calls `on_change(new_id)`, which registers the
node again with the new id (kvshuttle.agent.agent.Agent.follow_engine).

A file that is missing, empty or holds no valid id is not followed: the agent keeps the id it
has (and says so at warning, once per distinct content) until a valid one appears.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from kvshuttle.core.errors import FailedPrecondition, InvalidArgument
from kvshuttle.core.names import check_id

__all__ = ["EngineIdWatcher", "read_engine_id", "wait_for_engine_id"]

log = structlog.get_logger("kvshuttle.agent")

# Seconds between "still waiting" logs at start.
_WAITING_LOG_EVERY = 30.0
# An id file is one line: more than this is no id file.
_MAX_FILE_BYTES = 4096


class BadEngineId(ValueError):
    """The file holds something that is no engine id."""


def read_engine_id(path: Path) -> str | None:
    """The id in `path` (surrounding whitespace dropped); None while the file is missing or
    empty. Raises BadEngineId for content that is no valid id."""
    try:
        with path.open("rb") as file:
            raw = file.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(raw) > _MAX_FILE_BYTES:
        raise BadEngineId(f"{path} is over {_MAX_FILE_BYTES} bytes: not an engine id")
    text = raw.decode(errors="replace").strip()
    if not text:
        return None
    try:
        return check_id(text, "node.engine_id_file")
    except InvalidArgument as exc:
        raise BadEngineId(f"{path}: {exc.message}") from exc


async def wait_for_engine_id(path: Path, *, wait_s: float, interval: float) -> str:
    """The id in `path` once there is one. Raises FailedPrecondition after `wait_s` seconds
    without one (the agent refuses to start; its supervisor starts it again)."""
    started = time.monotonic()
    logged_at = started - _WAITING_LOG_EVERY
    while True:
        problem = "no such file or empty"
        try:
            engine_id = read_engine_id(path)
        except BadEngineId as exc:
            engine_id, problem = None, str(exc)
        if engine_id is not None:
            waited = time.monotonic() - started
            log.info("agent.engine_id_read", file=str(path), engine_id=engine_id, waited_s=round(waited, 3))
            return engine_id
        now = time.monotonic()
        if now - started >= wait_s:
            raise FailedPrecondition(f"no engine id in {path} after {wait_s:g} s ({problem})")
        if now - logged_at >= _WAITING_LOG_EVERY:
            logged_at = now
            log.info("agent.engine_id_waiting", file=str(path), problem=problem, wait_s=wait_s)
        await asyncio.sleep(min(interval, max(0.0, wait_s - (now - started))))


class EngineIdWatcher:
    """Reads `path` every `interval` and calls `on_change(id)` when it holds a new valid id.
    `current` is the id the agent registered at start."""

    def __init__(
        self,
        path: Path,
        current: str,
        on_change: Callable[[str], Awaitable[None]],
        *,
        interval: float,
    ) -> None:
        self._path = path
        self.current = current
        self._on_change = on_change
        self._interval = interval
        self._reported: str | None = None  # the last problem logged, so it is logged once
        self.changes = 0

    async def check(self) -> bool:
        """One read; True when the id changed (and `on_change` ran)."""
        try:
            engine_id = read_engine_id(self._path)
        except BadEngineId as exc:
            self._report(str(exc))
            return False
        if engine_id is None:
            self._report(f"{self._path} is missing or empty")
            return False
        self._reported = None
        if engine_id == self.current:
            return False
        log.warning(
            "agent.engine_id_changed", file=str(self._path), previous=self.current, engine_id=engine_id
        )
        # Taken as current once followed: a follow that failed is tried again at the next read.
        await self._on_change(engine_id)
        self.current = engine_id
        self.changes += 1
        return True

    def _report(self, problem: str) -> None:
        if problem != self._reported:
            self._reported = problem
            log.warning("agent.engine_id_unreadable", problem=problem, keeping=self.current)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.check()
