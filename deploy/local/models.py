"""The test models' recipe (sizes) and the facts a launcher, an agent or a test needs about a model.

Pure Python, no vLLM/torch: `model_facts()` reads the model directory's `config.json`. The
recipe itself (`SIZES`, `RECIPE_VERSION`) is what `deploy/vllm/make_model.py` builds from, so a
cached model can be checked against it without starting the vLLM venv's python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

# Bump when the generated files would change (weights, tokenizer, template, config): cached
# models with another recipe version are rebuilt.
RECIPE_VERSION: Final = 2
STAMP_FILE: Final = "kvshuttle-model.json"


@dataclass(frozen=True)
class ModelSize:
    """One Llama shape. fp32 throughout (bf16 matmuls crawl on these CPUs)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_position_embeddings: int = 16384


SIZES: Final[dict[str, ModelSize]] = {
    # Tests: ~0.56M parameters, starts and answers fast.
    "tiny": ModelSize(vocab=2048, hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32),
    # Benchmarks/demo: ~57M parameters (the issue asks for 50-150M), Llama-like proportions
    # (GQA 12:4, MLP 2.67x). Sized by measured prefill time: 8k tokens take ~8.5 s on one core
    # here, the budget's upper end (deploy/vllm/README.md has the figures).
    "small": ModelSize(
        vocab=8192, hidden=768, intermediate=2048, layers=8, heads=12, kv_heads=4, head_dim=64
    ),
}

_DTYPE_BYTES: Final = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8_e4m3fn": 1,
    "fp8": 1,
}


@dataclass(frozen=True)
class ModelFacts:
    """What the control plane needs to know about a model's KV cache."""

    model_type: str
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    dtype: str
    dtype_bytes: int
    max_position_embeddings: int | None

    @property
    def kv_bytes_per_token(self) -> int:
        """layers x kv_heads x head_dim x 2 (K and V) x bytes per element."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes


def model_facts(model_dir: Path | str, *, dtype: str | None = None) -> ModelFacts:
    """Facts from `model_dir/config.json` (a Hugging Face Llama-style config).

    `dtype` overrides the config's own dtype: pass the engine's `--dtype` when it differs
    (the local launcher always runs float32).
    """
    config: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    text_config = config.get("text_config")
    if isinstance(text_config, dict):  # multimodal wrappers keep the LM's shape here
        config = {**config, **text_config}
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = config.get("head_dim") or hidden // heads
    name = str(dtype or config.get("dtype") or config.get("torch_dtype") or "float32")
    try:
        dtype_bytes = _DTYPE_BYTES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"{model_dir}: unknown dtype {name!r}") from None
    max_pos = config.get("max_position_embeddings")
    return ModelFacts(
        model_type=str(config.get("model_type", "")),
        layers=int(config["num_hidden_layers"]),
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        hidden=hidden,
        vocab=int(config["vocab_size"]),
        dtype=name,
        dtype_bytes=dtype_bytes,
        max_position_embeddings=None if max_pos is None else int(max_pos),
    )


def kv_bytes_per_token(model_dir: Path | str, *, dtype: str | None = None) -> int:
    """Bytes of KV cache one token occupies (all layers, K and V)."""
    return model_facts(model_dir, dtype=dtype).kv_bytes_per_token


def read_stamp(model_dir: Path) -> dict[str, Any] | None:
    """The stamp make_model.py writes last (so its presence means a complete model), or None."""
    try:
        stamp: dict[str, Any] = json.loads((model_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp


def is_built(model_dir: Path, size: str) -> bool:
    """True when `model_dir` holds a complete model of `size` built with the current recipe."""
    stamp = read_stamp(model_dir)
    return (
        stamp is not None
        and stamp.get("size") == size
        and stamp.get("recipe_version") == RECIPE_VERSION
        and stamp.get("shape") == SIZES[size].__dict__
    )
