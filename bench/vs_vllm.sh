#!/usr/bin/env bash
# rapidserve against the real vLLM 0.26.0 on one GPU (issue 37, items 5 and 6: the goodput frontier; issue 15: the
# sweep). Installs vLLM from the stashed parts, writes the Qwen3-8B-shaped model folder, and runs bench/compare.py:
# by default (MODE=frontier) each system's goodput search (compare.py --goodput-search: the highest Poisson rate at
# which 90% / 99% of requests meet a per-request p95 ITL bound of 25/50/100/200 ms or none, and the TTFT rule), one
# group of systems per device call, the calls' reports merged by --continue-from; MODE=sweep runs the older
# request-rate sweep. The table is printed last.
#
# The whole sequence (the GPU machine reaches no package index and carries at most 64 MiB a call, this repo's
# working tree included; the recipe is ../shared/peer_vllm/README.md, and ../shared does not travel to the GPU
# machine):
#   0. Here, once (~1 min; fetch.py downloads vLLM 0.26.0 and the wheels the GPU machine lacks, ~386 MiB):
#        echo /.peer/ >> .git/info/exclude     # else every call tries to carry .peer
#        python ../shared/peer_vllm/fetch.py .peer      # .peer/bundle.tar (and its own 58 MiB parts)
#        bash bench/vs_vllm.sh --split                  # see below
#      --split re-cuts .peer/bundle.tar into N equal parts .peer/c0/part00 ... (N: the fewest whose part, the working
#      tree and the recipe fit 64 MiB; `--split N` forces N; fetch.py's own 58 MiB parts do not fit beside a working
#      tree of more than 6 MiB), copies the recipe's scripts to .peer/peer_vllm, and prints what each call carries.
#   1. N device calls back to back (the machine keeps its disk only while held, ~30 s idle; if one of them starts a
#      fresh machine, begin again at c0), K = 0 .. N-1:
#        run(command="bash bench/vs_vllm.sh --stash", carry=[".peer/cK", ".peer/peer_vllm"], timeout_s=120)
#   2. At once, one call per group of systems (each fits a 10-minute call: BUDGET_S=540 for the whole script):
#        run(command="GROUP=vllm-a bash bench/vs_vllm.sh", carry=[".whl"], timeout_s=600)
#        run(command="GROUP=ours CONTINUE_FROM=bench/results/frontier_a.json bash bench/vs_vllm.sh", ...)
#        run(command="GROUP=vllm-b CONTINUE_FROM=bench/results/frontier_b.json bash bench/vs_vllm.sh", ...)
#      (.whl: msgspec and posix_ipc for rapidserve, as bench/gpu_suite.sh; .peer is not needed after the install,
#      which the first group's call does and the later calls find done.) CONTINUE_FROM: the previous call's
#      <NAME>.json, copied from its $OUT into the working tree so that it travels (e.g. bench/results/frontier_a.json);
#      the new report holds every earlier group's frontiers, and the better vLLM is the best of every vLLM setting
#      run so far. Groups (MODE=frontier):
#        vllm-a: vLLM's defaults and --max-num-batched-tokens 1024      vllm-b: --max-num-batched-tokens 2048 and
#        --performance-mode interactivity (a vLLM 0.26 flag)          ours: duet (the adaptive policy at its default
#        SLO, 50 ms), always-fused (--mode hybrid), always-split (--policy rapid)
#        ours-slo: duet@25, duet@50, duet@100, duet@200, duet@none: duet started with --slo-itl-ms B (none: no SLO,
#        maximising throughput), each searched at bound B alone (the search stops once B's brackets close); the table
#        then has the composite row "default (SLO = bound)", duet@B's goodput at each bound B (unbounded: duet@none's),
#        and its ratios to the better vLLM and to always-fused / always-split are the composite's (issue 37: a user
#        who needs bound B sets --slo-itl-ms B). Five servers one after the other (~20 s each; the engine reads its
#        SLO once, at start). On two GPUs, beside always-fused and always-split: bench/frontier_parallel.sh with GROUP=ours-slo,baselines.
#      A 30-minute device budget holds the stash calls and about two groups: run vllm-a and ours first (the better
#      vLLM is then the best of two settings: the report names it at each bound), vllm-b if time is left.
#   What comes back in $OUT: <NAME>.md / .json (compare.py's tables and data), <NAME>__<workload>_frontier.png
#   (MODE=frontier: goodput against the ITL bound, a line per system) or <NAME>.png (MODE=sweep), vs_vllm_setup.log
#   (GPU, install, model, the compare.py command), vs_vllm_detail.tar.gz (a second run into the same OUT: its files
#   under the next free stem, <NAME>_2.*, <NAME>_2_detail.tar.gz) (every request of every probe or sweep and
#   each server's log, vLLM's included).
#
# Several GPUs (issue 41: the 70B and Mixtral shapes at TP 4 / 8; issues 37/39/40 at TP 2): TP=N shards every
# system over N GPUs (ours `--tensor-parallel-size N`, vLLM the same flag) and the multi-GPU groups of
# bench/frontier_plan.py (ours-tp: rapidserve and disagg-npmd, prefill on N/2 GPUs and decode on N/2;
# hybrid-chunks: hybrid at chunk 512, 1024, 2048; vllm-default, vllm-1024, vllm-2048: one vLLM setting a call, as a
# big shape's vLLM start takes ~3 min) run one per call, or side by side on the slots of a bigger machine through
# bench/frontier_parallel.sh, whose header has the session's run(...) calls and whose `--plan` prints what fits the
# 30 minutes of device time (here, on the CPU). `--prepare`: vLLM installed and the model folder written, nothing run.
#
# Without vLLM (no stashed parts, no recipe, or the install failed) it runs our systems only and says so.
# Knobs (environment): MODE (frontier | sweep), GROUP (above, or any of bench/frontier_plan.py's, `a+b` for two in
# one call; without it SYSTEMS and VLLM_SYSTEMS say; a group's systems of ours give way to SYSTEMS), TP (1), SERVE_ARGS
# (more flags for every server of ours, e.g. `--device cpu`; vLLM gets those it shares), SYSTEMS (ours;
# default: frontier rapidserve,always-fused,always-split; sweep rapid-adaptive,hybrid-2048), VLLM_SYSTEMS (default:
# frontier vllm-best, all four settings, which one call cannot hold: give GROUP; sweep vllm; e.g.
# "vllm:,vllm:--no-enable-prefix-caching"; set and empty: vLLM is installed for its FA3 build but not served),
# CONTINUE_FROM (an earlier call's report), MAX_MODEL_LEN (8192), GPU_MEM (0.8, every server's
# --gpu-memory-utilization), WORKLOADS (compare.py's --workloads; default: frontier 4096:64, sweep multiturn),
# BENCH_ARGS (sweep multiturn: --input-len 2048 --turn-input-len 256 --output-len 64 --num-turns 6), TRACE_WORKLOADS
# (instead: trace replays, see below; a frontier needs --trace-arrivals poisson in them), SEARCH_ARGS (frontier:
# compare.py's --search-* flags, default "--search-max-probes 10"; to settle `>= own peak` cells, e.g.
# "--search-max-probes 10 --search-shared-ceiling --search-above-peak-factor 4": every system's search may go up to
# the highest closed-loop peak of the call's systems so far, run first, its probes above its own peak 4x longer and
# judged by their TTFT backlog, rapidserve/benchmark/sustain.py; or "--search-max-rate R" for one ceiling; every
# probe also warms up for 1.25 request lifetimes, at most --search-max-probe-arrivals, sustain.py's ramp rule; add
# "--search-repeats 3" to run every search 3 times and report the medians with their spread),
# RATES (sweep: inf; with TRACE_WORKLOADS none, see load_args), NUM_PROMPTS (frontier: 64
# arrivals per probe; sweep: 32 conversations), WARMUP (4), BUDGET_S (540: the whole script, setup included, ends
# inside the 600 s of a device call), NAME (frontier | vs_vllm: the file stem of the tables), PRESET (qwen3-8b: the
# model shape, ours `preset:PRESET`, vLLM's folder from make_model.py; another preset's folder comes from
# bench/make_peer_model.py), VLLM_FP8 (checkpoint: vLLM's folder declares an FP8_DYNAMIC checkpoint, written by
# make_peer_model.py --fp8, so vLLM allocates fp8 weights as for a real FP8 checkpoint instead of quantizing bf16 ones
# at load (the 70B shape in fp8 on one GPU); give ours the same scheme with SERVE_ARGS="--quantization fp8", which
# vLLM then does not get: compare_systems.vllm_command), FA3_FROM_VLLM (1: rapidserve's servers find vLLM's FlashAttention-3 build, so attention
# backend auto is FA3; 0: they keep Triton), VLLM_CACHE (below).
# Further arguments go to compare.py after the script's own (they win), e.g. `--search-tolerance 0.1`.
#
# VLLM_CACHE=DIR (a repo-relative, git-ignored folder the session carries, e.g. .vllmcache): vLLM's torch.compile
# cache carried between sessions (each start spends ~29 s of its ~60-80 s compiling what the last session compiled).
# Before the first vLLM start VLLM_CACHE_ROOT is set to /tmp/vllm_cache_root (fixed: the cache names absolute paths),
# seeded from DIR's vllm_cache.tar.xz (or vllm_cache.part00, .part01, ...) when there is one; after the runs what
# vLLM's compile cache holds (torch_compile_cache/, its torch_aot_compile/ and inductor_cache/, modelinfos/; not the
# startup plan, the P2P probe or autotuner caches) goes to $OUT/vllm_cache.tar.xz, or parts of <= 15 MiB, or into
# the detail archive when $OUT's 8 files are taken (bench/vllm_cache.py, bench/peer_env.sh). Its line ("vllm cache:
# N of M entries packed (R of the seed's S read, C compiled in this run): F files, X MiB -> Y MiB") says what it did;
# "nothing new" when the seed already held it all (no archive). Entries are keyed by vLLM's config hash, its code
# and env factors and torch's and Triton's builds, so an archive from another vLLM or setting only misses. vLLM's
# configuration is untouched. Without VLLM_CACHE nothing of this runs.
#   First session:  run(command="VLLM_CACHE=.vllmcache GROUP=vllm-a bash bench/vs_vllm.sh", carry=[".whl"]), then
#                   here: python bench/vllm_cache.py take /work/.device/N .vllmcache (N: the call's files folder; it
#                   finds the archive at the top or inside a .tar.gz and replaces .vllmcache's old archive files).
#   Next sessions:  the same with carry=[".whl", ".vllmcache"]; take each call's new archive again (it holds the
#                   seed's entries and the call's). A hit: vLLM's log (in the detail archive) says "Directly load
#                   AOT compilation from path ..." and "Directly load the compiled graph(s) for compile range ...".
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
# install.sh's and serve_vllm.sh's fixed places (override only to try the script elsewhere)
stash="${PEER_STASH:-/root/peerstash}"
site="${PEER_SITE:-/root/peersite}"
model="${PEER_MODEL:-/root/peermodel}"

