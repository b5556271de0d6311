#!/usr/bin/env bash
# A soak of `rapidserve serve` on a lent GPU machine, longer than one device call (10 minutes):
#
#   bench/gpu_soak.sh start [--duration-s 600] [--model preset:qwen3-8b] [-- extra soak.py args]
#   bench/gpu_soak.sh wait  [--max-wait-s 540]
#
# `start` launches bench/soak.py (which launches the server) in its own process session, so it
# outlives the call (the machine keeps such processes until it is given back, ~30 s after a call);
# it returns at once. `wait` (in the next call, within 30 s) waits until the soak has finished or
# --max-wait-s passes, copies soak.json / soak.md / soak.png / server.log / soak.log into $OUT (or
# bench/results/soak_gpu/), and prints the soak's verdict last. Exit status of `wait`: the soak's
# (0 PASS, 1 FAIL), 3 while it is still running (call `wait` again).
# Carried wheels in .whl/ (msgspec, posix_ipc) are installed as bench/gpu_suite.sh does.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
work=/tmp/rapidserve-gpu-soak
py="${PYTHON:-python3}"
cmd="${1:-}"
shift || true

# shellcheck source=bench/wheels.sh
. bench/wheels.sh
carried_wheels gpu_soak.sh || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

case "$cmd" in
start)
    duration=600
    model=preset:qwen3-8b
    extra=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --duration-s) duration="$2"; shift 2 ;;
            --model) model="$2"; shift 2 ;;
            --) shift; extra=("$@"); break ;;
            *) echo "gpu_soak.sh start: unknown argument $1" >&2; exit 2 ;;
        esac
    done
    rm -rf "$work" && mkdir -p "$work/out"
    setsid nohup "$py" bench/soak.py --launch "$py -m rapidserve.cli serve --model $model --port 0" --text off \
        --capacity-probe --probe-concurrency 32 --probe-s 30 --duration-s "$duration" --check-shm-after-exit \
        --out-dir "$work/out" "${extra[@]}" >"$work/soak.log" 2>&1 </dev/null &
    echo $! >"$work/pid"
    echo "gpu_soak: started (pid $(cat "$work/pid")), $model for ${duration} s; logs in $work"
    ;;
wait)
    max_wait=540
    [ "${1:-}" = "--max-wait-s" ] && max_wait="$2"
    pid="$(cat "$work/pid" 2>/dev/null)" || { echo "gpu_soak.sh wait: no soak was started here" >&2; exit 2; }
    t0=$(date +%s)
    while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$max_wait" ]; do
        sleep 5
    done
    dest="${OUT:-bench/results/soak_gpu}"
    mkdir -p "$dest"
    cp "$work"/out/* "$work/soak.log" "$dest"/ 2>/dev/null
    if kill -0 "$pid" 2>/dev/null; then
        tail -5 "$work/soak.log"
        echo "gpu_soak: still running after ${max_wait} s; call wait again"
        exit 3
    fi
    tail -40 "$work/soak.log"
    grep -q "PASS" <(tail -1 "$work/soak.log") && exit 0 || exit 1
    ;;
*)
    sed -n '2,13p' "$0"
    exit 2
    ;;
esac
