#!/usr/bin/env bash
# Issue 15's hit-rate target on one GPU, in ONE device call: `pytest -m gpu` first (the prefix-in-flight
# admission rule and prefill's arrival order are GPU-side changes), then rapid and hybrid replaying Mooncake
# conversation windows, and a table of each run's measured prefix-cache hit rate against the window's ideal
# (every earlier replayed prompt cached), printed last. No vLLM here (no stash calls needed).
#
#   run(command="OUT=$OUT bash bench/experiments/2026-11/prefix_hit_check.sh", carry=[".whl", ".traces"], timeout_s=600)
#
# Windows (WINDOWS, ';'-separated `rapidserve bench` trace flags): Mooncake [0, 15) s x1 (the H100 table's
# window: rapid 3.7% of an ideal 4.6% before the rule) and [450, 470) s x0.25 (within the H200's capacity-
# allowing window, where [450, 480) gave rapid 9.4% of 10.1%). Knobs: SYSTEMS (rapid-adaptive,hybrid-8192),
# SERVE_ARGS (32K context, 0.9 of the GPU), SKIP_SUITE=1 (benchmarks only). Back in $OUT: gpu_suite.*,
# prefix_hit.md / .json (compare.py's tables), prefix_hit_rates.md (the table below), compare_runs/ (every
# request).
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2  # the repository root
out="${OUT:-bench/results/prefix_hit}"
mkdir -p "$out"
py="${PYTHON:-python3}"
# shellcheck source=bench/wheels.sh
. bench/wheels.sh
carried_wheels prefix_hit_check || { echo "prefix_hit_check: installing the carried wheels (.whl) failed" >&2; exit 2; }

suite=0
if [ "${SKIP_SUITE:-0}" != 1 ]; then
    OUT="$out" bash bench/gpu_suite.sh --timeout-s 200 | tail -8
    suite=${PIPESTATUS[0]}
fi

trace=.traces/mooncake_conversation.jsonl.gz
[ -f "$trace" ] || { echo "prefix_hit_check: no $trace: carry .traces (a copy of ../shared/traces)" >&2; exit 2; }
windows="${WINDOWS:---workload trace --trace $trace --duration-s 15 --time-scale 1;--workload trace --trace $trace --trace-start 450 --duration-s 20 --time-scale 0.25}"
args=()
IFS=';' read -ra sets <<<"$windows"
for w in "${sets[@]}"; do
    args+=(--workload-args "$w")
done
timeout -k 20 360 "$py" bench/compare.py --model preset:qwen3-8b --systems "${SYSTEMS:-rapid-adaptive,hybrid-8192}" \
    --serve-args "${SERVE_ARGS:---max-model-len 32768 --gpu-memory-utilization 0.9}" "${args[@]}" \
    --rates inf --num-prompts 1000 --warmup 2 --duration-budget-s 320 --out "$out" --name prefix_hit >"$out/compare.log" 2>&1
status=$?
tail -5 "$out/compare.log"

"$py" - "$out" <<'EOF' | tee "$out/prefix_hit_rates.md"
import glob, json, os, sys
out = sys.argv[1]
rows = ["| system | window | requests | ideal hit rate | measured | measured / ideal |", "|---|---|---|---|---|---|"]
for f in sorted(glob.glob(os.path.join(out, "compare_runs", os.environ.get("RUNS_GLOB", "prefix_hit__*.json")))):
    d = json.load(open(f))
    t = d.get("trace") or {}
    for r in d.get("runs", []):
        pc = r.get("prefix_cache") or {}
        ideal, got = t.get("ideal_hit_rate"), pc.get("hit_rate")
        if ideal is None or got is None:
            continue
        ratio = f"{got / ideal:.2f}" if ideal else "-"
        w = t.get("window_s") or ["?", "?"]
        window = f"[{w[0]:g}, {w[1]:g}) s, {float(r.get('rate', 0)):.2f} req/s offered"
        n = (r.get("summary") or {}).get("completed", "?")
        rows.append(f"| {d.get('label')} | {window} | {n} | {ideal:.1%} | {got:.1%} | {ratio} |")
print("\n".join(rows))
EOF
[ "$suite" = 0 ] && [ "$status" = 0 ]
