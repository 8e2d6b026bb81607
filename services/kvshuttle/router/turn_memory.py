"""What one router replica remembers of the turns it served. Nothing here is needed for
correctness across replicas (a turn handle carries what CommitTurn and AbortTurn need, and the
registry's fence decides what was committed); it makes this replica's answers faster and its
retries exact:

* plans and commits by the caller's request id, so a retry whose answer was lost gets the first
  answer again;
* the turns finished here (committed or aborted), so a second commit or abort is refused at once;
* each conversation's last prefill and decode node, a tie-break for its next placement;
* the retention each conversation's last commit here stored (`hints`, see hints.py);
* the commits being stored right now, which a plan of the same conversation waits for.

Each table keeps its last `remembered_turns` entries; hints are bounded by bytes.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from kvshuttle.router.hints import RetentionHints
from kvshuttle.router.model import CommitResult, Plan

T = TypeVar("T")


class _Recent(Generic[T]):
    """The last `limit` entries written, the oldest written first out."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._entries: OrderedDict[str, T] = OrderedDict()

    def get(self, key: str) -> T | None:
        return self._entries.get(key)

    def put(self, key: str, value: T) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self._limit:
            self._entries.popitem(last=False)


class TurnMemory:
    def __init__(self, *, remembered_turns: int, hint_bytes: int) -> None:
        self.hints = RetentionHints(hint_bytes)
        self._plans: _Recent[Plan] = _Recent(remembered_turns)
        self._commits: _Recent[CommitResult] = _Recent(remembered_turns)
        self._finished: _Recent[str] = _Recent(remembered_turns)
        self._nodes: _Recent[tuple[str, str]] = _Recent(remembered_turns)
        self._storing: dict[str, asyncio.Future[None]] = {}

    # A request id is the caller's, unique only within its own turns: plans are scoped by
    # conversation and model, commits by turn.

    def earlier_plan(self, conversation: str, model: str, request_id: str) -> Plan | None:
        return self._plans.get(f"{conversation}|{model}|{request_id}")

    def remember_plan(self, conversation: str, model: str, request_id: str, plan: Plan) -> None:
        self._plans.put(f"{conversation}|{model}|{request_id}", plan)

    def earlier_commit(self, turn_id: str, request_id: str) -> CommitResult | None:
        return self._commits.get(f"{turn_id}|{request_id}")

    def remember_commit(self, turn_id: str, request_id: str, result: CommitResult) -> None:
        self._commits.put(f"{turn_id}|{request_id}", result)

    def finished(self, turn_id: str) -> str | None:
        """How the turn finished here ("committed", "aborted"); None if it did not."""
        return self._finished.get(turn_id)

    def finish(self, turn_id: str, outcome: str) -> None:
        self._finished.put(turn_id, outcome)

    def last_nodes(self, conversation: str) -> tuple[str, str]:
        """The conversation's last (prefill, decode) node planned here; ("", "") if none."""
        return self._nodes.get(conversation) or ("", "")

    def placed(self, conversation: str, prefill: str, decode: str) -> None:
        self._nodes.put(conversation, (prefill, decode))

    def commit_in_flight(self, conversation: str) -> asyncio.Future[None] | None:
        """Done once the conversation's commit being stored here is (None: there is none)."""
        return self._storing.get(conversation)

    @contextmanager
    def storing(self, conversation: str) -> Iterator[None]:
        """Marks the conversation's commit in flight for the block's duration ("": no mark)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if conversation:
            self._storing[conversation] = done
        try:
            yield
        finally:
            done.set_result(None)
            if self._storing.get(conversation) is done:
                del self._storing[conversation]
