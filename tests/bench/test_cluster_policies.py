"""bench/cluster's comparison on a 1P+1D emulated cluster in this process: 2 agent sessions of 3
turns, every later turn's history resent edited (the answer's first token changed). Recompute
answers every turn as a clean recompute; the seed's proxy reads decode's KV without checking
the prompt extends it and answers edited turns wrong; prefix-aware and affinity-local never
read decode's KV into another prompt and stay right."""

from __future__ import annotations

import pytest
from bench.cluster.run import ClusterRun, run_policy
from bench.cluster.workload.agent import AgentLoop, generate
from bench.emulator.http.config import engine_profile
from bench.emulator.http.tokenizer import make_tokenizer
from bench.report import ROOT


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> ClusterRun:
    return ClusterRun(
        model_dir=make_tokenizer(tmp_path_factory.mktemp("model")),
        profile=engine_profile(ROOT / "deploy" / "profiles" / "qwen3-32b-h200-tp2.toml"),
        prefill=1,
        decode=1,
        time_scale=0.05,
        max_model_len=131072,
        # Answers longer than the read threshold (64): prefill's own prefix cache holds the
        # previous prompt, so only a longer answer is worth reading from decode.
        max_output=96,
        max_turns=3,
        edit_fraction=1.0,
        seed=1,
    )


async def test_recompute_is_right_and_the_proxy_answers_edited_histories_wrong(run: ClusterRun) -> None:
    sessions = generate(AgentLoop(), sessions=2, seed=1)
    lines: list[str] = []
    rows: dict[str, dict[str, object]] = {}
    for name in ("recompute", "proxy", "prefix-aware", "affinity-local"):
        got, records = await run_policy(name, run, [(1.0, sessions)], lines.append, workload="agent")
        assert len(records) == 6 and all(r.error is None for r in records), lines
        assert got[0]["workload"] == "agent" and got[0]["profile"] == "Qwen/Qwen3-32B"
        # Decode's KV sampled through the step: [t, in use, held], held a part of in use.
        series = got[0]["decode_kv_blocks"]
        assert series and all(len(p) == 3 and 0 <= p[2] <= p[1] for p in series)
        rows[name] = got[0]["summary"]
    assert rows["recompute"]["wrong"] == rows["prefix-aware"]["wrong"] == rows["affinity-local"]["wrong"] == 0
    assert rows["proxy"]["wrong"] == rows["proxy"]["wrong_on_edited"] == 4  # every read turn
    assert rows["proxy"]["decisions"] == {"read": 4, "recompute": 2}
    assert rows["affinity-local"]["decisions"] == {"local": 4, "p2d": 2}
