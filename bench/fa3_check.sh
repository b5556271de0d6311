#!/usr/bin/env bash
# FlashAttention-3 on the GPU machine, in ONE device call after the `bench/vs_vllm.sh --stash` calls (one per part
# `bash bench/vs_vllm.sh --split` cut, .peer/c0 .. cN-1):
# installs vLLM from the stashed parts (its FA3 build is the one rapidserve's fa3 backend loads), then the
# parts named in PARTS (comma-separated, in this order; default kernels,suite):
#   kernels  bench/attention_kernels.py: Triton vs FA3 (paged) vs torch SDPA, 4K/8K/16K, decode batches 1-256
#            (KERNEL_ARGS: more flags, e.g. --only prefill);
#   suite    bench/gpu_suite.sh: `pytest -m gpu` with FA3 found, so the engine tests run attention_backend
#            auto = FA3 (SUITE_BUDGET_S, default 330; SUITE_ARGS replaces gpu_suite.sh's flags, e.g. on x2 the whole
#            suite side by side: SUITE_ARGS="--spread --timeout-s 150". Without the stash, gpu_suite.sh alone skips
#            the FA3 tests: 11 skipped at 2026-11-30, no FlashAttention-3 build found; TRITON_CACHE=DIR passes
#            --triton-cache DIR on: Triton's cache seeded from and packed for the carried DIR, see gpu_suite.sh);
#   runner   bench/model_runner.py --model preset:qwen3-8b (GEMM/copy ceilings, prefill and decode rates);
#   profile  bench/step_profile.py: one prefill and one decode step by kernel category, Triton vs FA3;
#   partition  `rapidserve profile` of preset:qwen3-8b on this GPU (the adaptive manager's table), then
#            bench/compare.py of rapid-adaptive without it (roofline fallback, as when no profile is
#            committed) and with it, 4096:64 at 6.6 req/s and closed;
#   hybrid   bench/compare.py: hybrid-8192 scheduling ahead (the default) and waiting for each step
#            (--no-async-scheduling), 1024:256 and 4096:64, closed and one Poisson rate;
#   shard    `rapidserve profile --shard-of-tp $SHARD_TP` of $SHARD_MODEL (default 2, preset:llama-3.1-70b): one
#            tensor-parallel rank's shard measured alone on this GPU (the TP profile the engine picks at -tp N),
#            written to $OUT and to profiles/ (SHARD_ARGS: the grid; default a 60-cell one, ~5 min for a 70B shard);
#   tp2      `pytest -m gpu` of the two-GPU tests (TP engines, disagg connector, DP);
#   compare  bench/compare.py --model preset:qwen3-8b --out $OUT $COMPARE_ARGS (ours only: any systems and
#            workloads, with FA3 found), e.g. COMPARE_ARGS='--systems rapid-adaptive --workloads multiturn ...'.
#      run(command="bash bench/fa3_check.sh", carry=[".whl"], timeout_s=600)
# $OUT gets each part's .json / .md / .log (and the suite's logs). Tables printed last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
stash="${PEER_STASH:-/root/peerstash}"
site="${PEER_SITE:-/root/peersite}"
py="${PYTHON:-python3}"
out="${OUT:-bench/results/fa3_check}"
mkdir -p "$out"
setup_log="$out/fa3_setup.log"
: >"$setup_log"
t_start=$(date +%s)
say() { echo "fa3_check [$(($(date +%s) - t_start)) s]: $*" | tee -a "$setup_log"; }
export PYTHONUNBUFFERED=1
# Multi-GPU machines: NVLink multicast stays off for every program (the device library's KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# shellcheck source=bench/wheels.sh
. bench/wheels.sh
carried_wheels fa3_check || { say "installing the carried wheels (.whl) failed"; exit 2; }
recipe=""
for d in .peer/peer_vllm "$stash/peer_vllm"; do [ -f "$d/install.sh" ] && recipe="$d" && break; done
# shellcheck source=bench/peer_env.sh
. bench/peer_env.sh
why_not=""
peer_install
if [ -n "$why_not" ]; then
    say "vLLM (and so FA3) not installed: $why_not; measuring Triton alone"
else
    expose_fa3
fi
parts=",${PARTS:-kernels,suite},"
status=0
tails=()
if [[ $parts == *,kernels,* ]]; then
    say "attention kernels"
    "$py" bench/attention_kernels.py --json "$out/attention_kernels.json" ${KERNEL_ARGS:-} >"$out/attention_kernels.log" 2>&1
    s=$?; say "attention_kernels.py exited with $s"; status=$((status || s))
    tails+=("$out/attention_kernels.log")
fi
if [[ $parts == *,suite,* ]]; then
    # shellcheck disable=SC2086  # SUITE_ARGS: words for gpu_suite.sh
    OUT="$out" bash bench/gpu_suite.sh ${TRITON_CACHE:+--triton-cache "$TRITON_CACHE"} \
        ${SUITE_ARGS:---repeat 1 --budget-s ${SUITE_BUDGET_S:-330} --timeout-s 200}
    s=$?; status=$((status || s))
