"""Sessions shaped like vLLM's multi-turn benchmark generator (benchmarks/multi_turn, a
`generate_multi_turn.json` with "filetype": "generate_conversations"): the same config, read
here for its token counts only (no text, no tokenizer).

The config's shape, and what each part becomes:
  num_conversations                     sessions
  prompt_input.num_turns                messages per conversation, user and assistant: at least 2,
                                        rounded up to even; a session has half as many requests
  prompt_input.common_prefix_num_tokens one draw, shared by every conversation's first message
                                        (optional, 0 when absent)
  prompt_input.prefix_num_tokens        each conversation's own context, in its first message
  prompt_input.num_tokens               each user message
  prompt_output.num_tokens              each answer (the replay asks for exactly that many)
Distributions as the generator has them: constant (value), uniform (min, max: integers),
lognormal (average with median_ratio, default 0.85, the draws rescaled to that average; or mean
and sigma), zipf (alpha), poisson (alpha); each but constant and uniform with an optional max.
Draws are made per message index as the generator does (user turns take the even ones, answers
the odd ones).

A turn's prompt is the previous prompt, its answer and the new user message. The generator's
benchmark client sends a conversation's next turn as soon as the answer is in (its per-client
request rate aside, which an open-loop replay replaces): think time 0 unless `think_ms` asks for
exponential think times of that mean.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.cluster.workload.blocks import BlockIds
from bench.cluster.workload.model import InputKind, Request, Session, StopReason

Draw = Callable[[np.random.Generator, int], npt.NDArray[np.int64]]


class ConfigError(ValueError):
    """The generator config breaks its shape; the message names the field."""


def _field(conf: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in conf:
        raise ConfigError(f"{where}.{key}: missing")
    return conf[key]


def _number(conf: Mapping[str, Any], key: str, where: str) -> float:
    value = _field(conf, key, where)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"{where}.{key}: expected a number, got {value!r}")
    return float(value)


def _capped(samples: npt.NDArray[Any], cap: float | None) -> npt.NDArray[np.int64]:
    if cap is not None:
        samples = np.minimum(samples, cap)
    return np.round(samples).astype(np.int64)


def distribution(conf: Mapping[str, Any], where: str) -> Draw:
    """A sampler for one of the generator's distribution objects."""
    kind = _field(conf, "distribution", where)
    cap = _number(conf, "max", where) if "max" in conf else None
    if kind == "constant":
        value = _number(conf, "value", where)
        return lambda rng, n: np.full(n, round(value), dtype=np.int64)
    if kind == "uniform":
        low, high = _number(conf, "min", where), _number(conf, "max", where)
        if not 0 < low <= high:
            raise ConfigError(f"{where}: uniform needs 0 < min <= max")
        return lambda rng, n: rng.integers(round(low), round(high) + 1, n, dtype=np.int64)
    if kind == "zipf":
        alpha = _number(conf, "alpha", where)
        return lambda rng, n: _capped(rng.zipf(alpha, n), cap)
    if kind == "poisson":
        alpha = _number(conf, "alpha", where)
        return lambda rng, n: _capped(rng.poisson(alpha, n), cap)
    if kind == "lognormal":
        return _lognormal(conf, where, cap)
    raise ConfigError(f"{where}.distribution: unknown {kind!r}")


def _lognormal(conf: Mapping[str, Any], where: str, cap: float | None) -> Draw:
    if "average" in conf:
        average = _number(conf, "average", where)
        ratio = _number(conf, "median_ratio", where) if "median_ratio" in conf else 0.85
        if average < 1 or not 0 < ratio < 1:
            raise ConfigError(f"{where}: lognormal needs average >= 1 and 0 < median_ratio < 1")
        # median / mean = exp(-sigma^2 / 2) for a lognormal.
        mu, sigma = float(np.log(average * ratio)), float(np.sqrt(-2 * np.log(ratio)))

        def rescaled(rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
            samples = rng.lognormal(mu, sigma, n)
            return _capped(samples * (average / samples.mean()), cap)

        return rescaled
    mean, sigma = _number(conf, "mean", where), _number(conf, "sigma", where)
    return lambda rng, n: _capped(rng.lognormal(mean, sigma, n), cap)


def generate(
    config: Mapping[str, Any], *, seed: int, block_size: int = 64, think_ms: float = 0.0
) -> list[Session]:
    """The config's conversations as sessions, hash ids at `block_size`."""
    if config.get("filetype") != "generate_conversations":
        raise ConfigError("filetype: expected 'generate_conversations'")
    count = int(_number(config, "num_conversations", "config"))
    inputs = _field(config, "prompt_input", "config")
    outputs = _field(config, "prompt_output", "config")
    turns_of = distribution(_field(inputs, "num_turns", "prompt_input"), "prompt_input.num_turns")
    prefix_of = distribution(
        _field(inputs, "prefix_num_tokens", "prompt_input"), "prompt_input.prefix_num_tokens"
    )
    user_of = distribution(_field(inputs, "num_tokens", "prompt_input"), "prompt_input.num_tokens")
    answer_of = distribution(_field(outputs, "num_tokens", "prompt_output"), "prompt_output.num_tokens")
    common_conf = inputs.get("common_prefix_num_tokens")
    common_of = distribution(common_conf, "prompt_input.common_prefix_num_tokens") if common_conf else None

    rng = np.random.default_rng(seed)
    messages = np.maximum(turns_of(rng, count), 2)
    messages += messages % 2
    prefixes = np.maximum(prefix_of(rng, count), 0)
    common = max(int(common_of(rng, 1)[0]), 0) if common_of else 0
    ids = BlockIds()
    common_ids = ids.fresh(common // block_size)
    sessions = []
    for c in range(count):
        users = np.maximum(user_of(rng, int(messages[c])), 1)
        answers = np.maximum(answer_of(rng, int(messages[c])), 1)
        thinks = rng.exponential(think_ms, int(messages[c])) if think_ms > 0 else np.zeros(int(messages[c]))
        requests: list[Request] = []
        tokens, prompt_ids = len(common_ids) * block_size, common_ids
        for turn in range(int(messages[c]) // 2):
            added = int(users[2 * turn])
            if turn == 0:
                added += common - tokens + int(prefixes[c])
            else:
                added += requests[-1].output_tokens
            prompt_ids = ids.extend(prompt_ids, tokens, tokens + added, block_size)
            tokens += added
            requests.append(
                Request(
                    input_tokens=tokens,
                    output_tokens=int(answers[2 * turn + 1]),
                    hash_ids=prompt_ids,
                    input_kind=InputKind.TEXT,
                    stop_reason=StopReason.LENGTH,
                    think_time_ms=float(thinks[turn]) if turn else 0.0,
                )
            )
        sessions.append(Session(session_id=f"vllm-{c}", block_size=block_size, requests=tuple(requests)))
    return sessions


# The values of the example config vLLM ships (benchmarks/multi_turn/generate_multi_turn.json).
EXAMPLE_CONFIG: dict[str, Any] = {
    "filetype": "generate_conversations",
    "num_conversations": 24,
    "prompt_input": {
        "num_turns": {"distribution": "uniform", "min": 12, "max": 18},
        "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
        "prefix_num_tokens": {"distribution": "lognormal", "average": 1000, "max": 5000},
        "num_tokens": {"distribution": "uniform", "min": 120, "max": 160},
    },
    "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 80, "max": 120}},
}

__all__ = ["EXAMPLE_CONFIG", "ConfigError", "distribution", "generate"]
