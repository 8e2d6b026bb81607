"""Sessions replayed against one policy on a simulated fleet, in virtual time (bench/emulator/fleet/vtime.py).

Open loop: each session starts at its arrival, so every policy gets the same sessions at the
same times; within a session a turn is sent its think time after the previous answer ended, as
an agent or a person would (a policy that answers later gets its next turn later). Prompts are
exact-token histories: a turn's prompt is the previous prompt, the answer as the engine gave it,
then the new input from the trace (`TokenMap` tokens of the trace's blocks past the previous
prompt and answer). A request whose trace blocks do not extend the previous request's (a
compacted or restarted context) starts a fresh history from its own blocks. A turn whose prompt
plus answer would pass `max_model_len` ends its session, as a client would.

A turn's record (`TurnRecord`) says where it ran, what was decided and why, what was reused,
read or computed, and when its tokens came; a turn still running at the run's end is `cut` and
counts as a miss in every percentile.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from bench.cluster.workload.model import Request, Session, StopReason
from bench.cluster.workload.tokens import TokenMap
from bench.emulator.fleet.engine import Completion, Prompt
from kvshuttle.core.hashing import ROOT_HASH, chain_array

__all__ = ["Arrival", "Policy", "Served", "SimTurn", "TurnRecord", "replay"]


@dataclass(frozen=True, slots=True)
class Arrival:
    time_s: float
    session: Session


@dataclass(frozen=True, slots=True)
class SimTurn:
    conversation: str
    index: int
    prompt: Prompt
    output: int
    # The trace's think time before this session's next turn (None: the last turn), and why the
    # answer ended: a tool call (the agent comes back soon) or the end of the agent's turn.
    next_think_s: float | None
    stop: StopReason
    # The prompt's tokens as a Python list (what a gateway's Turn holds), made on the first call
    # while the turn is served, from the list of the turn before: O(new tokens), not a tolist.
    # None: made from `prompt` (a one-off turn, not a replayed conversation's).
    prompt_ids: Callable[[], list[int]] | None = None

    def ids(self) -> list[int]:
        return self.prompt_ids() if self.prompt_ids is not None else self.prompt.tokens.tolist()


@dataclass(slots=True)
class Served:
    answer: Completion
    prefill: str  # "" when decode computed the prompt itself
    decode: str
    decision: str
    reason: str = ""
    reused_tokens: int = 0  # prompt tokens not computed (found or read, wherever)
    prefill_answer: Completion | None = None


class Policy(Protocol):
    name: str

    async def serve(self, turn: SimTurn) -> Served: ...


@dataclass(slots=True)
class TurnRecord:
    session: str
    turn: int
    sent_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None = None
    itl_p50_s: float | None = None
    itl_max_s: float | None = None
    done_s: float | None = None
    prefill: str = ""
    decode: str = ""
    decision: str = ""
    reason: str = ""
    reused_tokens: int = 0
    computed_tokens: int = 0
    read_tokens: int = 0
    host_tokens: int = 0
    read_bytes: int = 0
    host_bytes: int = 0
    queue_s: float = 0.0
    wrong: bool = False
    error: str = ""


@dataclass
class ReplayResult:
    records: list[TurnRecord] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # every token gap of every answered turn
    in_flight: int = 0  # turns sent and not yet answered
    # When the turns in flight passed the replay's bound (the fleet collapsed): the replay
    # stopped there, its turns in flight cut, no turn sent after.
    collapsed_at_s: float | None = None
    _collapsed: asyncio.Event = field(default_factory=asyncio.Event)
    _collapse_if: Callable[[ReplayResult], bool] | None = None


class _History:
    """A session's exact-token history and its chain keys, extended turn by turn."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.tokens = _frozen(np.zeros(0, np.uint32))
        self.keys = np.zeros(0, np.uint64)
        self.key_list: list[int] = []
        self._ids: list[int] = []  # a prefix of `tokens`, as a list

    def set(self, tokens: np.ndarray) -> None:
        self.tokens = _frozen(tokens.astype(np.uint32))
        self.keys = chain_array(self.tokens, self.bs)
        self.key_list = self.keys.tolist()
        self._ids = []

    def extend(self, more: np.ndarray) -> None:
        self.tokens = _frozen(np.concatenate([self.tokens, more.astype(np.uint32, copy=False)]))
        full = len(self.tokens) // self.bs
        have = len(self.keys)
        if full > have:
            tail = self.tokens[have * self.bs : full * self.bs]
            parent = int(self.keys[-1]) if have else ROOT_HASH
            more = chain_array(tail, self.bs, parent)
            self.keys = np.concatenate([self.keys, more])
            self.key_list = self.key_list + more.tolist()

    def ids(self) -> list[int]:
        """The tokens as a list: the last one made, plus the tokens added since (a new list:
        one handed out before stays as it was)."""
        if len(self._ids) < len(self.tokens):
            self._ids = self._ids + self.tokens[len(self._ids) :].tolist()
        return self._ids

    def prompt(self, seed: int) -> Prompt:
        return Prompt(self.tokens, self.keys, seed, self.key_list)


