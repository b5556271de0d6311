#!/usr/bin/env bash
# Scale-out on one machine: REPLICAS rapidserve servers behind vllm-router's cache-aware policy.
#
#   pip install vllm-router            # the router (Rust, from PyPI); rapidserve itself installed as usual
#   deploy/router/run_local.sh         # 3 replicas of the embedded model on ports 8001-8003, the router on 8000
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#     -d '{"prompt": "The capital of France is", "max_tokens": 8}'
#
# Environment (defaults in brackets):
#   REPLICAS [3]     servers to start, on ports BASE_PORT+1 ...
#   BASE_PORT [8000] the router's port
#   POLICY [cache_aware]  the router's --policy (round_robin, power_of_two, consistent_hash, ...)
#   KV_EVENTS [0]    1: each replica publishes its KV events (--kv-events-config) on tcp port 5557+i
#   RAPIDSERVE_ARGS  more `rapidserve serve` flags for every replica (e.g. --model DIR, --device cpu)
#   One GPU per replica: set CUDA_VISIBLE_DEVICES per replica yourself (GPU i for replica i), or use
#   `rapidserve serve --data-parallel-size N` for N engines behind one server instead of a router.
# Every replica gets PYTHONHASHSEED=0, so their KV event block hashes agree with each other and with a router
# that hashes prompts the vLLM way. Ctrl-C stops the router and every replica.
set -euo pipefail

REPLICAS="${REPLICAS:-3}"
BASE_PORT="${BASE_PORT:-8000}"
POLICY="${POLICY:-cache_aware}"
KV_EVENTS="${KV_EVENTS:-0}"
read -r -a EXTRA <<< "${RAPIDSERVE_ARGS:-}"
command -v vllm-router > /dev/null || { echo "vllm-router is not installed: pip install vllm-router" >&2; exit 2; }
command -v rapidserve > /dev/null || { echo "rapidserve is not installed (deploy/install.sh)" >&2; exit 2; }

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2> /dev/null || true; done
    wait
}
trap cleanup EXIT INT TERM

urls=()
for ((i = 1; i <= REPLICAS; i++)); do
    port=$((BASE_PORT + i))
    kv=()
    if [[ "$KV_EVENTS" == 1 ]]; then
        kv=(--kv-events-config "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:$((5556 + i))\"}")
    fi
    PYTHONHASHSEED=0 rapidserve serve --host 127.0.0.1 --port "$port" --served-model-name rapidserve \
        "${kv[@]}" "${EXTRA[@]}" &
    pids+=("$!")
    urls+=("http://127.0.0.1:$port")
done
for url in "${urls[@]}"; do  # the router also waits, but this says which replica is slow
    until curl -sf "$url/health" > /dev/null; do
        sleep 2
    done
    echo "replica $url is ready"
done
# Health checks every 2 s (2 failures take a dead replica out); a request that fails is retried elsewhere.
vllm-router --host 127.0.0.1 --port "$BASE_PORT" --policy "$POLICY" --worker-urls "${urls[@]}" \
    --health-check-interval-secs 2 --health-failure-threshold 2 --prometheus-port $((BASE_PORT + 1000)) &
pids+=("$!")
echo "router on http://127.0.0.1:$BASE_PORT ($POLICY over ${urls[*]}); its metrics on :$((BASE_PORT + 1000))"
wait -n
