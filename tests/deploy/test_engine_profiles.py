"""deploy/profiles: every shipped profile loads in the router and (all but the router's
published-benchmark profile) in the emulator's loader; the loader names a bad field; the fit
recovers known coefficients; cpu-small is what its generator writes; and, where .venv-profile
has aiconfigurator, a regenerated profile equals the shipped one."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from deploy.profiles import cpu_small, generate
from deploy.profiles.fit import decode_row, fit_nonnegative, prefill_row
from deploy.profiles.schema import (
    SECTIONS,
    EngineProfile,
    ProfileError,
    engine_profile_from_dict,
    load_engine_profiles,
    profile_toml,
)

from kvshuttle.router.config import RouterSettings
from kvshuttle.router.cost import EMULATOR_SECTIONS, CostModel, load_profiles, profile_from_dict

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "deploy" / "profiles"
SHIPPED = sorted(PROFILES.glob("*.toml"))
# The router's deployment profile: vLLM's published benchmark, no engine sections.
ROUTER_ONLY = {"qwen3-32b-h200.toml"}
ENGINE_PROFILES = [p for p in SHIPPED if p.name not in ROUTER_ONLY]
EXPECTED = {
    "cpu-small",
    "qwen3-32b-h200-tp2",
    "qwen3-32b-h200-published",
    "qwen3-32b-h100-tp2",
    "llama-3.1-70b-h200-tp4",
    "llama-3.1-70b-h100-tp4",
    "llama-3.1-8b-h100-tp1",
    "qwen3-30b-a3b-h200-tp1",
}


def _cpu_small() -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((PROFILES / "cpu-small.toml").read_text())["profile"][0]
    return data


def test_the_issue_s_profiles_are_shipped() -> None:
    assert {p.stem for p in ENGINE_PROFILES} == EXPECTED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_profile_loads_in_the_router(path: Path) -> None:
    (profile,) = load_profiles(path)
    cost = CostModel(profile)
    assert cost.recompute(4096, 0).prefill_ms > cost.recompute(1024, 0).prefill_ms > 0
    assert cost.transfer_ms(4096) > profile.link.fixed_ms


@pytest.mark.parametrize("path", ENGINE_PROFILES, ids=lambda p: p.name)
def test_every_engine_profile_loads_and_agrees_with_the_router(path: Path) -> None:
    (engine,) = load_engine_profiles(path)
    (router,) = load_profiles(path)
    assert (engine.model, engine.prefill, engine.link) == (router.model, router.prefill, router.link)
    assert engine.kv_bytes_per_token == router.kv_bytes_per_token
    assert engine.hardware.gpus_per_engine == engine.hardware.tp
    assert engine.engine.kv_capacity_tokens % engine.engine.block_size == 0
    # A full batch at a few thousand tokens each fits and decodes slower than one sequence.
    decode = engine.decode
    assert decode.itl_ms(decode.max_batch, decode.max_batch * 2048) > decode.itl_ms(1, 2048) > 0
    # Written back, it reads the same.
    assert _reparse(profile_toml(engine, "round trip")) == engine


def _reparse(text: str) -> EngineProfile:
    return engine_profile_from_dict(tomllib.loads(text)["profile"][0])


def test_an_engine_profile_given_inline_reads_as_from_its_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """make demo hands cpu-small to the router as inline JSON (KVSHUTTLE_ROUTER_PROFILES): the
    engine sections are ignored there as in the file loader, any other unknown key refused."""
    raw = tomllib.loads((PROFILES / "cpu-small.toml").read_text())["profile"][0]
    monkeypatch.setenv("KVSHUTTLE_ROUTER_PROFILES", json.dumps([raw]))
    assert RouterSettings().profiles == load_profiles(PROFILES / "cpu-small.toml")
    monkeypatch.setenv("KVSHUTTLE_ROUTER_PROFILES", json.dumps([raw | {"bogus": 1}]))
    with pytest.raises(ValueError, match="bogus"):
        RouterSettings()


def test_the_router_s_published_profile_is_not_an_engine_profile() -> None:
    with pytest.raises(
        ProfileError, match=r"qwen3-32b-h200.toml: profile Qwen/Qwen3-32B: missing section \[profile.decode\]"
    ):
        load_engine_profiles(PROFILES / "qwen3-32b-h200.toml")


def test_the_published_engine_profile_is_the_router_s_fit_on_the_tp2_engine() -> None:
    """qwen3-32b-h200-published.toml: the router's published fit (prefill, link) with the
    aiconfigurator TP 2 file's decode, engine and hardware, prefill unchunked to 32k."""
    (published,) = load_engine_profiles(PROFILES / "qwen3-32b-h200-published.toml")
    (router,) = load_profiles(PROFILES / "qwen3-32b-h200.toml")
    (tp2,) = load_engine_profiles(PROFILES / "qwen3-32b-h200-tp2.toml")
    assert (published.prefill, published.link) == (router.prefill, router.link)
    assert (published.model, published.kv_bytes_per_token, published.min_reuse_tokens) == (
        router.model,
        router.kv_bytes_per_token,
        router.min_reuse_tokens,
    )
    assert (published.decode, published.hardware) == (tp2.decode, tp2.hardware)
    assert published.engine == replace(tp2.engine, max_num_batched_tokens=32768)


