#!/usr/bin/env bash
# Two GPUs (nvidia-h200-x2), one device call: the carried wheels, the GPU count, the 2-GPU tensor-parallel
# tests (tests/test_tp_engines.py -m gpu), then a short serve of preset:qwen3-14b at TP 2 (rapid, hybrid) with
# one closed 1024:256 run each. NCCL's NVLink multicast stays off (KINDS.md).
#   run(command="bash bench/tp_smoke.sh", carry=[".whl"], kind="nvidia-h200-x2", timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out="${OUT:-bench/results/tp_smoke}"
mkdir -p "$out"
py="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null && ! "$py" -c 'import msgspec, posix_ipc' 2>/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -5
"$py" -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
timeout 300 "$py" -m pytest -q -x -m gpu tests/test_tp_engines.py 2>&1 | tail -25 | tee "$out/tp_tests.log"
if [ "${SERVE:-1}" = 1 ]; then
    timeout 360 "$py" bench/compare.py --model preset:qwen3-14b --systems "" \
        --system "rapid-tp2=-tp 2" --system "hybrid-tp2=--mode hybrid -tp 2 --max-num-batched-tokens 8192" \
        --serve-args "--max-model-len 8192 --gpu-memory-utilization 0.8 --no-enable-prefix-caching" \
        --workloads "${WORKLOADS:-1024:256}" --rates inf --num-prompts 64 --warmup 4 --startup-timeout-s 240 \
        --duration-budget-s 300 --out "$out" --name tp_smoke 2>&1 | tail -40
    for f in "$out"/compare_logs/*; do echo "== $f"; grep -iE "error|Traceback|nccl|ready|partition" "$f" | tail -15; done
fi
