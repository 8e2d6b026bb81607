"""What one router replica remembers of the turns it served. Nothing here is needed for
correctness across replicas (a turn handle carries what CommitTurn and AbortTurn need, and the
registry's fence decides what was committed); it makes this replica's answers faster and its
retries exact:

* plans and commits by the caller's request id, so a retry whose answer was lost gets the first
  answer again, each with a fingerprint of its request: the same id with another request body is
  refused (INVALID_ARGUMENT, REQUEST_ID_REUSED, AIP-155), never answered with another's plan;
* the turns finished here (committed or aborted), so a second commit or abort is refused at once;
* each conversation's last prefill and decode node, a tie-break for its next placement;
* the retention each conversation's last commit here stored (`hints`, see hints.py);
* the commits being stored right now, which a plan of the same conversation waits for;
* the prompts of the turns planned here and not yet finished, so that their commits may send
  the output alone (a commit that finds none sends the whole sequence).

Each table keeps its last `remembered_turns` entries; plans (which hold prefill's block ids) and
hints and prompts are bounded by bytes too.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import astuple
from typing import Any, Generic, TypeVar

import numpy as np

from kvshuttle.core.fingerprint import fingerprint, request_id_reused
from kvshuttle.router.hints import RetentionHints
from kvshuttle.router.model import CommitRequest, CommitResult, Plan, PlanRequest
from kvshuttle.vllm.block_ids import block_groups

T = TypeVar("T")


class _Recent(Generic[T]):
    """The last `limit` entries written (and, given `size`, at most `max_bytes` of them by that
    estimate), the oldest written first out."""

    def __init__(self, limit: int, *, max_bytes: int = 0, size: Callable[[T], int] | None = None) -> None:
        self._limit = limit
        self._max_bytes = max_bytes
        self._size = size
        self._entries: OrderedDict[str, tuple[T, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> T | None:
        hit = self._entries.get(key)
        return None if hit is None else hit[0]

    def pop(self, key: str) -> None:
        hit = self._entries.pop(key, None)
        if hit is not None:
            self.nbytes -= hit[1]

    def put(self, key: str, value: T) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        size = self._size(value) if self._size is not None else 0
        self._entries[key] = (value, size)
        self.nbytes += size
        while self._entries and (
            len(self._entries) > self._limit or (self._size is not None and self.nbytes > self._max_bytes)
        ):
            _, (_, dropped) = self._entries.popitem(last=False)
            self.nbytes -= dropped


def _plan_bytes(entry: tuple[bytes, Plan]) -> int:
    """A remembered plan's estimated bytes: mostly prefill's block ids (a Python int and a list
    slot each), the rest a few hundred bytes of fields and the turn handle."""
    plan = entry[1]
    ids = sum(len(g) for g in block_groups(plan.prefill_kv_transfer_params))
    return 1024 + len(plan.turn) + 36 * ids


def plan_fingerprint(req: PlanRequest, tokens: np.ndarray[Any, Any]) -> bytes:
    """What identifies a PlanTurn request: every field of it (the checked token ids as uint32)."""
    header = json.dumps(
        [
            req.model,
            req.conversation,
            req.parent_conversation,
            req.expected_think_time_s,
            req.disable_reuse,
            req.cache_salt_sha256.hex(),
            list(req.decode_endpoints),
            req.tenant,
        ]
    ).encode()
    return fingerprint(b"kvs.plan", [header, np.ascontiguousarray(tokens, dtype=np.uint32).tobytes()])


def commit_fingerprint(req: CommitRequest, tokens: np.ndarray[Any, Any]) -> bytes:
    """What identifies a CommitTurn request: the turn, decode's params, the tokens, the timings,
    how the answer ended, its transcript."""
    header = json.dumps(
        [
            req.turn,
            req.decode_kv_transfer_params,
            astuple(req.timings),
            req.turn_end.value,
            None if req.transcript is None else astuple(req.transcript),
        ],
        sort_keys=True,
        default=repr,
    ).encode()
    return fingerprint(b"kvs.commit", [header, np.ascontiguousarray(tokens, dtype=np.uint32).tobytes()])


class TurnMemory:
    def __init__(
        self,
        *,
        remembered_turns: int,
        hint_bytes: int,
        plan_bytes: int = 64 * 2**20,
        prompt_bytes: int = 128 * 2**20,
    ) -> None:
        self.hints = RetentionHints(hint_bytes)
        # A plan holds prefill's params, whose block ids can be tens of thousands: by bytes too.
        self._plans: _Recent[tuple[bytes, Plan]] = _Recent(
            remembered_turns, max_bytes=plan_bytes, size=_plan_bytes
        )
        self._commits: _Recent[tuple[bytes, CommitResult]] = _Recent(remembered_turns)
        self._finished: _Recent[str] = _Recent(remembered_turns)
        self._prompts: _Recent[np.ndarray[Any, Any]] = _Recent(
            remembered_turns, max_bytes=prompt_bytes, size=lambda tokens: int(tokens.nbytes) + 100
        )
        self._nodes: _Recent[tuple[str, str]] = _Recent(remembered_turns)
        self._storing: dict[str, asyncio.Future[None]] = {}

    # A request id is the caller's, unique only within its own turns: plans are scoped by
    # conversation and model, commits by turn. A remembered answer is given only to a request of
    # the same fingerprint; another body with the same id raises InvalidArgument
    # (REQUEST_ID_REUSED).

    def earlier_plan(self, conversation: str, model: str, request_id: str, fingerprint: bytes) -> Plan | None:
        return self._earlier(self._plans.get(f"{conversation}|{model}|{request_id}"), fingerprint)

    def remember_plan(
        self, conversation: str, model: str, request_id: str, fingerprint: bytes, plan: Plan
    ) -> None:
        self._plans.put(f"{conversation}|{model}|{request_id}", (fingerprint, plan))

    def earlier_commit(self, turn_id: str, request_id: str, fingerprint: bytes) -> CommitResult | None:
        return self._earlier(self._commits.get(f"{turn_id}|{request_id}"), fingerprint)

    def remember_commit(
        self, turn_id: str, request_id: str, fingerprint: bytes, result: CommitResult
    ) -> None:
        self._commits.put(f"{turn_id}|{request_id}", (fingerprint, result))

    @staticmethod
    def _earlier(entry: tuple[bytes, T] | None, fingerprint: bytes) -> T | None:
        if entry is None:
            return None
        if entry[0] != fingerprint:
            raise request_id_reused()
        return entry[1]

    def finished(self, turn_id: str) -> str | None:
        """How the turn finished here ("committed", "aborted"); None if it did not."""
        return self._finished.get(turn_id)

    def finish(self, turn_id: str, outcome: str) -> None:
        self._finished.put(turn_id, outcome)
        self._prompts.pop(turn_id)

    def hold_prompt(self, turn_id: str, tokens: np.ndarray[Any, Any]) -> None:
        """The prompt of a turn planned here (treated as read-only), until it finishes."""
        self._prompts.put(turn_id, tokens)

    def held_prompt(self, turn_id: str) -> np.ndarray[Any, Any] | None:
        return self._prompts.get(turn_id)

    @property
    def prompts(self) -> _Recent[np.ndarray[Any, Any]]:
        """The held prompts (their count and estimated bytes are exported as a cache)."""
        return self._prompts

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
