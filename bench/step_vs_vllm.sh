#!/usr/bin/env bash
# Our prefill step beside vLLM 0.26's, one model shape, one GPU, one device call (issue 37 / 39: where the unbounded
# peak's 5-15% goes on prompt-heavy work). After the `bash bench/vs_vllm.sh --stash` calls (one per part
# `bash bench/vs_vllm.sh --split` cut, .peer/c0..cN-1, back to back on one machine):
#     run(command="bash bench/step_vs_vllm.sh", carry=[".whl"], timeout_s=600)
# 1. `bash bench/vs_vllm.sh --prepare` (PRESET, default qwen3-8b; VLLM_FP8=checkpoint with FP8=1): vLLM installed
#    from the stash into /root/peersite (vllm_step_profile.py writes its own model folder, the preset's shape,
#    /root/peermodel-PRESET[-fp8], with make_peer_model.py where it is missing);
# 2. ours: bench/fused_step_profile.py --backend fa3 (vLLM's FA3 build, as serving beside vLLM does) --no-ladder:
#    each SHAPES step timed back to back and profiled by kernel category;
# 3. vLLM's: bench/vllm_step_profile.py --compare (2)'s JSON: its prefill request of each PROMPT_LENS length
#    (default 2048,4096,8192) timed and profiled, and the per-category difference ours - vLLM's.
# STEPS (default 5): timed and profiled steps a shape, both sides. OURS_JSON=PATH: skip (2) and compare with that
# fused_step_profile.json (e.g. the 70B shape in two calls on one machine, ours in the first:
# PRESET=llama-3.1-70b FP8=1 STEPS=3 PROMPT_LENS=2048,8192; vLLM's start on it with its compile is ~3-4 min).
# IDLE_MS=M (default 0): each of our steps after M ms with the GPU idle (fused_step_profile.py --idle-ms), so both
# sides run at the clocks of one request at a time (40 ms matched vLLM's GEMM times on Qwen3-8B). With 0, read the
# GEMM rows with the clocks in mind: ours are timed back to back, vLLM's one request at a time with its
# host's gaps, and a power-limited H200 runs the same cuBLASLt kernels 5-15% faster after idling
# (bench/gemm_duty_cycle.py, bench/results/h200_1202b/: 2026-12-02's Qwen3-8B run saw exactly that).
# $OUT (default bench/results/step_vs_vllm) gets prep/, ours/fused_step_profile.{json,md}, vllm_step_profile.{json,md}
# and the logs; the comparison table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${OUT:-bench/results/step_vs_vllm}"
preset="${PRESET:-qwen3-8b}"
export PYTHONUNBUFFERED=1
mkdir -p "$out/prep" "$out/ours"
t0=$(date +%s)
say() { echo "step_vs_vllm [$(($(date +%s) - t0)) s]: $*"; }
fp8_env=() ours_q=() vllm_q=()
if [ "${FP8:-0}" = 1 ]; then
    fp8_env=(VLLM_FP8=checkpoint "SERVE_ARGS=--quantization fp8")
    ours_q=(--quantization fp8) vllm_q=(--fp8)
fi
if ! env OUT="$out/prep" PRESET="$preset" "${fp8_env[@]}" bash bench/vs_vllm.sh --prepare; then
    say "prepare failed"; exit 2
fi
py=python3 site=/root/peersite
# shellcheck source=bench/wheels.sh
. bench/wheels.sh
carried_wheels step_vs_vllm || exit 2
# shellcheck source=bench/peer_env.sh
. bench/peer_env.sh
expose_fa3 || exit 2
ours_json="${OURS_JSON:-$out/ours/fused_step_profile.json}"
if [ -z "${OURS_JSON:-}" ]; then
    say "ours: fused_step_profile.py --backend fa3"
    if ! "$py" bench/fused_step_profile.py --model "preset:$preset" --backend fa3 --no-ladder \
            --steps "${STEPS:-5}" --idle-ms "${IDLE_MS:-0}" "${ours_q[@]}" --out "$out/ours" >"$out/ours.log" 2>&1; then
        tail -30 "$out/ours.log"; say "ours failed"; exit 1
    fi
    cat "$out/ours/fused_step_profile.md"
fi
say "vLLM: vllm_step_profile.py (its model folder: /root/peermodel-$preset${vllm_q[*]:+-fp8}, written when missing)"
PYTHONPATH="$site" "$py" bench/vllm_step_profile.py --preset "$preset" "${vllm_q[@]}" \
    --prompt-lens "${PROMPT_LENS:-2048,4096,8192}" --steps "${STEPS:-5}" --compare "$ours_json" --out "$out" \
    >"$out/vllm.log" 2>&1
s=$?
grep -v "^\(INFO\|WARNING\|DEBUG\)" "$out/vllm.log" | tail -60
say "vllm_step_profile.py exited with $s"
exit "$s"
