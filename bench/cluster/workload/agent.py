"""A synthetic agent loop: sessions of tool calls, the shape of a coding or browsing agent.

A session is 1 or more tasks. A task starts with a user message (input kind text) appended to
the conversation; the model answers with a tool call (stop reason tool_calls), the tool runs
(the think time before the next request is its latency), its result is appended (input kind
tool_result), and so on, until the model's final answer (stop reason stop) ends the task. The
next task's message comes after the user's think time. Every prompt is the previous prompt, its
answer and the appended input, after a system prompt (instructions and tool definitions) that
all sessions share.

Distributions (the defaults; all seeded, clipped to [low, high]; lognormal by its median and
sigma, so the mean is median * exp(sigma^2 / 2)):
  system prompt           6,000 tokens, one for every session
  tasks per session       1 + geometric (p = 0.6): mean 1.67, at most 4
  user message            lognormal median 300 tokens, sigma 0.8, [20, 4,000]
  tool calls per task     geometric (p = 1/8) on 1, 2, ...: mean 8, at most 40
  tool call (output)      lognormal median 120 tokens, sigma 0.7, [10, 2,000]
  tool result             lognormal median 600 tokens, sigma 1.2, [10, 16,000]: a heavy tail of
                          file reads and command output
  tool latency            lognormal median 800 ms, sigma 1.2, [20 ms, 120 s]
  final answer (output)   lognormal median 400 tokens, sigma 0.8, [20, 4,000]
  user think time         lognormal median 30 s, sigma 1.0, [2 s, 600 s]
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.cluster.workload.blocks import BlockIds
from bench.cluster.workload.model import InputKind, Request, Session, StopReason


@dataclass(frozen=True, slots=True)
class Lognormal:
    median: float
    sigma: float
    low: float
    high: float

    def draw(self, rng: random.Random) -> float:
        return min(max(self.median * rng.lognormvariate(0.0, self.sigma), self.low), self.high)


@dataclass(frozen=True, slots=True)
class AgentLoop:
    system_tokens: int = 6000
    extra_task_p: float = 0.4  # each further task with this chance: 1 + geometric(0.6)
    max_tasks: int = 4
    user_tokens: Lognormal = Lognormal(300, 0.8, 20, 4000)
    tool_call_p: float = 1 / 8  # calls per task: geometric on 1, 2, ... (mean 1 / p)
    max_tool_calls: int = 40
    tool_call_tokens: Lognormal = Lognormal(120, 0.7, 10, 2000)
    tool_result_tokens: Lognormal = Lognormal(600, 1.2, 10, 16000)
    tool_latency_ms: Lognormal = Lognormal(800, 1.2, 20, 120_000)
    answer_tokens: Lognormal = Lognormal(400, 0.8, 20, 4000)
    user_think_ms: Lognormal = Lognormal(30_000, 1.0, 2_000, 600_000)


def _geometric(rng: random.Random, p: float, cap: int) -> int:
    """1, 2, ... with P(k) = (1 - p)^(k - 1) p, at most `cap`."""
    count = 1
    while count < cap and rng.random() >= p:
        count += 1
    return count


class _Conversation:
    """A growing prompt: each request appends the previous answer and its own input."""

    def __init__(
        self, ids: BlockIds, system_ids: tuple[int, ...], system_tokens: int, block_size: int
    ) -> None:
        self.ids, self.block_size = ids, block_size
        self.tokens, self.prompt_ids = len(system_ids) * block_size, system_ids
        self.pending = system_tokens - self.tokens  # the system prompt's partial block
        self.requests: list[Request] = []

    def send(self, added: int, kind: InputKind, output: int, stop: StopReason, think_ms: float) -> None:
        total = self.tokens + self.pending + added
        self.prompt_ids = self.ids.extend(self.prompt_ids, self.tokens, total, self.block_size)
        self.tokens = total
        self.requests.append(Request(total, output, self.prompt_ids, kind, stop, think_time_ms=think_ms))
        self.pending = output


def generate(loop: AgentLoop, *, sessions: int, seed: int, block_size: int = 64) -> list[Session]:
    rng = random.Random(seed)
    ids = BlockIds()
    system_ids = ids.fresh(loop.system_tokens // block_size)
    out = []
    for s in range(sessions):
        conversation = _Conversation(ids, system_ids, loop.system_tokens, block_size)
        send = conversation.send
        tasks = 1
        while tasks < loop.max_tasks and rng.random() < loop.extra_task_p:
            tasks += 1
        for task in range(tasks):
            think = loop.user_think_ms.draw(rng) if task else 0.0
            calls = _geometric(rng, loop.tool_call_p, loop.max_tool_calls)
            kind, added = InputKind.TEXT, round(loop.user_tokens.draw(rng))
            for _ in range(calls):
                send(added, kind, round(loop.tool_call_tokens.draw(rng)), StopReason.TOOL_CALLS, think)
                kind, added = InputKind.TOOL_RESULT, round(loop.tool_result_tokens.draw(rng))
                think = loop.tool_latency_ms.draw(rng)
            send(added, kind, round(loop.answer_tokens.draw(rng)), StopReason.STOP, think)
        out.append(
            Session(session_id=f"agent-{s}", block_size=block_size, requests=tuple(conversation.requests))
        )
    return out


__all__ = ["AgentLoop", "Lognormal", "generate"]
