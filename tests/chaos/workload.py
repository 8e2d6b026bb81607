"""The chaos suite's conversation workload: several multi-turn conversations through the gateway
at once, each on its own thread, every turn recorded, every served answer later compared with a
clean recompute (the single-server reference, greedy, a fresh cache salt).

A turn that is not served (an HTTP error, a refused connection) is recorded and sent again with
the same prompt after a pause, so a conversation's history stays what its client saw. The
workload knows only the gateway's URL and a reference engine's: the engine pair is a parameter
(real vLLM here; any pair with VllmPair's attributes).
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deploy.local.launch import VllmPair
from tests.support.turns import reference, tokens

from kvshuttle.gateway.config import DEFAULT_TENANT

FIRST = 96  # tokens of a conversation's first prompt
ADDED = 16  # tokens each later turn adds after the previous answer
OUTPUT = 8  # tokens per answer
TURN_TIMEOUT_S = 90.0
RETRY_PAUSE_S = 0.5


@dataclass
class TurnRecord:
    conversation: str
    index: int  # the conversation's turn number, from 1; a retry keeps it
    phase: str  # what the scenario was doing when the turn was sent
    prompt: list[int]
    status: int  # HTTP status; 0: no answer (connection refused or reset, a timeout)
    output: list[int] = field(default_factory=list)
    decision: str = ""
    reason: str = ""
    reused_tokens: int = 0
    error: str = ""
    ms: float = 0.0
    sent_at: float = 0.0  # wall clock (time.time()), to line turns up with the services' logs
    wrong: bool = False  # set by Workload.verify

    @property
    def served(self) -> bool:
        return self.status == 200 and len(self.output) == OUTPUT


def full_name(conversation: str) -> str:
    """The registry's name of a gateway conversation of the default tenant."""
    return f"tenants/{DEFAULT_TENANT}/conversations/{conversation}"


def send_turn(gateway_url: str, conversation: str, prompt: list[int], max_tokens: int = OUTPUT) -> TurnRecord:
    """One completions turn through the gateway, greedy; never raises for a failed turn."""
    record = TurnRecord(conversation=conversation, index=0, phase="", prompt=prompt, status=0)
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "conversation_id": conversation,
    }
    request = urllib.request.Request(
        f"{gateway_url}/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    record.sent_at = time.time()
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=TURN_TIMEOUT_S) as response:
            got = json.loads(response.read())
            record.status = response.status
            record.output = list(got["choices"][0]["token_ids"])
            record.decision = response.headers.get("X-Kvshuttle-Decision", "")
            record.reason = response.headers.get("X-Kvshuttle-Reason", "")
            record.reused_tokens = int(response.headers.get("X-Kvshuttle-Reused-Tokens", "0"))
    except urllib.error.HTTPError as err:
        record.status = err.code
        record.error = err.read()[:300].decode(errors="replace")
    except OSError as err:  # refused, reset, timed out
        record.error = repr(err)[:300]
    record.ms = round((time.monotonic() - started) * 1e3, 1)
    return record


