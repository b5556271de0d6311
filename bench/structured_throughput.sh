#!/usr/bin/env bash
# Structured outputs on vs off (issue 19): output throughput with a JSON schema on every request against
# the same server without one, Qwen3-8B shape (random weights), 1024:256, for rapid and hybrid, in ONE
# device call. Target: "on" within 5% of "off" (grammar work off the critical path).
#
# Fairness: random weights emit garbage, which under a grammar is still valid JSON but could end early;
# so every request asks exactly 256 tokens (the bench's min_tokens = max_tokens, ignore_eos) and the
# schema (bench/structured_outputs_body.json) is one string of at least 4000 characters, which no
# 256-token output completes: every token of every request is sampled under the grammar's mask.
#
# Before (here, once):
#   pip download llguidance==1.9.1 --no-deps --only-binary=:all: --platform manylinux_2_31_x86_64 -d .whl
#       (abi3; the GPU machine has no index; without manylinux_2_31 pip falls back to 1.6.1, which takes one
#       EOS id and fails every constrained request: the project needs llguidance>=1.7); .whl: also msgspec, posix_ipc
#   PYTHONPATH=. python bench/grammar_engines.py --save-tokenizer .sotok     # the Qwen-sized tokenizer (12 MiB;
#                                                                           # .sotok/ is git-ignored)
# Then:  run(command="bash bench/structured_throughput.sh", carry=[".whl", ".sotok"], timeout_s=600)
# Back in $OUT: structured_throughput.md (the table: medians over REPEATS, spread), structured_throughput.json,
# raw.tar.gz (each run's bench JSON/MD and each server's log).
# Knobs (environment): MODES ("rapid hybrid"), REPEATS (1; off and on alternate), MODEL (preset:qwen3-8b),
# NUM_PROMPTS (128), RATE (inf),
# INPUT_LEN (1024), OUTPUT_LEN (256), WARMUP (8), TOKENIZER (.sotok), SERVE_ARGS (extra `rapidserve serve` flags).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
out="${OUT:-bench/results/structured_throughput}"
mkdir -p "$out"
# shellcheck source=bench/structured_env.sh
source bench/structured_env.sh
structured_env structured_throughput.sh
port=8731
for mode in ${MODES:-rapid hybrid}; do
    log="$out/serve_$mode.log"
    # shellcheck disable=SC2086
    "$py" -m rapidserve.cli serve --model "${MODEL:-preset:qwen3-8b}" --tokenizer "$tok" --mode "$mode" \
        --port "$port" ${SERVE_ARGS:-} >"$log" 2>&1 &
    pid=$!
    wait_healthy "$port" "$pid"
    for rep in $(seq 1 "${REPEATS:-1}"); do  # off and on alternate, so drift hits both alike
        for variant in off on; do
            extra=()
            [[ $variant == on ]] && extra=(--extra-body @bench/structured_outputs_body.json)
            "$py" -m rapidserve.cli bench --base-url "http://127.0.0.1:$port" --workload fixed \
                --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-256}" --request-rate "${RATE:-inf}" \
                --num-prompts "${NUM_PROMPTS:-128}" --warmup "${WARMUP:-8}" --label "$mode-json-$variant" \
                --name "${mode}_json_${variant}_$rep" --out-dir "$out/raw" --no-plot --quiet "${extra[@]}" \
                || echo "structured_throughput.sh: bench $mode/$variant #$rep failed" >&2
        done
    done
    kill -TERM "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
done
"$py" - "$out" <<'PY' | tee "$out/structured_throughput.md"
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
def summaries(mode, variant):
    got = []
    for f in sorted((out / "raw").glob(f"{mode}_json_{variant}_*.json")):
        try:
            got.append(json.loads(f.read_text())["runs"][0]["summary"])
        except (OSError, KeyError, IndexError, ValueError):
            pass
    return got
table = {}
print("| mode | repeats | output tok/s off (median, min-max) | on | on/off of medians | pairwise on/off min-max "
      "| failed on | mean ITL ms off / on |")
print("|---|---|---|---|---|---|---|---|")
for mode in ("rapid", "hybrid"):
    off, on = summaries(mode, "off"), summaries(mode, "on")
    if not off or not on:
        continue
    t_off = [s["output_throughput"] for s in off]
    t_on = [s["output_throughput"] for s in on]
    pairs = [b / a for a, b in zip(t_off, t_on)]
    m_off, m_on = statistics.median(t_off), statistics.median(t_on)
    itl_off = statistics.median(s["itl_ms"]["mean"] for s in off)
    itl_on = statistics.median(s["itl_ms"]["mean"] for s in on)
    table[mode] = {"off": t_off, "on": t_on, "ratio_of_medians": m_on / m_off, "pairwise": pairs,
                   "failed_on": sum(s["failed"] for s in on), "itl_mean_ms_off": itl_off, "itl_mean_ms_on": itl_on}
    print(f"| {mode} | {len(pairs)} | {m_off:.0f} ({min(t_off):.0f}-{max(t_off):.0f}) | {m_on:.0f} "
          f"({min(t_on):.0f}-{max(t_on):.0f}) | {m_on / m_off:.3f} | {min(pairs):.3f}-{max(pairs):.3f} | "
          f"{table[mode]['failed_on']} | {itl_off:.1f} / {itl_on:.1f} |")
(out / "structured_throughput.json").write_text(json.dumps(table, indent=1))
PY
# the per-run records and server logs in one file (the device call returns a handful of files)
mkdir -p "$out/raw" && mv "$out"/serve_*.log "$out/raw/" 2>/dev/null
tar -czf "$out/raw.tar.gz" -C "$out" raw && rm -rf "$out/raw"
