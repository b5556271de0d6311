#!/usr/bin/env bash
# Where the worker loops spend their time (issue 19: structured outputs on vs off), in ONE device call:
# for each mode and variant, `rapidserve serve` runs under py-spy (every thread of every process, idle
# time included, no pausing of the target) while one `rapidserve bench` run goes through it; then
# bench/profile_summary.py prints the loop thread's phases and top frames.
#
# Before (here, once): the wheels of structured_throughput.sh in .whl, plus py-spy's:
#   pip download py-spy --no-deps --only-binary=:all: -d .whl
# Then:  run(command="bash bench/worker_profile.sh", carry=[".whl", ".sotok"], timeout_s=600)
# Back in $OUT: profile_summary.md (every summary), profiles.tar.gz (py-spy's raw stacks, the server logs,
# the bench records). Knobs (environment): MODES ("rapid hybrid"), VARIANTS ("off on"), MODEL
# (preset:qwen3-8b), NUM_PROMPTS (128), INPUT_LEN (1024), OUTPUT_LEN (256), RATE (inf), TOKENIZER
# (.sotok), SERVE_ARGS, SPY_RATE (samples/s, 100).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
out="${OUT:-bench/results/worker_profile}"
mkdir -p "$out/raw"
# shellcheck source=bench/structured_env.sh
source bench/structured_env.sh
structured_env worker_profile.sh
if ! command -v py-spy >/dev/null && compgen -G ".whl/py_spy-*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site .whl/py_spy-*.whl
    export PATH="/tmp/site/bin:$PATH"
fi
command -v py-spy >/dev/null || { echo "worker_profile.sh: no py-spy (see the header)" >&2; exit 2; }
port=8741
: >"$out/profile_summary.md"
for mode in ${MODES:-rapid hybrid}; do
    loop=DecodeWorker.run
    [[ $mode == hybrid ]] && loop=HybridWorker.run_ahead
    for variant in ${VARIANTS:-off on}; do
        name="${mode}_$variant"
        # shellcheck disable=SC2086
        py-spy record --subprocesses --idle --threads --nonblocking --format raw --rate "${SPY_RATE:-100}" \
            -o "$out/raw/$name.txt" -- "$py" -m rapidserve.cli serve --model "${MODEL:-preset:qwen3-8b}" \
            --tokenizer "$tok" --mode "$mode" --port "$port" ${SERVE_ARGS:-} >"$out/raw/serve_$name.log" 2>&1 &
        spy=$!
        wait_healthy "$port" "$spy"
        extra=()
        [[ $variant == on ]] && extra=(--extra-body @bench/structured_outputs_body.json)
        "$py" -m rapidserve.cli bench --base-url "http://127.0.0.1:$port" --workload fixed \
            --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-256}" --request-rate "${RATE:-inf}" \
            --num-prompts "${NUM_PROMPTS:-128}" --warmup 8 --label "$name" --name "$name" --out-dir "$out/raw" \
            --no-plot --quiet "${extra[@]}" || echo "worker_profile.sh: bench $name failed" >&2
        kill -TERM $(pgrep -P "$spy") 2>/dev/null  # the server (py-spy's child); py-spy writes once it exits
        wait "$spy" 2>/dev/null
        { echo "## $name"; "$py" -c "import json,sys; s=json.load(open(sys.argv[1]))['runs'][0]['summary']; print(f\"output {s['output_throughput']:.0f} tok/s, mean ITL {s['itl_ms']['mean']:.1f} ms\n\")" "$out/raw/$name.json" 2>/dev/null
          "$py" bench/profile_summary.py "$out/raw/$name.txt" --loop "$loop"; echo; } | tee -a "$out/profile_summary.md"
    done
done
tar -czf "$out/profiles.tar.gz" -C "$out" raw && rm -rf "$out/raw"