find_recipe() {  # the folder holding install.sh, make_model.py and serve_vllm.sh, or nothing
    local d
    for d in "${PEER_VLLM_DIR:-}" shared/peer_vllm ../shared/peer_vllm .peer/peer_vllm "$stash/peer_vllm"; do
        if [ -n "$d" ] && [ -f "$d/serve_vllm.sh" ] && [ -f "$d/install.sh" ] && [ -f "$d/make_model.py" ]; then
            echo "$d"
            return
        fi
    done
}

if [ "${1:-}" = "--split" ]; then  # here, not on the GPU machine
    bundle=.peer/bundle.tar
    [ -f "$bundle" ] || { echo "vs_vllm: no $bundle: run python ../shared/peer_vllm/fetch.py .peer first" >&2; exit 2; }
    git check-ignore -q .peer || { echo "vs_vllm: git does not ignore .peer: echo /.peer/ >> .git/info/exclude" >&2; exit 2; }
    recipe="$(find_recipe)"
    [ -n "$recipe" ] || { echo "vs_vllm: no peer_vllm recipe found (set PEER_VLLM_DIR)" >&2; exit 2; }
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
    extra=$(du -sb "$recipe" | cut -f1)
    room=$(((62 << 20) - tree - extra))  # 2 MiB to spare under the 64 MiB a call carries
    [ "$room" -gt $((8 << 20)) ] || { echo "vs_vllm: the working tree ($((tree >> 20)) MiB) leaves no room for a part" >&2; exit 2; }
    size=$(stat -c %s "$bundle")
    n="${2:-$(((size + room - 1) / room))}"  # the fewest parts that fit
    rm -rf .peer/c[0-9]* .peer/split.tmp && mkdir .peer/split.tmp || exit 1
    split -n "$n" -d -a 2 "$bundle" .peer/split.tmp/part || exit 1
    i=0
    for f in .peer/split.tmp/part*; do
        mkdir -p ".peer/c$i" && mv "$f" ".peer/c$i/" || exit 1
        i=$((i + 1))
    done
    rmdir .peer/split.tmp
    if [ "$(cd "$recipe" && pwd -P)" != "$(cd .peer && pwd -P)/peer_vllm" ]; then
        rm -rf .peer/peer_vllm && cp -r "$recipe" .peer/peer_vllm || exit 1
    fi
    echo "$n parts: run the $n --stash calls c0 .. c$((n - 1)) back to back"
    for d in .peer/c[0-9]*; do
        part=$(du -sb "$d" | cut -f1)
        total=$((part + tree + extra))
        echo "$d: $((part >> 20)) MiB + working tree $((tree >> 20)) MiB + recipe = $((total >> 20)) MiB" \
            "$([ "$total" -lt $((64 << 20)) ] && echo "(fits 64 MiB)" || echo "(OVER 64 MiB: use more parts: --split $((n + 1)))")"
    done
    exit 0