class Workload:
    """`conversations` conversations, each sending its next turn `think_s()` seconds after the
    last answer, until `stop()`. `phase` labels the turns sent from now on."""

    def __init__(
        self,
        gateway_url: str,
        *,
        conversations: int = 3,
        seed: int = 0,
        think_s: Callable[[random.Random], float] = lambda _: 0.2,
        name: str = "chaos",
    ) -> None:
        self.gateway_url = gateway_url
        self.conversations = [f"{name}-{seed}-{i}-{uuid.uuid4().hex[:6]}" for i in range(conversations)]
        self.phase = "warmup"
        self.turns: list[TurnRecord] = []
        # When each phase that measures a recovery started (wall clock): see start_recovery().
        self.recovery_started: dict[str, float] = {}
        # What the scenario did when (wall clock, as TurnRecord.sent_at): see mark().
        self.marks: dict[str, float] = {}
        self._seed = seed
        self._think_s = think_s
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._running = threading.Event()  # cleared: no new turn starts (see pause)
        self._running.set()
        self._in_flight = 0
        self._threads = [
            threading.Thread(target=self._run, args=(i, conv), name=conv, daemon=True)
            for i, conv in enumerate(self.conversations)
        ]

    def __enter__(self) -> Workload:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self, timeout: float = TURN_TIMEOUT_S + 10) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"workload threads still running: {alive}"

    def _run(self, number: int, conversation: str) -> None:
        rng = random.Random(self._seed * 1000 + number)
        prompt = tokens(FIRST, rng.randrange(1 << 30))
        index = 1
        while not self._stopping.is_set():
            if not self._running.wait(0.1):
                continue
            phase = self.phase
            with self._lock:
                self._in_flight += 1
            record = send_turn(self.gateway_url, conversation, prompt)
            record.index, record.phase = index, phase
            with self._lock:
                self._in_flight -= 1
                self.turns.append(record)
            if record.served:
                prompt = prompt + record.output + tokens(ADDED, rng.randrange(1 << 30))
                index += 1
                self._stopping.wait(self._think_s(rng))
            else:
                self._stopping.wait(RETRY_PAUSE_S)

    def mark(self, event: str) -> None:
        """Note the wall-clock time of a scenario's step ("killed", "ready", ...) for the report."""
        self.marks[event] = round(time.time(), 3)

    def start_recovery(self, phase: str) -> None:
        """Label the turns sent from now on `phase`, a phase that measures recovery: called once
        the restarted components are ready, so no turn of it was sent while they restarted."""
        self.phase = phase
        self.recovery_started[phase] = time.time()
        self.mark(f"{phase}_started")

    def wait_reuse_each(self, phase: str, *, timeout: float) -> dict[str, float]:
        """Until every conversation has had a turn of `phase` served by reuse, at most `timeout`;
        the seconds from the phase's start to each conversation's first reused answer."""
        started = self.recovery_started[phase]
        deadline = time.monotonic() + timeout
        while True:
            first: dict[str, float] = {}
            for t in self.snapshot():
                if t.phase == phase and t.served and t.decision == "reuse" and t.conversation not in first:
                    first[t.conversation] = round(t.sent_at + t.ms / 1e3 - started, 2)
            if len(first) == len(self.conversations):
                return first
            assert time.monotonic() < deadline, (
                f"{len(self.conversations) - len(first)} conversations had no reused turn in "
                f"{timeout:.0f} s of {phase}: {self.summary()}"
            )
            time.sleep(0.1)

    def add(self, record: TurnRecord) -> None:
        """A turn the scenario sent itself, verified and counted with the workload's."""
        with self._lock:
            self.turns.append(record)

    @property
    def in_flight(self) -> int:
        """Turns sent and not answered yet."""
        with self._lock:
            return self._in_flight

    def wait_in_flight(self, timeout: float = 10.0) -> int:
        """Until a turn is in flight (a fault then lands mid-turn), at most `timeout`; how many are."""
        deadline = time.monotonic() + timeout
        while self.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        return self.in_flight

    def quiet(self, settle_s: float = 0.5, timeout: float = TURN_TIMEOUT_S) -> None:
        """Pause, wait until no turn is in flight and the last commits landed (the gateway commits
        after answering); the caller then reads a consistent registry and calls `resume()`."""
        self.pause()
        deadline = time.monotonic() + timeout
        while self.in_flight:
            assert time.monotonic() < deadline, f"turns still in flight after {timeout:.0f} s"
            time.sleep(0.01)
        time.sleep(settle_s)

    def pause(self) -> None:
        """No new turn starts until `resume()`; the turns in flight go on."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def wait_turns(
        self, count: int, *, timeout: float, served: bool = True, phase: str | None = None
    ) -> None:
        """Until `count` more turns (served ones, by default; of `phase`, if given) were recorded."""
        start = self._count(served, phase)
        deadline = time.monotonic() + timeout
        while self._count(served, phase) - start < count:
            assert time.monotonic() < deadline, (
                f"fewer than {count} turns in {timeout:.0f} s: {self.summary()}"
            )
            time.sleep(0.1)

    def _count(self, served: bool, phase: str | None) -> int:
        with self._lock:
            return sum((t.served or not served) and (phase is None or t.phase == phase) for t in self.turns)

    def snapshot(self) -> list[TurnRecord]:
        with self._lock:
            return list(self.turns)

    def summary(self) -> dict[str, int]:
        turns = self.snapshot()
        return {
            "turns": len(turns),
            "served": sum(t.served for t in turns),
            "reused": sum(t.served and t.decision == "reuse" for t in turns),
        }

    def verify(self, pair: VllmPair) -> int:
        """Compares every served answer with the reference run of its prompt (on `pair`'s decode
        engine, as it is now); marks and counts the wrong ones."""
        cache: dict[tuple[int, ...], list[int]] = {}
        wrong = 0
        for record in self.snapshot():
            if not record.served:
                continue
            key = tuple(record.prompt)
            if key not in cache:
                cache[key] = reference(pair, record.prompt, max_tokens=OUTPUT)
            record.wrong = record.output != cache[key]
            wrong += record.wrong
        return wrong


def records_json(turns: list[TurnRecord]) -> list[dict[str, Any]]:
    """The turns for the report, prompts left out (their lengths kept)."""
    return [
        {
            "conversation": t.conversation,
            "index": t.index,
            "phase": t.phase,
            "prompt_tokens": len(t.prompt),
            "status": t.status,
            "decision": t.decision,
            "reason": t.reason,
            "reused_tokens": t.reused_tokens,
            "ms": t.ms,
            "sent_at": round(t.sent_at, 3),
            "wrong": t.wrong,
            **({"error": t.error} if t.error else {}),
        }
        for t in turns
    ]
