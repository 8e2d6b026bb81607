"""TurnMemory: bounded tables of one replica's turns, and the commits it is storing."""

from __future__ import annotations

import pytest

from kvshuttle.router.model import CommitResult
from kvshuttle.router.turn_memory import TurnMemory


def test_each_table_keeps_its_latest_entries() -> None:
    memory = TurnMemory(remembered_turns=2, hint_bytes=1 << 20)
    for turn in ("t1", "t2", "t3"):
        memory.finish(turn, "committed")
        memory.remember_commit(turn, "r", CommitResult(f"{turn}-retention", 1.0))
    assert memory.finished("t1") is None and memory.finished("t3") == "committed"
    assert memory.earlier_commit("t1", "r") is None
    assert memory.earlier_commit("t2", "r") == CommitResult("t2-retention", 1.0)
    assert memory.earlier_commit("t2", "other request") is None
    memory.placed("c", "nodes/p0", "nodes/d0")
    assert memory.last_nodes("c") == ("nodes/p0", "nodes/d0")
    assert memory.last_nodes("never planned") == ("", "")


async def test_a_commit_in_flight_is_marked_until_it_is_stored() -> None:
    memory = TurnMemory(remembered_turns=10, hint_bytes=1 << 20)
    assert memory.commit_in_flight("c") is None
    with memory.storing("c"):
        first = memory.commit_in_flight("c")
        assert first is not None and not first.done()
        with memory.storing("c"):  # a later commit of the same conversation takes the mark
            second = memory.commit_in_flight("c")
        assert second is not None and second.done()
        assert memory.commit_in_flight("c") is None
    assert first.done()
    with memory.storing(""):  # nothing to wait for without a conversation
        assert memory.commit_in_flight("") is None


async def test_the_mark_is_cleared_when_the_store_fails() -> None:
    memory = TurnMemory(remembered_turns=10, hint_bytes=1 << 20)
    with pytest.raises(RuntimeError), memory.storing("c"):
        waiting = memory.commit_in_flight("c")
        raise RuntimeError("registry down")
    assert waiting is not None and waiting.done() and memory.commit_in_flight("c") is None
