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
#   pip download llguidance==1.9.1 --no-deps --only-binary=:all: -d .whl   # abi3 wheel (the GPU machine has no
#                                                                           # index); .whl: also msgspec, posix_ipc
#   PYTHONPATH=. python bench/grammar_engines.py --save-tokenizer .sotok     # the Qwen-sized tokenizer (12 MiB;
#                                                                           # .sotok/ is git-ignored)
# Then:  run(command="bash bench/structured_throughput.sh", carry=[".whl", ".sotok"], timeout_s=600)
# Back in $OUT: structured_throughput.md (the table), the bench JSON/MD of each run, each server's log.
# Knobs (environment): MODES ("rapid hybrid"), MODEL (preset:qwen3-8b), NUM_PROMPTS (128), RATE (inf),
# INPUT_LEN (1024), OUTPUT_LEN (256), WARMUP (8), TOKENIZER (.sotok), SERVE_ARGS (extra `rapidserve serve` flags).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
out="${OUT:-bench/results/structured_throughput}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null && ! "$py" -c 'import msgspec, posix_ipc, llguidance' 2>/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "structured_throughput.sh: installing the carried wheels failed" >&2; exit 2; }
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
tok="${TOKENIZER:-.sotok}"
if [[ ! -f "$tok/tokenizer.json" ]]; then
    "$py" bench/grammar_engines.py --save-tokenizer "$tok" \
        || { echo "structured_throughput.sh: no tokenizer in $tok and none could be made (see the header)" >&2; exit 2; }
fi
port=8731
for mode in ${MODES:-rapid hybrid}; do
    log="$out/serve_$mode.log"
    # shellcheck disable=SC2086
    "$py" -m rapidserve.cli serve --model "${MODEL:-preset:qwen3-8b}" --tokenizer "$tok" --mode "$mode" \
        --port "$port" ${SERVE_ARGS:-} >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do
        "$py" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    for variant in off on; do
        extra=()
        [[ $variant == on ]] && extra=(--extra-body @bench/structured_outputs_body.json)
        "$py" -m rapidserve.cli bench --base-url "http://127.0.0.1:$port" --workload fixed \
            --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-256}" --request-rate "${RATE:-inf}" \
            --num-prompts "${NUM_PROMPTS:-128}" --warmup "${WARMUP:-8}" --label "$mode-json-$variant" \
            --name "${mode}_json_$variant" --out-dir "$out" --no-plot --quiet "${extra[@]}" \
            || echo "structured_throughput.sh: bench $mode/$variant failed" >&2
    done
    kill -TERM "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
done
"$py" - "$out" <<'PY' | tee "$out/structured_throughput.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| mode | output tok/s off | output tok/s on | on/off | failed on | mean ITL ms off / on |")
print("|---|---|---|---|---|---|")
for mode in ("rapid", "hybrid"):
    try:
        off, on = (json.loads((out / f"{mode}_json_{v}.json").read_text())["runs"][0]["summary"] for v in ("off", "on"))
    except (OSError, KeyError, IndexError, ValueError):
        continue
    print(f"| {mode} | {off['output_throughput']:.0f} | {on['output_throughput']:.0f} | "
          f"{on['output_throughput'] / off['output_throughput']:.3f} | {on['failed']} | "
          f"{off['itl_ms']['mean']:.1f} / {on['itl_ms']['mean']:.1f} |")
PY