fi

if [ "${1:-}" = "--stash" ]; then
    mkdir -p "$stash" || exit 1
    compgen -G ".peer/c*/part*" >/dev/null && cp .peer/c*/part* "$stash"/
    [ -d .peer/peer_vllm ] && rm -rf "$stash/peer_vllm" && cp -r .peer/peer_vllm "$stash/peer_vllm"
    echo "stashed in $stash:" "$stash"/*
    exit 0
fi

t_start=$(date +%s)
budget="${BUDGET_S:-540}"
vcache="${VLLM_CACHE:-}"  # read once; not passed on (vLLM warns of VLLM_* variables it does not know)
unset VLLM_CACHE
mode="${MODE:-frontier}"
case "$mode" in frontier) default_name=frontier ;; sweep) default_name=vs_vllm ;;
    *) echo "vs_vllm: MODE=$mode: give frontier or sweep" >&2; exit 2 ;; esac
name="${NAME:-$default_name}"  # compare.py's --name: the tables' file stem
out="${OUT:-bench/results/vs_vllm}"
mkdir -p "$out"
# a second run into the same OUT (two seeds in one device call) keeps the first's files: the next free stem
if compgen -G "$out/$name.*" >/dev/null; then
    n=2
    while compgen -G "$out/${name}_$n.*" >/dev/null; do n=$((n + 1)); done
    echo "vs_vllm: $out/$name.* are an earlier run's: this run's tables are ${name}_$n.*" >&2
    name="${name}_$n"
fi
detail="$out/vs_vllm_detail.tar.gz" setup_log="$out/vs_vllm_setup.log"
[ -e "$detail" ] && detail="$out/${name}_detail.tar.gz" setup_log="$out/${name}_setup.log"
work="$(mktemp -d)"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# Multi-GPU machines: NVLink multicast stays off for every program (the device library's KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
elapsed() { echo $(($(date +%s) - t_start)); }
say() { echo "vs_vllm [$(elapsed) s]: $*" | tee -a "$setup_log"; }
: >"$setup_log"

# shellcheck source=bench/wheels.sh
. bench/wheels.sh
carried_wheels vs_vllm || { say "installing the carried wheels (.whl) failed"; exit 2; }
gpu="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
say "GPU: ${gpu:-none found}; $("$py" -c 'import sys, importlib.metadata as m; print("python", sys.version.split()[0] + ", torch", m.version("torch"))' 2>&1 | tail -1)"

preset="${PRESET:-qwen3-8b}"
# The systems of this call: a GROUP (MODE=frontier; bench/frontier_plan.py's table, `a+b` for two), else SYSTEMS
# (ours; set and empty: only --system extras) and VLLM_SYSTEMS (vLLM's). A group's own systems of ours give way
# to SYSTEMS when it is set and not empty.
if [ "$mode" = frontier ]; then
    ours="${SYSTEMS-rapidserve,always-fused,always-split}"
    vllm_wanted="${VLLM_SYSTEMS-vllm-best}"
else
    ours="${SYSTEMS-rapid-adaptive,hybrid-2048}"
    vllm_wanted="${VLLM_SYSTEMS-vllm}"
fi
tp="${TP:-1}"
gpu_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | awk '{printf "%.0f", $1 / 1024}')
if [ -n "${GROUP:-}" ]; then
    if ! group_out=$("$py" bench/frontier_plan.py group "$GROUP" --tp "$tp" --preset "$preset" \
            --gpu-gib "${gpu_gib:-140}" --gpu-mem "${GPU_MEM:-0.8}" 2>"$work/group.err"); then
        say "$(cat "$work/group.err")"
        exit 2
    fi
    { read -r g_ours; read -r g_vllm; read -r g_note; } <<<"$group_out"
    [ -n "$g_note" ] && say "$g_note"
    [ -n "$g_ours" ] && [ -n "${SYSTEMS:-}" ] && g_ours="$SYSTEMS"
    ours="$g_ours"; vllm_wanted="$g_vllm"
fi
# The recipe (install.sh, make_model.py, serve_vllm.sh): stashed by --stash, or wherever it is found.
recipe="$(find_recipe)"

# shellcheck source=bench/peer_env.sh
. bench/peer_env.sh
why_not=""
peer_install  # sets why_not when vLLM cannot be installed
[ -z "$why_not" ] && [ "${FA3_FROM_VLLM:-1}" = 1 ] && expose_fa3  # our engine's attention backend 'auto' finds FA3
fp8_folder=()
case "${VLLM_FP8:-}" in
    "") ;;
    checkpoint)
        case " ${SERVE_ARGS:-} " in
            *" --quantization fp8 "*|*" --quantization=fp8 "*) fp8_folder=(--fp8) ;;
            *) echo "vs_vllm: VLLM_FP8=checkpoint serves vLLM fp8 weights; give ours the same scheme with" \
                    "SERVE_ARGS=\"--quantization fp8\" (without it the comparison would be bf16 against fp8)" >&2
               exit 2 ;;
        esac ;;
    *) echo "vs_vllm: VLLM_FP8=${VLLM_FP8}: give checkpoint (vLLM's folder declares FP8_DYNAMIC) or leave it unset" >&2
       exit 2 ;;
esac
if [ -z "$why_not" ] && { [ "$preset" != qwen3-8b ] || [ -n "${fp8_folder[*]}" ]; }; then  # our own folder maker
    model="$model-$preset${fp8_folder[*]:+-fp8}"
    if [ ! -f "$model/config.json" ]; then
        say "writing the $preset-shaped model folder $model${fp8_folder[*]:+ (FP8_DYNAMIC checkpoint)}"
        "$py" bench/make_peer_model.py "$preset" "$model" "${fp8_folder[@]}" 2>&1 | tee -a "$setup_log" \
            || why_not="make_peer_model.py failed"
    fi
fi
if [ -z "$why_not" ] && [ ! -f "$model/config.json" ]; then
    if [ -z "$recipe" ]; then
        why_not="no model folder $model and no make_model.py to write it"
    else
        say "writing the Qwen3-8B-shaped model folder $model"
        "$py" "$recipe/make_model.py" "$model" 2>&1 | tee -a "$setup_log" || why_not="make_model.py failed"
    fi
fi
if [ "${1:-}" = --prepare ]; then  # bench/frontier_parallel.sh: vLLM and the model folder once, before its groups
    say "prepared: ${why_not:-vLLM in $site, model folder $model}"
    exit 0
fi

# The workloads: fixed 4096:64 for the frontier, issue 15's multiturn for the sweep; TRACE_WORKLOADS (';'-separated
# `rapidserve bench` flag sets, e.g. "--workload trace --trace .traces/azure_conv_2023.csv.gz --duration-s 60
# --time-scale 3" for a sweep, "--workload trace --trace ... --trace-arrivals poisson --num-prompts 64" for the
# frontier) replaces it (carry the trace files: ../shared does not travel).
if [ -n "${TRACE_WORKLOADS:-}" ]; then
    workload_args=()
    IFS=';' read -ra sets <<<"$TRACE_WORKLOADS"
    for w in "${sets[@]}"; do
        workload_args+=(--workload-args "$w")
    done
    [ -n "${BENCH_ARGS:-}" ] && workload_args+=(--bench-args "$BENCH_ARGS")
else
    if [ "$mode" = frontier ]; then wl="${WORKLOADS:-4096:64}"; else wl="${WORKLOADS:-multiturn}"; fi
    default_args=""
    [ "$wl" = multiturn ] && default_args="--input-len 2048 --turn-input-len 256 --output-len 64 --num-turns 6"
    workload_args=(--workloads "$wl")
    bench_args="${BENCH_ARGS:-$default_args}"
    [ -n "$bench_args" ] && workload_args+=(--bench-args "$bench_args")
fi
vllm_args=()
if [ -z "$why_not" ]; then
    systems="$vllm_wanted"  # vLLM first: its start is the longest and least certain
    systems="${systems:+$systems${ours:+,}}$ours"
    if [ -n "$recipe" ]; then
        vllm_args=(--vllm-model "$model" --vllm-serve "$recipe/serve_vllm.sh")
    else  # installed on an earlier call of this machine; no recipe now: vLLM's server module directly
        vllm_args=(--vllm-model "$model" --vllm-serve none --vllm-site "$site")
    fi
else
    systems="$ours"
    say "vLLM SKIPPED: $why_not. Running rapidserve's systems only ($ours)."
fi
if [ -n "$vcache" ]; then  # VLLM_CACHE: VLLM_CACHE_ROOT for every vLLM compare.py starts (bench/peer_env.sh)
    if [ -z "$why_not" ] && [ -n "$vllm_wanted" ]; then
        vllm_cache_seed "$vcache"
    else
        say "vllm cache: VLLM_CACHE=$vcache unused: no vLLM runs in this call"
    fi
fi

left=$((budget - $(elapsed)))
if [ "$left" -lt 120 ]; then
    say "only $left s left of BUDGET_S=$budget after the setup: not starting the comparison"
    exit 1
fi
# No new system or rate (or probe) starts after left-100 s (one of ours needs ~1 min to start, run and stop; each
# search gets its share of that budget); at left s compare.py gets SIGTERM (it stops the running server and
# writes what finished), at left+30 s SIGKILL.
if [ "$mode" = frontier ]; then
    read -ra search_args <<<"${SEARCH_ARGS:---search-max-probes 10}"
    load_args=(--goodput-search "${search_args[@]}" --num-prompts "${NUM_PROMPTS:-64}")
else
    load_args=(--num-prompts "${NUM_PROMPTS:-32}")
    # RATES, else inf (a closed loop); with TRACE_WORKLOADS and no RATES none: a trace at its own timestamps reads
    # no rate (compare.py refuses --rates there), one at --trace-arrivals poisson needs RATES
    if [ -n "${RATES:-}" ]; then
        load_args+=(--rates "$RATES")
    elif [ -z "${TRACE_WORKLOADS:-}" ]; then
        load_args+=(--rates inf)
    fi
fi
continue_args=()
if [ -n "${CONTINUE_FROM:-}" ]; then
    [ -f "$CONTINUE_FROM" ] || { say "CONTINUE_FROM=$CONTINUE_FROM: no such file (copy the earlier call's report into the tree)"; exit 2; }
    continue_args=(--continue-from "$CONTINUE_FROM")
fi
serve_args="--max-model-len ${MAX_MODEL_LEN:-8192} --gpu-memory-utilization ${GPU_MEM:-0.8}"
[ "$tp" != 1 ] && serve_args+=" --tensor-parallel-size $tp"  # ours and vLLM (a flag both take)
[ -n "${SERVE_ARGS:-}" ] && serve_args+=" $SERVE_ARGS"
cmd=("$py" bench/compare.py --model "preset:$preset" --systems "$systems" "${vllm_args[@]}" --serve-args "$serve_args"
     "${workload_args[@]}" "${load_args[@]}" "${continue_args[@]}" --warmup "${WARMUP:-4}"
     --startup-timeout-s 300 --budget-s $((left - 100)) --out "$work" --name "$name" "$@")
# the command as logged: without its secrets (--api-key K in SERVE_ARGS or the flags given; rapidserve/redaction.py)
say "$("$py" -m rapidserve.redaction "${cmd[@]}" 2>/dev/null || echo "compare.py (the command is not shown: redacting it failed)")"
timeout -k 30 "$left" "${cmd[@]}" 2>&1 | tee "$work/compare_stdout.log"
status=${PIPESTATUS[0]}
say "compare.py exited with $status after $(elapsed) s in all"

for f in "$work/$name".md "$work/$name".json "$work/$name".png "$work/$name"__*_frontier.png; do
    [ -f "$f" ] && cp "$f" "$out/"
done
tar -czf "$detail" -C "$work" . 2>/dev/null
rm -rf "$work"
# with VLLM_CACHE; the fallback: the detail archive; the deadline: the device call's (CALL_S, 600 s less a margin)
vllm_cache_pack "$out" "$detail" $((t_start + ${CALL_S:-585}))
[ -n "$why_not" ] && echo "NOTE: vLLM was not run: $why_not"
if [ -f "$out/$name.md" ]; then
    echo "===== $out/$name.md"
    cat "$out/$name.md"
else
    echo "no table: compare.py wrote none (see $setup_log and the detail archive)"
fi
exit "$status"
