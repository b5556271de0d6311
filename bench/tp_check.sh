#!/usr/bin/env bash
# Two GPUs (nvidia-h200-x2), one device call, rapidserve only (vLLM beside us: bench/vs_vllm.sh with PRESET and
# --system flags). Parts (PARTS, comma-separated, in this order; default tests,allreduce,compare):
#   tests      the 2-GPU tests: tests/test_tp_engines.py and tests/test_disagg_connector.py, -m gpu
#   allreduce  bench/tp_allreduce.py: the per-phase communicators' all-reduce time inside partitions
#   compare    bench/compare.py on preset:$PRESET (qwen3-14b) with SYSTEMS (';'-separated LABEL=FLAGS, default
#              rapid TP 2 and hybrid TP 2), WORKLOADS (1024:256), RATES (inf), NUM_PROMPTS (64), SERVE_ARGS
# NCCL's NVLink multicast stays off (the device library's KINDS.md).
#   run(command="bash bench/tp_check.sh", carry=[".whl"], kind="nvidia-h200-x2", timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out="${OUT:-bench/results/tp_check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
t0=$(date +%s)
# shellcheck source=bench/wheels.sh
. bench/wheels.sh
carried_wheels tp_check.sh || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
parts=",${PARTS:-tests,allreduce,compare},"
tables=()
if [[ $parts == *,tests,* ]]; then
    timeout 240 "$py" -m pytest -q -m gpu tests/test_tp_engines.py tests/test_disagg_connector.py tests/test_data_parallel_engines.py 2>&1 | tail -15 \
        | tee "$out/tp_tests.log"
fi
if [[ $parts == *,allreduce,* ]]; then
    timeout 200 "$py" bench/tp_allreduce.py --json "$out/tp_allreduce.json" >"$out/tp_allreduce.md" 2>"$out/tp_allreduce.log"
    echo "tp_allreduce.py exited with $?"; tail -5 "$out/tp_allreduce.log"
    tables+=("$out/tp_allreduce.md")
fi
if [[ $parts == *,compare,* ]]; then
    sys_args=()
    IFS=';' read -ra sys <<<"${SYSTEMS:-rapid-tp2=-tp 2;hybrid-tp2=--mode hybrid -tp 2 --max-num-batched-tokens 8192}"
    for s in "${sys[@]}"; do sys_args+=(--system "$s"); done
    left=$((${BUDGET_S:-560} - $(date +%s) + t0))
    timeout -k 20 "$left" "$py" bench/compare.py --model "preset:${PRESET:-qwen3-14b}" --systems "" "${sys_args[@]}" \
        --serve-args "${SERVE_ARGS:---max-model-len 8192 --gpu-memory-utilization 0.8}" \
        --workloads "${WORKLOADS:-1024:256}" --rates "${RATES:-inf}" --num-prompts "${NUM_PROMPTS:-64}" --warmup 4 \
        --startup-timeout-s 300 --duration-budget-s $((left - 40)) --out "$out" --name "${NAME:-tp_check}" \
        >"$out/compare_stdout.log" 2>&1
    echo "compare.py exited with $?"
    grep -E "rate |did not start" "$out/compare_stdout.log" | tail -30
    for f in "$out"/compare_logs/*; do echo "== $f"; grep -E "memory:|partition:|Error|Traceback" "$f" | head -8; done
    tables+=("$out/${NAME:-tp_check}.md")
fi
for t in "${tables[@]}"; do echo "===== $t"; cat "$t" 2>/dev/null; done
