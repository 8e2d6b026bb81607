"""Retentions lost: what the registry held for each conversation before a fault, compared with
what it holds after.

A conversation's retention of generation g, seen before the fault, is kept when afterwards the
registry still holds a retention of generation >= g, or its fence passed g (a later turn was put
over it, whatever became of that one since). Otherwise the fault lost it: a store that forgot an
acknowledged write. (Read the "after" side soon after the fault: a claimed retention whose turn
never committed is removed when its claim lapses, by design.)
"""

from __future__ import annotations

from dataclasses import dataclass

from deploy.local.stack import KvshuttleStack
from tests.chaos.workload import full_name


@dataclass(frozen=True)
class Held:
    fence: int  # the conversation's fence generation (0: the registry knows no such conversation)
    retention: int  # the live retention's generation (0: none)


def held(stack: KvshuttleStack, conversations: list[str]) -> dict[str, Held]:
    """The registry's view of each conversation now (asks the registry replicas in turn)."""
    out: dict[str, Held] = {}
    for conversation in conversations:
        got = stack.conversation(full_name(conversation))
        if got is None:
            out[conversation] = Held(0, 0)
        else:
            retention = got.retention.generation if got.HasField("retention") else 0
            out[conversation] = Held(got.fence_generation, retention)
    return out


def lost(before: dict[str, Held], after: dict[str, Held]) -> list[str]:
    """The conversations whose retention `before` is neither held nor superseded `after`."""
    gone = []
    for conversation, was in before.items():
        if not was.retention:
            continue
        now = after.get(conversation, Held(0, 0))
        if now.retention < was.retention and now.fence <= was.retention:
            gone.append(conversation)
    return gone
