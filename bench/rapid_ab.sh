#!/usr/bin/env bash
# rapid-mode variants A/B on one GPU, in ONE device call: for each variant (a label and extra `rapidserve
# serve` flags) a rapid server is started and the same client runs the workload closed (all at once) and as
# Poisson arrivals at each rate; the table (closed req/s, p99 ITL, TTFT p50/p99 at each rate) is printed
# last and written to $OUT/rapid_ab.md (+ .json; each run's bench JSON in $OUT/raw).
#   run(command="OUT=$OUT bash bench/rapid_ab.sh", carry=[".whl"], timeout_s=600)
# Knobs (environment): VARIANTS ("label=flags;label=flags", default
# "pbt8192=--prefill-batch-tokens 8192;pbt2048=--prefill-batch-tokens 2048"), WORKLOAD (2048:28),
# RATES (13.19: 0.75 of vLLM 0.24's closed peak on the H100, 2026-11-27), NUM_PROMPTS (80), MODE (rapid; hybrid
# runs the same variants in hybrid mode),
# MODEL (preset:qwen3-8b), SERVE_ARGS (--no-enable-prefix-caching --max-model-len 8192
# --gpu-memory-utilization 0.8: every variant's), REPEATS (1), WARMUP_CLOSED (1: a discarded closed pass per server),
# SLO_MS (50: the table's share of requests whose p95 inter-token gap is over it). The table also gives each run's
# server steps (rapidserve/benchmark/step_mix.py's cell: shares, measured/predicted, over SLO, and the host's view:
# token gaps over the SLO, device idle before the steps).
# (bench/results/prefill_batch_ab/ came from this script's first form, prefill_batch_ab.sh at 1f5c648, whose
# SETTINGS="8192 2048 4096" are the variants pbt8192, pbt2048, pbt4096 here.)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${OUT:-bench/results/rapid_ab}"
mkdir -p "$out/raw"
# shellcheck source=bench/structured_env.sh
source bench/structured_env.sh
structured_env rapid_ab.sh
in_len="${WORKLOAD:-2048:28}"; out_len="${in_len#*:}"; in_len="${in_len%%:*}"
port=8741
IFS=';' read -r -a variants <<<"${VARIANTS:-pbt8192=--prefill-batch-tokens 8192;pbt2048=--prefill-batch-tokens 2048}"
for variant in "${variants[@]}"; do
    label="${variant%%=*}"; flags="${variant#*=}"
    [[ "$label" =~ ^[A-Za-z0-9-]+$ ]] || { echo "rapid_ab.sh: variant label '$label': letters, digits, '-' only" >&2; exit 2; }
    log="$out/serve_$label.log"
    # shellcheck disable=SC2086
    "$py" -m rapidserve.cli serve --model "${MODEL:-preset:qwen3-8b}" --port "$port" --mode "${MODE:-rapid}" \
        ${SERVE_ARGS:---no-enable-prefix-caching --max-model-len 8192 --gpu-memory-utilization 0.8} \
        $flags >"$log" 2>&1 &
    pid=$!
    wait_healthy "$port" "$pid"
    # A discarded closed pass first: the first server on a fresh machine JIT-compiles Triton kernels for the
    # burst's batch shapes, which cost the first variant 40% of its closed throughput on 2026-11-27
    # (bench/results/h100_1127/prefill_graphs/README.md). WARMUP_CLOSED=0 skips it.
    if [ "${WARMUP_CLOSED:-1}" = 1 ]; then
        "$py" -m rapidserve.cli bench --base-url "http://127.0.0.1:$port" --workload fixed \
            --input-len "$in_len" --output-len "$out_len" --request-rate inf --seed 99 \
            --num-prompts "${NUM_PROMPTS:-80}" --warmup 0 --label "$label@warmup" \
            --name "warmup_$label" --out-dir "$out/warmup" --no-plot --quiet \
            || echo "rapid_ab.sh: warm-up pass of $label failed" >&2
    fi
    for rep in $(seq 1 "${REPEATS:-1}"); do
        for rate in inf ${RATES:-13.19}; do
            "$py" -m rapidserve.cli bench --base-url "http://127.0.0.1:$port" --workload fixed \
                --input-len "$in_len" --output-len "$out_len" --request-rate "$rate" --seed "$rep" \
                --num-prompts "${NUM_PROMPTS:-80}" --warmup 4 --label "$label@$rate" \
                --name "ab_${label}_${rate}_$rep" --out-dir "$out/raw" --no-plot --quiet \
                || echo "rapid_ab.sh: bench $label @ $rate #$rep failed" >&2
        done
    done
    kill -TERM "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
done
"$py" - "$out" "${SLO_MS:-50}" <<'PY' | tee "$out/rapid_ab.md"
import json, pathlib, re, statistics, sys
from rapidserve.benchmark.step_mix import step_cell
out, slo = pathlib.Path(sys.argv[1]), float(sys.argv[2])
runs = {}
for f in sorted((out / "raw").glob("ab_*.json")):
    m = re.match(r"ab_([A-Za-z0-9-]+)_([^_]+)_(\d+)\.json$", f.name)
    try:
        r = json.loads(f.read_text())["runs"][0]
        r["summary"]
    except (OSError, KeyError, IndexError, ValueError):
        continue
    runs.setdefault((m[1], m[2]), []).append(r)


def over_slo(run):
    """The share of a run's requests whose p95 inter-token gap is over the SLO (the goodput's ITL rule)."""
    gaps = [sorted(q["itl_s"]) for q in run.get("requests", []) if q.get("success") and q.get("itl_s")]
    return sum(g[int(0.95 * (len(g) - 1))] * 1e3 > slo for g in gaps) / len(gaps) if gaps else 0.0
print("| variant | rate | runs | req/s (median, min-max) | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | p95 gap > "
      f"{slo:g} ms | failed | server steps, each run |")
print("|---|---|---|---|---|---|---|---|---|---|")
table = []
for (setting, rate), rs in sorted(runs.items(), key=lambda kv: (kv[0][1] != "inf", kv[0][1], kv[0][0])):
    med = lambda xs: statistics.median(xs)
    ss = [r["summary"] for r in rs]
    rps = [s["request_throughput"] for s in ss]
    over = [over_slo(r) for r in rs]
    row = {"variant": setting, "rate": rate, "runs": len(ss), "req_s": rps,
           "ttft_p50_ms": med([s["ttft_ms"]["median"] for s in ss]), "ttft_p99_ms": med([s["ttft_ms"]["p99"] for s in ss]),
           "itl_p99_ms": med([s["itl_ms"]["p99"] for s in ss]), "failed": sum(s["failed"] for s in ss),
           "p95_gap_over_slo": over, "server_steps": [r.get("server_steps") for r in rs]}
    table.append(row)
    print(f"| {setting} | {rate} | {len(ss)} | {med(rps):.2f} ({min(rps):.2f}-{max(rps):.2f}) | {row['ttft_p50_ms']:.1f} "
          f"| {row['ttft_p99_ms']:.1f} | {row['itl_p99_ms']:.1f} | {' / '.join(f'{x:.0%}' for x in over)} "
          f"| {row['failed']} | {' // '.join(step_cell(r) for r in rs)} |")
(out / "rapid_ab.json").write_text(json.dumps(table, indent=1))
PY