fi
if [[ $parts == *,runner,* ]]; then
    say "model runner"
    "$py" bench/model_runner.py --model preset:qwen3-8b --out "$out" >"$out/model_runner.log" 2>&1
    s=$?; say "model_runner.py exited with $s"; status=$((status || s))
    tails+=("$out/model_runner.log")
fi
if [[ $parts == *,profile,* ]]; then
    say "step profile"
    "$py" bench/step_profile.py --out "$out" >"$out/step_profile.log" 2>&1
    s=$?; say "step_profile.py exited with $s"; status=$((status || s))
    tails+=("$out/step_profile.md")
fi
if [[ $parts == *,partition,* ]]; then
    prof="$out/$("$py" -c 'import torch; from rapidserve.partition.profile import profile_filename; print(profile_filename(torch.cuda.get_device_name(), "preset:qwen3-8b"))')"
    say "partition profile -> $prof"
    "$py" -m rapidserve.cli profile --model preset:qwen3-8b --max-model-len 8192 --gpu-memory-utilization 0.8 \
        --out "$prof" >"$out/partition_profile.log" 2>&1
    s=$?; say "rapidserve profile exited with $s"; status=$((status || s))
    if [ "$s" = 0 ]; then
        "$py" bench/compare.py --model preset:qwen3-8b --systems rapid-adaptive \
            --system "rapid-adaptive-profiled=--mode rapid --partition adaptive --profile $prof" \
            --serve-args "--max-model-len 8192 --gpu-memory-utilization 0.8" --workloads 4096:64 --rates 6.6,inf \
            --num-prompts 80 --warmup 4 --out "$out" --name partition_profile >"$out/partition_compare.log" 2>&1
        s=$?; say "compare.py exited with $s"; status=$((status || s))
        tails+=("$out/partition_compare.log")
    fi
    tails+=("$out/partition_profile.log")
fi
if [[ $parts == *,shard,* ]]; then
    smodel="${SHARD_MODEL:-preset:llama-3.1-70b}"
    stp="${SHARD_TP:-2}"
    prof="$("$py" -c 'import sys, torch; from rapidserve.partition.profile import profile_filename; print(profile_filename(torch.cuda.get_device_name(), sys.argv[1], int(sys.argv[2])))' "$smodel" "$stp")"
    say "shard profile of $smodel at TP $stp -> $out/$prof"
    # shellcheck disable=SC2086
    timeout -k 10 "${SHARD_TIMEOUT_S:-480}" "$py" -m rapidserve.cli profile --model "$smodel" --shard-of-tp "$stp" \
        --max-model-len 8192 --gpu-memory-utilization 0.9 \
        ${SHARD_ARGS:---batch-buckets 1,16,64,128 --context-buckets 512,2048,8192 --decode-reps 10} \
        --out "$out/$prof" >"$out/shard_profile.log" 2>&1
    s=$?; say "rapidserve profile exited with $s"; status=$((status || s))
    [ "$s" = 0 ] && cp "$out/$prof" profiles/
    tails+=("$out/shard_profile.log")
fi
if [[ $parts == *,tp2,* ]]; then
    say "two-GPU tests"
    timeout -k 10 "${TP2_TIMEOUT_S:-240}" "$py" -m pytest -m gpu -q -x --no-header -p no:cacheprovider \
        tests/test_tp_engines.py tests/test_disagg_connector.py tests/test_data_parallel_engines.py -rs >"$out/tp2_tests.log" 2>&1
    s=$?; say "two-GPU tests exited with $s"; status=$((status || s))
    tails+=("$out/tp2_tests.log")
fi
if [[ $parts == *,hybrid,* ]]; then
    say "hybrid scheduling ahead vs waiting"
    "$py" bench/compare.py --model preset:qwen3-8b --systems hybrid-8192 \
        --system "hybrid-8192-sync=--mode hybrid --max-num-batched-tokens 8192 --no-async-scheduling" \
        --serve-args "--max-model-len 8192 --gpu-memory-utilization 0.8" --workloads 1024:256,4096:64 --rates 10,inf \
        --num-prompts 120 --warmup 4 --out "$out" --name hybrid_ahead >"$out/hybrid_ahead.log" 2>&1
    s=$?; say "compare.py exited with $s"; status=$((status || s))
    tails+=("$out/hybrid_ahead.log")
fi
if [[ $parts == *,compare,* ]]; then
    say "compare.py $COMPARE_ARGS"
    eval "\"\$py\" bench/compare.py --model preset:qwen3-8b --out \"\$out\" $COMPARE_ARGS" >"$out/compare.log" 2>&1
    s=$?; say "compare.py exited with $s"; status=$((status || s))
    tails+=("$out/compare.log")
fi
for t in "${tails[@]}"; do
    echo "===== $t"
    tail -n 45 "$t"
done
exit "$status"
