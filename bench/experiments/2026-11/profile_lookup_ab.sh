#!/usr/bin/env bash
# Is `--profile-lookup interpolate` safe with a profile whose decode steps beside prefill were measured beside
# forwards as long as the engine's? In ONE H100 call (~6 min):
#   run(command="OUT=$OUT bash bench/experiments/2026-11/profile_lookup_ab.sh", carry=[".whl", ".sotok"], timeout_s=600)
# 1. `rapidserve profile --prefill-tokens 8192` (the engine's prefill budget; the committed H100 profile was
#    measured beside 4096-token forwards; ~3 min) into $OUT/prof8192.json.
# 2. bench/rapid_ab.sh on WORKLOAD (4096:64) closed and at RATES (5.9 req/s: 0.75 of vLLM 0.24's peak on the H100,
#    2026-11-27): the committed profile rounded up (today's default), the new profile rounded up, and the new
#    profile interpolated. Tables in $OUT/ab/rapid_ab.md.
# Knobs: SKIP (space-separated of profile, ab), WORKLOAD, RATES, NUM_PROMPTS (64).
# Why: bench/results/h100_1127/profile_lookup/README.md (interpolate: +6% closed on 4096:64, p99 ITL 63 ms).
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2  # the repository root
out="${OUT:-bench/results/profile_lookup_ab}"
mkdir -p "$out"
skip=" ${SKIP:-} "
# shellcheck source=bench/structured_env.sh
source bench/structured_env.sh
structured_env profile_lookup_ab.sh  # the carried wheels and the tokenizer rapid_ab.sh needs; sets py
status=0
prof="$out/prof8192.json"
if [[ "$skip" != *" profile "* ]]; then
    "$py" -m rapidserve.cli profile --model preset:qwen3-8b --slo-itl-ms 50 --prefill-tokens 8192 --out "$prof" \
        >"$out/profile.log" 2>&1 || { echo "profile failed: see $out/profile.log"; tail -5 "$out/profile.log"; status=1; }
fi
if [[ "$skip" != *" ab "* ]]; then
    if [ -f "$prof" ]; then
        new="newround=--profile $prof --profile-lookup round-up;newinterp=--profile $prof --profile-lookup interpolate"
        variants="committed=--profile-lookup round-up;$new"
    else
        echo "no $prof: the A/B runs the committed profile only"
        variants="committed=--profile-lookup round-up;interp=--profile-lookup interpolate"
    fi
    OUT="$out/ab" WORKLOAD="${WORKLOAD:-4096:64}" RATES="${RATES:-5.9}" NUM_PROMPTS="${NUM_PROMPTS:-64}" \
        VARIANTS="$variants" bash bench/rapid_ab.sh 2>&1 | tail -12 || status=1
fi
exit "$status"
