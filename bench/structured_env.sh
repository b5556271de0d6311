# shellcheck shell=bash
# Sourced by bench/structured_throughput.sh and bench/worker_profile.sh (from the repository root):
# the Python to use, the carried wheels (.whl: msgspec, posix_ipc, llguidance, py-spy; the GPU machine
# has no package index) installed into /tmp/site when the Python packages are missing, and the Qwen-sized tokenizer folder `tok`.
#   structured_env NAME   -> sets py, tok; exits 2 (naming NAME) when a step fails
#   wait_healthy PORT PID -> returns once the server on PORT answers /health or process PID is gone
structured_env() {
    local name=$1
    py="${PYTHON:-python3}"
    export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if compgen -G ".whl/*.whl" >/dev/null && ! "$py" -c 'import msgspec, posix_ipc, llguidance' 2>/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || { echo "$name: installing the carried wheels failed" >&2; exit 2; }
        export PYTHONPATH="/tmp/site:$PYTHONPATH" PATH="/tmp/site/bin:$PATH"
    fi
    tok="${TOKENIZER:-.sotok}"
    if [[ ! -f "$tok/tokenizer.json" ]]; then
        "$py" bench/grammar_engines.py --save-tokenizer "$tok" \
            || { echo "$name: no tokenizer in $tok and none could be made (see the header)" >&2; exit 2; }
    fi
}

wait_healthy() {
    local port=$1 pid=$2
    for _ in $(seq 1 300); do
        "$py" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && return
        kill -0 "$pid" 2>/dev/null || return
        sleep 1
    done
}