def _frozen(tokens: np.ndarray) -> np.ndarray:
    """The history's own array, read-only: kvshuttle's router keeps a frozen prompt uncopied."""
    tokens.flags.writeable = False
    return tokens


def _trace_tail(token_map: TokenMap, request: Request, start: int, block_size: int) -> np.ndarray:
    """The trace prompt's tokens from `start` on: only the blocks they lie in are made."""
    first = start // block_size
    ids = request.hash_ids[first:]
    return token_map.prompt(ids, request.input_tokens - first * block_size, block_size)[
        start - first * block_size :
    ]


def _seed(keys: np.ndarray, tokens: np.ndarray, bs: int) -> int:
    """What a clean recompute's answer is drawn from: the last full block's key and the tail."""
    last = int(keys[-1]) if len(keys) else ROOT_HASH
    tail = tokens[len(keys) * bs :]
    return hash((last, tail.tobytes(), len(tokens))) & (2**63 - 1)


def _extends(previous: tuple[int, ...], current: tuple[int, ...], previous_tokens: int, bs: int) -> bool:
    """Whether the trace's request continues the previous one: it keeps every full block of the
    previous prompt."""
    full = previous_tokens // bs
    return len(current) >= full and current[:full] == previous[:full]


async def _session(
    policy: Policy,
    arrival: Arrival,
    token_map: TokenMap,
    *,
    block_size: int,
    max_model_len: int,
    result: ReplayResult,
    send_until_s: float,
) -> None:
    loop = asyncio.get_running_loop()
    session = arrival.session
    delay = arrival.time_s - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
    history = _History(block_size)
    requests = session.requests
    done_at: float | None = None
    for i, request in enumerate(requests):
        if i and _extends(
            requests[i - 1].hash_ids, request.hash_ids, requests[i - 1].input_tokens, session.block_size
        ):
            previous = requests[i - 1]
            start = min(previous.input_tokens + previous.output_tokens, request.input_tokens - 1)
            history.extend(_trace_tail(token_map, request, start, session.block_size))
        else:
            history.set(token_map.prompt(request.hash_ids, request.input_tokens, session.block_size))
        if len(history.tokens) + request.output_tokens > max_model_len:
            return
        if done_at is not None:
            if request.arrival_offset_ms is not None:  # a recorded offset, never before the answer
                at = max(arrival.time_s + request.arrival_offset_ms / 1e3, done_at)
            else:
                at = done_at + (request.think_time_ms or 0.0) / 1e3
            if at > send_until_s:
                return  # the measurement is over: no new turns
            if at > loop.time():
                await asyncio.sleep(at - loop.time())
        nxt = _gap_s(requests, i)
        turn = SimTurn(
            conversation=session.session_id,
            index=i,
            prompt=history.prompt(_seed(history.keys, history.tokens, block_size)),
            output=max(1, request.output_tokens),
            next_think_s=nxt,
            stop=request.stop_reason,
            prompt_ids=history.ids,
        )
        sent = loop.time()
        record = TurnRecord(session.session_id, i, sent, len(history.tokens), turn.output)
        result.records.append(record)
        result.in_flight += 1
        if result.collapsed_at_s is None and result._collapse_if is not None and result._collapse_if(result):
            result.collapsed_at_s = sent
            result._collapsed.set()
        try:
            served = await policy.serve(turn)
        except asyncio.CancelledError:
            record.error = "cut"
            raise
        finally:
            result.in_flight -= 1
        answer = served.answer
        done_at = loop.time()
        _fill(record, served, sent, done_at, result)
        history.extend(answer.output)  # the history goes on with the answer as given