def test_the_router_accepts_the_engine_sections_and_refuses_unknown_keys() -> None:
    assert set(SECTIONS) - {"prefill", "link"} == EMULATOR_SECTIONS
    data = _cpu_small()
    assert profile_from_dict(data).prefill.per_token_ms == data["prefill"]["per_token_ms"]
    with pytest.raises(ValueError, match=r"unknown key.*min_reuse_token"):
        profile_from_dict({**data, "min_reuse_token": 0})


def _set(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    section, _, key = dotted.rpartition(".")
    copy = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    (copy[section] if section else copy)[key] = value
    return copy


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("decode.per_seq_ms", -0.1, "decode.per_seq_ms must be at least 0, got -0.1"),
        ("engine.block_size", 0, "engine.block_size must be positive, got 0"),
        ("engine.kv_capacity_tokens", 1.5, "engine.kv_capacity_tokens must be an integer"),
        ("decode.max_batch", True, "decode.max_batch must be an integer"),
        ("prefill.fixed_ms", "20", "prefill.fixed_ms must be a number"),
        ("link.bandwidth_gb_s", 0.0, "link.bandwidth_gb_s must be positive"),
        ("kv_bytes_per_token", 0, "kv_bytes_per_token must be positive"),
        ("engine.gpu_memory_utilization", 1.2, "engine.gpu_memory_utilization must be at most 1"),
        ("hardware.gpus_per_engine", 0, "hardware.gpus_per_engine must be positive"),
        ("hardware.tp", 2, "hardware.gpus_per_engine must be at least hardware.tp"),
        ("hardware.gpu", "", "hardware.gpu must be a non-empty string"),
        ("decode.per_seq", 1.0, r"\[profile.decode\]: unknown key\(s\) per_seq"),
        ("decode_ms", 1.0, r"unknown key\(s\) decode_ms"),
    ],
)
def test_the_loader_names_the_bad_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ProfileError, match=f"profile m: {message}"):
        engine_profile_from_dict(_set(_cpu_small(), field, value))


def test_the_loader_names_a_missing_field() -> None:
    data = _cpu_small()
    del data["engine"]["block_size"]
    with pytest.raises(ProfileError, match=r"profile m: missing engine\.block_size"):
        engine_profile_from_dict(data)


def test_the_fit_recovers_known_prefill_coefficients() -> None:
    truth = (12.0, 0.04, 0.002, 1.5)
    points = [(c, k) for c in (128, 1024, 4096, 16384) for k in (0, 2048, 30000)]
    rows = [prefill_row(c, k) for c, k in points]
    fit = fit_nonnegative(rows, [sum(t * x for t, x in zip(truth, row, strict=True)) for row in rows])
    assert fit.coefficients == pytest.approx(truth, rel=1e-9)
    assert fit.max_rel_error < 1e-9


