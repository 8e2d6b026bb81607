"""Write an engine profile (deploy/profiles/schema.py) of a model on a GPU at a TP degree from
NVIDIA's aiconfigurator, which ships measured per-operation latencies of vLLM on h100_sxm and
h200_sxm:

    make profile MODEL=Qwen/Qwen3-32B GPU=h200_sxm TP=2
    python -m deploy.profiles.generate --model Qwen/Qwen3-32B --gpu h200_sxm --tp 2 [--out F]

(the second needs aiconfigurator importable and services/ on PYTHONPATH: `make profile` runs it
in .venv-profile). Models go by the HuggingFace path aiconfigurator knows them by
(aiconfigurator_core/model_configs: Qwen/Qwen3-32B, meta-llama/Meta-Llama-3.1-70B, ...).

Prefill: aiconfigurator's static_ctx estimate (one request) at input lengths from 256 tokens to
32k (or the model's limit), with 0, 50 % and 87.5 % of the input prefix-cached; decode: its
static_gen estimate of a step over batch sizes and context lengths. Both are fitted by
deploy.profiles.fit. KV capacity follows aiconfigurator's vLLM memory model; the link keeps the
fit to vLLM's published benchmark (aiconfigurator has no KV-transfer figure).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from deploy.profiles.fit import Fit, decode_row, fit_nonnegative, prefill_model, prefill_row
from deploy.profiles.schema import DecodeModel, EngineLimits, EngineProfile, Hardware, profile_toml
from kvshuttle.router.cost import LinkModel

PROFILES_DIR = Path(__file__).resolve().parent
BACKEND = "vllm"
DATABASE_MODE = "SILICON"
KV_DTYPE_BYTES = 2  # bf16 KV cache, aiconfigurator's default for these models
# vLLM's defaults (engine/arg_utils.py, OpenAI server) on GPUs with 70-160 GiB (H100, H200).
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 1024
MIN_REUSE_TOKENS = 64  # NixlConnector's kv_recompute_threshold default
# vLLM's published bidirectional-KV-transfer benchmark, an H200 pair over EFA (as in
# qwen3-32b-h200.toml): 59.06 GB/s and 20.9 ms per transfer.
PUBLISHED_LINK = LinkModel(bandwidth_gb_s=59.06, fixed_ms=20.9)
PUBLISHED_LINK_GPU = "h200_sxm"

PREFILL_INPUTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
PREFILL_CACHED_FRACTIONS = (0.5, 0.875)  # besides 0, for inputs of 1024 tokens and more
DECODE_BATCHES = (1, 4, 16, 64, 256, 1024)
DECODE_CONTEXTS = (512, 2048, 8192)  # tokens per sequence


@dataclass(frozen=True, slots=True)
class ModelFacts:
    layers: int
    kv_heads: int
    head_dim: int
    max_context: int

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * KV_DTYPE_BYTES


@dataclass(frozen=True, slots=True)
class MemoryFacts:
    """One GPU of the engine, GiB, from aiconfigurator's vLLM memory model."""

    capacity_gib: float
    utilization: float
    tolerance: float
    weights_gib: float
    activations_gib: float
    nccl_gib: float
    others_gib: float

    def kv_capacity_tokens(self, tp: int, kv_bytes_per_token: int) -> int:
        """Tokens of KV the whole TP group holds, in whole blocks."""
        budget_gib = self.capacity_gib * self.utilization * (1 - self.tolerance) - (
            self.weights_gib + self.activations_gib + self.nccl_gib + self.others_gib
        )
        tokens = int(tp * budget_gib * (1 << 30) // kv_bytes_per_token)
        return tokens - tokens % BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class Measurements:
    """What aiconfigurator said, and about what."""

    model: str
    gpu: str
    tp: int
    versions: str  # aiconfigurator and its database
    facts: ModelFacts
    memory: MemoryFacts
    inter_node_gb_s: float
    link_gpu_inter_node_gb_s: float
    # (computed tokens, cached tokens, ms) and (batch, context tokens in the batch, ms)
    prefill: tuple[tuple[int, int, float], ...]
    decode: tuple[tuple[int, int, float], ...]


def prefill_points(max_context: int) -> list[tuple[int, int]]:
    """(input tokens, cached tokens) to ask about."""
    points = []
    for isl in (n for n in PREFILL_INPUTS if n <= max_context):
        points.append((isl, 0))
        if isl >= 1024:
            points += [(isl, int(isl * f)) for f in PREFILL_CACHED_FRACTIONS]
    return points


def decode_points(kv_capacity_tokens: int) -> list[tuple[int, int]]:
    """(batch, context tokens per sequence) whose KV fits the engine."""
    return [
        (b, ctx) for b in DECODE_BATCHES for ctx in DECODE_CONTEXTS if b * (ctx + 2) <= kv_capacity_tokens
    ]


def build_profile(m: Measurements, served_model: str) -> tuple[EngineProfile, Fit, Fit]:
    prefill_fit = fit_nonnegative([prefill_row(c, k) for c, k, _ in m.prefill], [ms for *_, ms in m.prefill])
    decode_fit = fit_nonnegative([decode_row(b, ctx) for b, ctx, _ in m.decode], [ms for *_, ms in m.decode])
    fixed, per_seq, per_ctx = decode_fit.coefficients
    scale = m.inter_node_gb_s / m.link_gpu_inter_node_gb_s
    profile = EngineProfile(
        model=served_model,
        kv_bytes_per_token=m.facts.kv_bytes_per_token,
        min_reuse_tokens=MIN_REUSE_TOKENS,
        prefill=prefill_model(prefill_fit),
        link=LinkModel(
            bandwidth_gb_s=PUBLISHED_LINK.bandwidth_gb_s * scale, fixed_ms=PUBLISHED_LINK.fixed_ms
        ),
        decode=DecodeModel(
            fixed_ms=fixed, per_seq_ms=per_seq, per_ctx_token_ns=per_ctx, max_batch=MAX_NUM_SEQS
        ),
        engine=EngineLimits(
            kv_capacity_tokens=m.memory.kv_capacity_tokens(m.tp, m.facts.kv_bytes_per_token),
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            gpu_memory_utilization=m.memory.utilization,
        ),
        hardware=Hardware(
            gpu=m.gpu, tp=m.tp, gpus_per_engine=m.tp, gpu_memory_gib=round(m.memory.capacity_gib, 2)
        ),
    )
    return profile, prefill_fit, decode_fit


def header(m: Measurements, prefill_fit: Fit, decode_fit: Fit) -> str:
    f, mem, link = m.facts, m.memory, PUBLISHED_LINK
    isl = sorted({c + k for c, k, _ in m.prefill})
    batches = sorted({b for b, _, _ in m.decode})
    contexts = sorted({ctx // b for b, ctx, _ in m.decode})
    pc, pk, pms = m.prefill[prefill_fit.worst]
    db, dctx, dms = m.decode[decode_fit.worst]
    kv = (
        f"{f.layers} layers x {f.kv_heads} KV heads x {f.head_dim} head dim x (K, V) x {KV_DTYPE_BYTES} bytes"
    )
    non_kv = (
        f"weights {mem.weights_gib:.2f} - activations {mem.activations_gib:.2f} at {MAX_NUM_BATCHED_TOKENS} "
        f"tokens - NCCL {mem.nccl_gib:.2f} - other {mem.others_gib:.2f} GiB"
    )
    return f"""\
Generated: make profile MODEL={m.model} GPU={m.gpu} TP={m.tp}
  (python -m deploy.profiles.generate --model {m.model} --gpu {m.gpu} --tp {m.tp}); do not edit.
{m.versions}
kv_bytes_per_token: {kv} (bf16).
prefill: static_ctx, one request, {len(m.prefill)} points (input {isl[0]}-{isl[-1]} tokens,
  0 / 50 / 87.5 % prefix-cached from 1024 up): {prefill_fit.describe()}
  (the largest relative one at {pc} computed on {pk} cached: {pms:.1f} ms).
decode: static_gen step (osl 2), {len(m.decode)} points (batch {batches[0]}-{batches[-1]},
  {contexts[0]}-{contexts[-1]} context tokens per sequence, where the KV fits): {decode_fit.describe()}
  (the largest relative one at batch {db}, {dctx // db} tokens each: {dms:.2f} ms).
engine: per GPU {mem.capacity_gib:.1f} GiB x {mem.utilization} (vLLM gpu_memory_utilization)
  x {1 - mem.tolerance:.2f} (aiconfigurator's margin) - {non_kv},
  x TP {m.tp} / kv_bytes_per_token. block_size, max_num_batched_tokens and max_batch
  (max_num_seqs): vLLM's defaults on H100/H200.
link: vLLM's published bidirectional benchmark on an H200 pair over EFA ({link.bandwidth_gb_s} GB/s,
  {link.fixed_ms} ms), bandwidth scaled by aiconfigurator's inter-node bandwidth per GPU
  ({m.gpu} {m.inter_node_gb_s:g} GB/s vs {PUBLISHED_LINK_GPU} {m.link_gpu_inter_node_gb_s:g} GB/s);
  assumed independent of TP and of the model (aiconfigurator has no KV-transfer data).
"""


def query_aiconfigurator(model: str, gpu: str, tp: int) -> Measurements:
    """Ask aiconfigurator's SDK (cli_estimate, static modes, vLLM backend) for every point."""
    logging.disable(logging.WARNING)  # aiconfigurator logs every lookup it interpolates
    # Here, not at the top: only .venv-profile has aiconfigurator.
    from aiconfigurator.cli.api import cli_estimate  # noqa: PLC0415
    from aiconfigurator_core.sdk.backends.vllm_backend import VLLMBackend  # noqa: PLC0415
    from aiconfigurator_core.sdk.models.helpers import check_is_moe  # noqa: PLC0415

    # A MoE model's experts as vLLM lays them out without --enable-expert-parallel: each expert's
    # weights split over the TP group (aiconfigurator wants the layout named for MoE models).
    moe = {"moe_tp_size": tp, "moe_ep_size": 1} if check_is_moe(model) else {}

    def estimate(mode: str, isl: int, osl: int, batch: int, prefix: int = 0) -> Any:
        return cli_estimate(
            model,
            gpu,
            mode=mode,
            backend_name=BACKEND,
            database_mode=DATABASE_MODE,
            isl=isl,
            osl=osl,
            batch_size=batch,
            prefix=prefix,
            tp_size=tp,
            **moe,
        )

    facts = model_facts(model)
    # One full chunk of chunked prefill: the activation memory vLLM reserves.
    chunk = estimate("static_ctx", MAX_NUM_BATCHED_TOKENS, 1, 1)
    used = chunk.summary.get_memory()
    backend = VLLMBackend()
    memory = MemoryFacts(
        capacity_gib=chunk.summary.get_mem_capacity_bytes() / (1 << 30),
        utilization=float(backend.get_default_free_gpu_memory_fraction(chunk.backend_version) or 0.0),
        tolerance=backend.get_kv_cache_memory_check_params()[1],
        weights_gib=used["weights"],
        activations_gib=used["activations"],
        nccl_gib=used["nccl"],
        others_gib=used["others"],
    )
    prefill = tuple(
        (isl - k, k, float(estimate("static_ctx", isl, 1, 1, k).ttft))
        for isl, k in prefill_points(facts.max_context)
    )
    capacity = memory.kv_capacity_tokens(tp, facts.kv_bytes_per_token)
    decode = tuple(
        (b, b * ctx, float(estimate("static_gen", ctx, 2, b).tpot)) for b, ctx in decode_points(capacity)
    )
    versions = (
        f"aiconfigurator {importlib.metadata.version('aiconfigurator')} "
        f"(aiconfigurator-core {importlib.metadata.version('aiconfigurator-core')}); "
        f"database {gpu} / {BACKEND} {chunk.backend_version} ({DATABASE_MODE})."
    )
    return Measurements(
        model=model,
        gpu=gpu,
        tp=tp,
        versions=versions,
        facts=facts,
        memory=memory,
        inter_node_gb_s=_inter_node_gb_s(gpu),
        link_gpu_inter_node_gb_s=_inter_node_gb_s(PUBLISHED_LINK_GPU),
        prefill=prefill,
        decode=decode,
    )


def model_facts(model: str) -> ModelFacts:
    """Layers, KV heads and head size from the HuggingFace config aiconfigurator ships."""
    configs = resources.files("aiconfigurator_core") / "model_configs"
    config = json.loads((configs / f"{model.replace('/', '--')}_config.json").read_text())
    heads = int(config["num_attention_heads"])
    return ModelFacts(
        layers=int(config["num_hidden_layers"]),
        kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        max_context=int(config["max_position_embeddings"]),
    )


def _inter_node_gb_s(gpu: str) -> float:
    spec = yaml.safe_load((resources.files("aiconfigurator_core") / "systems" / f"{gpu}.yaml").read_text())
    return float(spec["node"]["inter_node_bw"]) / 1e9


def default_out(model: str, gpu: str, tp: int) -> Path:
    """deploy/profiles/qwen3-32b-h200-tp2.toml for Qwen/Qwen3-32B on h200_sxm at TP 2."""
    name = model.rsplit("/", 1)[-1].lower().removeprefix("meta-")
    return PROFILES_DIR / f"{name}-{gpu.split('_', 1)[0]}-tp{tp}.toml"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.profiles.generate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", required=True, help="HuggingFace path as aiconfigurator knows it")
    parser.add_argument("--gpu", required=True, help="aiconfigurator system: h200_sxm, h100_sxm")
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--served-model", help="the profile's model name (default: --model)")
    parser.add_argument("--out", type=Path, help="default: deploy/profiles/<model>-<gpu>-tp<tp>.toml")
    args = parser.parse_args(argv)
    measurements = query_aiconfigurator(args.model, args.gpu, args.tp)
    profile, prefill_fit, decode_fit = build_profile(measurements, args.served_model or args.model)
    out = args.out or default_out(args.model, args.gpu, args.tp)
    out.write_text(profile_toml(profile, header(measurements, prefill_fit, decode_fit)))
    print(f"{out}: prefill {prefill_fit.describe()}; decode {decode_fit.describe()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