def _gap_s(requests: Sequence[Request], i: int) -> float | None:
    """The trace's time from this turn's answer to the next turn (a client's think-time hint):
    the next request's think time, or the gap between the two recorded offsets."""
    if i + 1 >= len(requests):
        return None
    nxt, this = requests[i + 1], requests[i]
    if nxt.think_time_ms is not None:
        return nxt.think_time_ms / 1e3
    if nxt.arrival_offset_ms is not None and this.arrival_offset_ms is not None:
        return max(0.0, nxt.arrival_offset_ms - this.arrival_offset_ms) / 1e3
    return None


def _fill(record: TurnRecord, served: Served, sent: float, done: float, result: ReplayResult) -> None:
    answer = served.answer
    times = answer.token_times
    record.done_s = done
    record.prefill, record.decode = served.prefill, served.decode
    record.decision, record.reason = served.decision, served.reason
    record.reused_tokens = served.reused_tokens
    record.wrong = answer.wrong
    computed, read, host, read_b, host_b = (
        answer.computed_tokens,
        answer.read_tokens,
        answer.host_tokens,
        answer.read_bytes,
        answer.host_bytes,
    )
    queue = answer.admitted_after_s
    if served.prefill_answer is not None:
        p = served.prefill_answer
        computed += p.computed_tokens
        read += p.read_tokens
        host += p.host_tokens
        read_b += p.read_bytes
        host_b += p.host_bytes
    record.computed_tokens, record.read_tokens, record.host_tokens = computed, read, host
    record.read_bytes, record.host_bytes, record.queue_s = read_b, host_b, queue
    if times:
        record.ttft_s = times[0] - sent
        gaps = np.diff(np.asarray(times))
        if len(gaps):
            record.itl_p50_s = float(np.median(gaps))
            record.itl_max_s = float(gaps.max())
            result.itl_s.extend(gaps.tolist())


async def replay(
    policy: Policy,
    arrivals: Sequence[Arrival],
    token_map: TokenMap,
    *,
    block_size: int,
    max_model_len: int,
    send_until_s: float = math.inf,
    end_s: float = math.inf,
    collapse_if: Callable[[ReplayResult], bool] | None = None,
) -> ReplayResult:
    """Every session from its arrival until it ends, sending no turn after `send_until_s`, until
    `end_s` (virtual seconds): turns in flight then are cut. `collapse_if(result)` true when a
    turn is sent ends the replay there (`collapsed_at_s`), its turns in flight cut."""
    result = ReplayResult(_collapse_if=collapse_if)
    tasks = [
        asyncio.create_task(
            _session(
                policy,
                a,
                token_map,
                block_size=block_size,
                max_model_len=max_model_len,
                result=result,
                send_until_s=send_until_s,
            )
        )
        for a in arrivals
    ]
    timeout = None if math.isinf(end_s) else max(0.0, end_s - asyncio.get_running_loop().time())
    sessions = asyncio.ensure_future(asyncio.wait(tasks))
    collapsed = asyncio.ensure_future(result._collapsed.wait())
    await asyncio.wait((sessions, collapsed), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    sessions.cancel()
    collapsed.cancel()
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, sessions, collapsed, return_exceptions=True)
    for task in tasks:
        if not task.cancelled():
            task.result()
    return result