def test_the_fit_recovers_decode_coefficients_and_keeps_terms_non_negative() -> None:
    points = [(b, b * ctx) for b in (1, 8, 64, 512) for ctx in (512, 8192)]
    rows = [decode_row(b, ctx) for b, ctx in points]
    fit = fit_nonnegative(rows, [9.0 + 0.05 * b + 20.0 * ctx * 1e-6 for b, ctx in points])
    assert fit.coefficients == pytest.approx((9.0, 0.05, 20.0), rel=1e-9)
    # Data that a negative per-sequence cost would fit best gets 0 there instead.
    falling = fit_nonnegative(rows, [max(30.0 - 0.01 * b, 1.0) + 20.0 * ctx * 1e-6 for b, ctx in points])
    assert min(falling.coefficients) >= 0 and falling.coefficients[1] == 0


def test_cpu_small_is_what_its_generator_writes_from_the_bench_results() -> None:
    source = cpu_small.latest_results()
    profile, fit = cpu_small.build_profile(cpu_small.ttft_points(json.loads(source.read_text())))
    assert _reparse(profile_toml(profile, "")) == load_engine_profiles(PROFILES / "cpu-small.toml")[0]
    assert fit.max_rel_error < 0.1


def test_the_generator_sizes_the_kv_cache_and_scales_the_link() -> None:
    facts = generate.ModelFacts(layers=64, kv_heads=8, head_dim=128, max_context=40960)
    memory = generate.MemoryFacts(
        capacity_gib=80.0,
        utilization=0.9,
        tolerance=0.0,
        weights_gib=30.0,
        activations_gib=1.0,
        nccl_gib=0.0,
        others_gib=1.0,
    )
    prefill = tuple(
        (c, k, 5.0 + 0.05 * c + 0.01 * k) for c, k in ((512, 0), (4096, 0), (1024, 4096), (8192, 8192))
    )
    decode = tuple((b, b * 2048, 10.0 + 0.1 * b) for b in (1, 8, 64))
    m = generate.Measurements(
        model="Qwen/Qwen3-32B",
        gpu="h100_sxm",
        tp=2,
        versions="test",
        facts=facts,
        memory=memory,
        inter_node_gb_s=25.0,
        link_gpu_inter_node_gb_s=50.0,
        prefill=prefill,
        decode=decode,
    )
    profile, prefill_fit, decode_fit = generate.build_profile(m, "served")
    assert facts.kv_bytes_per_token == 262144
    # (80 * 0.9 - 32) GiB on each of 2 GPUs at 256 KiB a token.
    assert profile.engine.kv_capacity_tokens == 2 * 40 * 4096
    assert profile.link.bandwidth_gb_s == pytest.approx(generate.PUBLISHED_LINK.bandwidth_gb_s / 2)
    assert profile.prefill.per_token_ms == pytest.approx(0.05) and decode_fit.coefficients[
        1
    ] == pytest.approx(0.1)
    assert (profile.model, profile.hardware.tp, profile.hardware.gpus_per_engine) == ("served", 2, 2)
    # The header is comments only: the file reads back as the profile, to five digits.
    again = _reparse(profile_toml(profile, generate.header(m, prefill_fit, decode_fit)))
    assert again.engine == profile.engine and again.decode.per_seq_ms == pytest.approx(0.1, rel=1e-4)
    assert (
        generate.default_out("meta-llama/Meta-Llama-3.1-70B", "h200_sxm", 4).name
        == "llama-3.1-70b-h200-tp4.toml"
    )
    assert (1, 2048) in generate.decode_points(1 << 20)
    assert all(b * (ctx + 2) <= 100_000 for b, ctx in generate.decode_points(100_000))


PROFILE_PYTHON = REPO / ".venv-profile" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not PROFILE_PYTHON.exists(), reason="no .venv-profile (make profile creates it)")
def test_a_regenerated_profile_equals_the_shipped_one(tmp_path: Path) -> None:
    out = tmp_path / "llama-3.1-8b-h100-tp1.toml"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'services'}{os.pathsep}{REPO}"}
    argv = ["-m", "deploy.profiles.generate", "--model", "meta-llama/Meta-Llama-3.1-8B", "--gpu", "h100_sxm"]
    subprocess.run(
        [str(PROFILE_PYTHON), *argv, "--tp", "1", "--out", str(out)], cwd=REPO, env=env, check=True
    )
    assert load_engine_profiles(out) == load_engine_profiles(PROFILES / out.name)
