#!/usr/bin/env bash
# Piecewise prefill graphs (rapidserve/runner/prefill_graphs.py) on one GPU: checks, the kernel-level probe and the
# engine A/B, graphs (the default) against `--prefill-graph-tokens none`. Steps, each skippable (SKIP="..."):
#   tests   pytest -m gpu of the graphs and of the two-process engine that replays them (~2 min)
#   probe   bench/experiments/2026-11/prefill_graph_probe.py: eager / piecewise / whole-graph prefill, 16-2048 tokens (~1 min)
#   rapid   bench/rapid_ab.sh, rapid mode, WORKLOAD (256:128) closed and at RATES (4 16) (~5 min)
#   hybrid  the same in hybrid mode (~4 min)
# Device calls (600 s each at most), back to back:
#   run(command="SKIP='rapid hybrid' OUT=$OUT bash bench/experiments/2026-11/prefill_graphs_ab.sh", carry=[".whl", ".sotok"])
#   run(command="SKIP='tests probe hybrid' OUT=$OUT bash bench/experiments/2026-11/prefill_graphs_ab.sh", carry=[".whl", ".sotok"])
#   run(command="SKIP='tests probe rapid' OUT=$OUT bash bench/experiments/2026-11/prefill_graphs_ab.sh", carry=[".whl", ".sotok"])
# Tables: $OUT/probe/prefill_graph_probe.json (+ printed), $OUT/rapid/rapid_ab.md, $OUT/hybrid/rapid_ab.md.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2  # the repository root
out="${OUT:-bench/results/prefill_graphs_ab}"
mkdir -p "$out"
skip=" ${SKIP:-} "
# shellcheck source=bench/structured_env.sh
source bench/structured_env.sh
structured_env prefill_graphs_ab.sh  # the carried wheels and the tokenizer rapid_ab.sh needs; sets py
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ "$skip" != *" tests "* ]]; then
    "$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_prefill_graphs_gpu.py tests/test_attention.py \
        tests/test_engine_gpu.py tests/test_hybrid_engine.py \
        >"$out/tests.log" 2>&1 || status=1
    tail -3 "$out/tests.log"
fi
if [[ "$skip" != *" probe "* ]]; then
    "$py" bench/experiments/2026-11/prefill_graph_probe.py --out "$out/probe" 2>&1 | grep -v -i warn | tail -16 || status=1
fi
variants="graphs=;eager=--prefill-graph-tokens none"
for mode in rapid hybrid; do
    [[ "$skip" == *" $mode "* ]] && continue
    OUT="$out/$mode" MODE="$mode" WORKLOAD="${WORKLOAD:-256:128}" RATES="${RATES:-4 16}" \
        NUM_PROMPTS="${NUM_PROMPTS:-64}" VARIANTS="$variants" bash bench/rapid_ab.sh 2>&1 | tail -10 || status=1
done
exit "$status"
