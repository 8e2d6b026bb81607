"""Contexts past a model's limit, cut as a chat or agent client does: keep the system prompt and
the newest history, drop the oldest history.

The rule, per session, turn by turn (a request needs input_tokens + output_tokens <= max_model_len;
the answer's tokens are reserved, never cut):

- The head, the first `head_blocks` trace blocks (the system prompt), always stays.
- Whole trace blocks right after the head are dropped, oldest first. Once a session has dropped
  history it keeps it dropped (the client forgot it): the next turn, which extends the same
  history, drops the same blocks, and its prompt still shares the cut prompt's prefix.
- When the prompt still does not fit, the client drops more, down to `low_water` of the room
  (1.0: the fewest blocks that fit, so every turn past the limit cuts again and loses the cache
  past the head; 0.75: a quarter of slack, so the next turns reuse the cut prompt).
- A turn that does not extend the history the drop was made in (its ids differ at the last
  dropped block) starts afresh: nothing dropped.

The blocks kept after a cut hold the same text at new positions, so they get new prefix-chained
ids (blocks.chain_id), which only a later turn cut at the same place shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from bench.cluster.workload.blocks import chain_id
from bench.cluster.workload.model import Request, Session


class ContextTooLong(ValueError):
    """Even the head, the prompt's last block and the answer do not fit the limit."""


@dataclass(frozen=True, slots=True)
class CutRule:
    max_model_len: int
    head_blocks: int = 1
    low_water: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.low_water <= 1:
            raise ValueError(f"low_water {self.low_water} outside (0, 1]")


def _cut_ids(hash_ids: tuple[int, ...], head: int, end: int) -> tuple[int, ...]:
    kept, previous = list(hash_ids[:head]), hash_ids[head - 1] if head else 0
    for original in hash_ids[end:]:
        previous = chain_id(previous, original)
        kept.append(previous)
    return tuple(kept)


def cut_session(session: Session, rule: CutRule) -> tuple[Session, int]:
    """The session as the client sends it under `rule`, and how many of its requests were cut.
    Raises ContextTooLong for a request no cut can fit."""
    bs, head = session.block_size, rule.head_blocks
    end = head  # blocks [head, end) are dropped
    out: list[Request] = []
    cut = 0
    for i, request in enumerate(session.requests):
        ids, room = request.hash_ids, rule.max_model_len - request.output_tokens
        if end > head and (len(ids) <= end or ids[end - 1] != session.requests[i - 1].hash_ids[end - 1]):
            end = head  # not the history the drop was made in
        if request.input_tokens - (end - head) * bs > room:
            target = math.floor(rule.low_water * room)
            end = max(end, head + math.ceil((request.input_tokens - target) / bs))
            end = max(head, min(end, len(ids) - 1))  # the newest block always stays
        dropped = (end - head) * bs
        if request.input_tokens - dropped > room:
            raise ContextTooLong(
                f"session {session.session_id} request {i}: {request.input_tokens} + "
                f"{request.output_tokens} tokens do not fit {rule.max_model_len} keeping {head} head blocks"
            )
        if end == head:
            out.append(request)
            continue
        cut += 1
        cut_ids = _cut_ids(ids, head, end)
        out.append(replace(request, input_tokens=request.input_tokens - dropped, hash_ids=cut_ids))
    return replace(session, requests=tuple(out)), cut


__all__ = ["ContextTooLong", "CutRule", "cut_session"]
