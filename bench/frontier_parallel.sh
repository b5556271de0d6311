#!/usr/bin/env bash
# The goodput frontier of bench/vs_vllm.sh's system groups side by side in ONE device call: each group on GPUs of
# its own (TP of them: ours `--tensor-parallel-size TP`, vLLM the same flag), the groups at the same time on one
# host (same GPU model, same client code, each client its own process); then one table of every group, with the
# engine default's ratios to the better vLLM and to our baselines (bench/compare_merge.py).
#
# Groups (bench/frontier_plan.py): ours, vllm-a, vllm-b (one GPU each, issue 37), ours-slo (duet@25, duet@50,
# duet@100, duet@200, duet@none: duet started with --slo-itl-ms B, or none, each searched at bound B alone: the
# table's composite row "default (SLO = bound)", its cell at B duet@B's, whose ratios the table gives; five servers,
# one after the other: the engine has no runtime SLO knob), ours-tp (rapidserve and disagg-npmd: prefill on TP/2
# GPUs, decode on TP/2), hybrid-chunks (hybrid at chunk 512, 1024, 2048),
# vllm-default, vllm-1024, vllm-2048 (vLLM at one setting each: a big shape's vLLM start takes ~3 min); `a+b` runs
# two groups' systems one after the other in one slot. A machine of G GPUs holds G/TP slots; a call runs at most
# that many groups (each inside BUDGET_S, 540 s), the rest go to the next call.
#
# The plan first, here on the CPU (no device time): which calls, how long each, what fits a session's 30 minutes:
#   KIND_GPUS=4 TP=4 PRESET=llama-3.1-70b GROUP=ours-tp,hybrid-chunks,vllm-default bash bench/frontier_parallel.sh --plan
# The session (after `bash bench/vs_vllm.sh --split` here: its header's step 0), issue 41 on nvidia-h200-x4,
# Llama-3.1-70B shape at TP 4 (one slot: one group a call), each call's frontier_<group>.json copied from $OUT
# into bench/results/h200x4_MMDD/ here before the next call, which folds it into its table with MERGE_WITH:
#   run(command="bash bench/vs_vllm.sh --stash", carry=[".peer/cK", ".peer/peer_vllm"], kind="nvidia-h200-x4",
#       timeout_s=120)                                          # K = 0 .. N-1, back to back
#   run(command="TP=4 PRESET=llama-3.1-70b GROUP=ours-tp NUM_PROMPTS=48 bash bench/frontier_parallel.sh",
#       carry=[".whl"], kind="nvidia-h200-x4", timeout_s=600)
#   run(command="TP=4 PRESET=llama-3.1-70b GROUP=hybrid-chunks NUM_PROMPTS=48
#       MERGE_WITH=bench/results/h200x4_MMDD/frontier_ours-tp.json bash bench/frontier_parallel.sh", carry=[".whl"],
#       kind="nvidia-h200-x4", timeout_s=600)
#   later (the plan says what fits): GROUP=vllm-default, vllm-1024; PRESET=mixtral-8x7b GROUP=ours-tp+hybrid-chunks
# Issue 37's default at every bound against our two fixed policies, on nvidia-h200-x2 (two slots at TP 1; the plan:
# KIND_GPUS=2 GROUP=ours-slo,baselines bash bench/frontier_parallel.sh --plan), after the stash calls above (on x2):
#   run(command="GROUP=ours-slo,baselines NUM_PROMPTS=48 NAME=frontier_slo bash bench/frontier_parallel.sh",
#       carry=[".whl"], kind="nvidia-h200-x2", timeout_s=600)
# (its table's "default (SLO = bound) / always-fused" and "/ always-split" rows are issue 37's 3% test). The
# better vLLM from a later call: GROUP=vllm-a,vllm-b MERGE_WITH="bench/results/h200x2_MMDD/frontier_ours-slo.json
# bench/results/h200x2_MMDD/frontier_ours.json" (this call's reports, copied into the tree first).
# On nvidia-h200-x8 at TP 4 two groups share a call (GROUP=ours-tp,hybrid-chunks then vllm-default,vllm-1024);
# at TP 8 one. Issue 37/39/40 at TP 2: nvidia-h200-x2 one group a call, nvidia-h200-x4 two (GROUP=ours-tp,
# hybrid-chunks then vllm-default,vllm-1024); the 70B shape's disagg-npmd (1P1D: 131 GiB of weights on one GPU) is
# dropped with its reason, Mixtral's (87 GiB) runs.
#
# vLLM is installed and the model folder written once (`vs_vllm.sh --prepare`), before the groups start. Back in
# $OUT (at most 8 files): frontier_<group>.json per group (`a+b`: frontier_a_b.json), the table <NAME>.md /
# .json (+ its frontier plot), and logs.tar.gz (the setup log, each group's log, setup log and detail archive);
# with VLLM_CACHE also vllm_cache.tar.xz (or its parts) when that stays within 8 files (G groups + table, plot and
# logs: G + 4, so up to 3 groups with one archive file), else inside logs.tar.gz as vllm_cache/... when
# logs.tar.gz stays under 16 MiB, else not returned (its line says why).
# VLLM_CACHE=DIR (as bench/vs_vllm.sh's header says: vLLM's torch.compile cache carried between sessions): seeded
# ONCE here into VLLM_CACHE_ROOT=/tmp/vllm_cache_root before the groups start, shared by every group's vLLM starts
# (side by side, as vLLM's default ~/.cache/vllm would be), and packed once after them (bench/peer_env.sh):
#   first session:  run(command="VLLM_CACHE=.vllmcache BUDGET_S=500 GROUP=vllm-a,vllm-b bash bench/frontier_parallel.sh",
#                   carry=[".whl"], kind="nvidia-h200-x2"), then here: python bench/vllm_cache.py take
#                   /work/.device/N .vllmcache (from the top of the call's files or inside its logs.tar.gz);
#   next sessions:  carry=[".whl", ".vllmcache"]; take each call's new archive before the next call (it holds the
#                   seed's entries and the call's; a call on a fresh machine packs only what it carried and compiled).
# Knobs: vs_vllm.sh's (PRESET,
# WORKLOADS, NUM_PROMPTS, SEARCH_ARGS, MAX_MODEL_LEN, GPU_MEM, SERVE_ARGS, SYSTEMS), TP (1), GROUP (comma- or
# space-separated; default ours,vllm-a,vllm-b, as many as fit), BUDGET_S (each group's, 540), NAME (the table's stem, frontier_tp),
# MERGE_WITH (earlier calls' frontier_<group>.json in the tree, folded into the table), REFERENCE (the system the
# table's own ratios divide by; default: the composite row where duet@B ran, else rapidserve), KIND_GPUS (--plan: the
# machine's GPUs), NGPU (the GPUs to use, default all nvidia-smi lists), PIN_CPUS / TOPO_FILE (each group on its GPUs'
# NUMA cores: bench/cpu_slots.py). SEARCH_ARGS="... --search-repeats N" runs
# every search N times (the table's cells: medians with their spread); the plan counts every repetition.
# SEARCH_ARGS="--search-start-from R.json --search-peak-from-prior": R's brackets and peaks, no closed loop (compare.py).
# A trace (TRACE_WORKLOADS): give it a window larger than a probe (--num-prompts 256 there) and a probe's arrivals in
# SEARCH_ARGS (--search-trace-probe 64): warm-ups and probes above the peak draw further requests from the window,
# and one the window cuts above the peak fails (2026-11-30: a 64-request window let vLLM pass 1.7x its peak). Further
# arguments go to each group's vs_vllm.sh and on to compare.py (`--dry-run` prints each group's server commands).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
py="${PYTHON:-python3}"
vcache="${VLLM_CACHE:-}"  # seeded and packed here, once; the groups' vs_vllm.sh get VLLM_CACHE_ROOT, not VLLM_CACHE
unset VLLM_CACHE
tp="${TP:-1}"
case "${PIN_CPUS:-auto}" in
    auto|1|0) ;;
    *) echo "frontier_parallel: PIN_CPUS=${PIN_CPUS}: give auto (pin where the GPUs' topology is known), 1 or 0" >&2
       exit 2 ;;
esac
read -ra groups <<<"$(echo "${GROUP:-ours,vllm-a,vllm-b}" | tr ',' ' ')"
# the probes a search may make, as vs_vllm.sh passes them (SEARCH_ARGS, default 10; without the flag: bench's 12), and
# how much longer its probes above the closed-loop peak are (--search-above-peak-factor, default 1; it goes with a
# ceiling above the peak in SEARCH_ARGS: --search-shared-ceiling, the highest peak among each group's systems so far,
# a group being one compare.py run, or --search-max-rate R, one rate for every group)
probes=$(echo "${SEARCH_ARGS:---search-max-probes 10}" | sed -n 's/.*--search-max-probes[ =]*\([0-9][0-9]*\).*/\1/p')
factor=$(echo "${SEARCH_ARGS:-}" | sed -n 's/.*--search-above-peak-factor[ =]*\([0-9.][0-9.]*\).*/\1/p')
# each search's repetitions (--search-repeats N in SEARCH_ARGS: compare.py runs every search N times and reports the
# medians; the plan shares BUDGET_S over every repetition and says where it cannot fit them)
repeats=$(echo "${SEARCH_ARGS:-}" | sed -n 's/.*--search-repeats[ =]*\(-*[0-9][0-9]*\).*/\1/p')
# --search-ttft-rate R: one more probe after each search (the TTFT table's), counted in the plan's probes
case " ${SEARCH_ARGS:-} " in *" --search-ttft-rate"*) probes=$(( ${probes:-12} + 1 ));; esac
# the plan's prompt and output lengths: the first workload's, where WORKLOADS gives one as IN:OUT (else 4096:64; the
# output length guesses a request's lifetime, which sets each probe's warm-up: the ramp rule); a probe's arrivals and
# their cap (--search-max-probe-arrivals in SEARCH_ARGS; a trace: its window, below). The vLLM stash's part count is
# the plan's own (bench/frontier_plan.py stash_parts: this checkout's .peer/c*, which bench/vs_vllm.sh --split made)
prompt=$(echo "${WORKLOADS:-4096:64}" | sed -n 's/^\([0-9][0-9]*\):[0-9].*/\1/p')
output=$(echo "${WORKLOADS:-4096:64}" | sed -n 's/^[0-9][0-9]*:\([0-9][0-9]*\).*/\1/p')
if [ "${WORKLOADS:-}" = multiturn ]; then  # an arrival is a conversation (vs_vllm.sh's multiturn defaults): 2048 + 5 x
    prompt=3328; output=384                 # 256 new prompt tokens, 6 x 64 output tokens (its lifetime: all turns)
fi
if [ -n "${TRACE_WORKLOADS:-}" ]; then  # the first trace's first requests' mean lengths (bench/trace_lengths.py: it
    # needs the package's dependencies: this checkout's .venv where PYTHON is not given)
    read -ra first_set <<<"${TRACE_WORKLOADS%%;*}"
    tl_py="$py"; [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && tl_py=.venv/bin/python
    tl_err="$(mktemp)"
    if lengths=$("$tl_py" bench/trace_lengths.py --max-model-len "${MAX_MODEL_LEN:-8192}" -- "${first_set[@]}" \
        2>"$tl_err"); then read -r prompt output <<<"$lengths"
    else echo "frontier_parallel: the trace's lengths not read ($(tail -1 "$tl_err")): the plan assumes 4096:64" >&2; fi
    rm -f "$tl_err"
fi
cap=$(echo "${SEARCH_ARGS:-}" | sed -n 's/.*--search-max-probe-arrivals[ =]*\([0-9][0-9]*\).*/\1/p')
plan_n="${NUM_PROMPTS:-48}"
if [ -n "${TRACE_WORKLOADS:-}" ]; then  # a trace's probe: --search-trace-probe N in SEARCH_ARGS, else its whole window
    # (the first trace's --num-prompts); the window is the probes' cap (warm-ups and probes above the peak draw on it)
    window=$(echo "${TRACE_WORKLOADS%%;*}" | sed -n 's/.*--num-prompts[ =]*\([0-9][0-9]*\).*/\1/p')
    trace_probe=$(echo "${SEARCH_ARGS:-}" | sed -n 's/.*--search-trace-probe[ =]*\([0-9][0-9]*\).*/\1/p')
    plan_n="${trace_probe:-${window:-$plan_n}}"
    [ -n "$window" ] && cap="$window"
fi
plan_extra=(--prompt "${prompt:-4096}" --output "${output:-64}" --repeats "${repeats:-1}")
[ -n "$cap" ] && plan_extra+=(--max-probe-arrivals "$cap")
case " ${SEARCH_ARGS:-} " in *" --search-peak-from-prior "*) plan_extra+=(--peak-from-prior) ;; esac
if [ "${1:-}" = --plan ]; then
    exec "$py" bench/frontier_plan.py plan --gpus "${KIND_GPUS:-${NGPU:-4}}" --tp "$tp" --preset "${PRESET:-qwen3-8b}" \
        --groups "$(IFS=,; echo "${groups[*]}")" --num-prompts "$plan_n" --budget-s "${BUDGET_S:-540}" \
        --max-probes "${probes:-12}" --above-peak-factor "${factor:-1}" "${plan_extra[@]}"
fi
out="${OUT:-bench/results/frontier_parallel}"
mkdir -p "$out"
work="$(mktemp -d)"
setup_log="$work/setup.log"
t0=$(date +%s)
say() { echo "frontier_parallel [$(( $(date +%s) - t0 )) s]: $*" | tee -a "$setup_log"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

ngpu="${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
slots=$((ngpu / tp))
if [ "$slots" -lt 1 ]; then
    say "TP=$tp needs $tp GPUs; $ngpu found"
    exit 2
fi
if [ -z "${GROUP:-}" ] && [ "${#groups[@]}" -gt "$slots" ]; then
    groups=("${groups[@]:0:$slots}")  # the default: as many of ours, vllm-a, vllm-b as there are GPUs
fi
if [ "${#groups[@]}" -gt "$slots" ]; then
    say "${#groups[@]} groups (${groups[*]}) but $slots slot(s) of $tp GPU(s) on $ngpu GPUs: give at most $slots" \
        "in GROUP, the rest in the next call (bash bench/frontier_parallel.sh --plan says which)"
    exit 2
fi
"$py" bench/frontier_plan.py plan --gpus "$ngpu" --tp "$tp" --preset "${PRESET:-qwen3-8b}" --stashed \
    --groups "$(IFS=,; echo "${groups[*]}")" --num-prompts "$plan_n" --budget-s "${BUDGET_S:-540}" \
    --max-probes "${probes:-12}" --above-peak-factor "${factor:-1}" "${plan_extra[@]}" \
    2>&1 | tee -a "$setup_log"
GROUP="" OUT="$work/prepare" bash bench/vs_vllm.sh --prepare >>"$setup_log" 2>&1 || say "vs_vllm.sh --prepare failed"
# shellcheck source=bench/peer_env.sh
. bench/peer_env.sh
[ -n "$vcache" ] && vllm_cache_seed "$vcache"  # VLLM_CACHE_ROOT for every group's vLLM starts
say "$ngpu GPUs, TP $tp: groups ${groups[*]} in slots of $tp GPU(s)"
# each group's CPU cores (bench/cpu_slots.py: its GPUs' NUMA cores, shared out among groups on one node by physical
# core), so that side-by-side servers and clients do not contend for the host's cores. PIN_CPUS: auto (pin where
# `nvidia-smi topo -m`, or TOPO_FILE holding such output, gives every group's GPUs their CPU affinity), 1 (pin,
# equal parts where no topology), 0 (off); never where there are fewer allowed cores than groups
slot_spec=""
for i in "${!groups[@]}"; do slot_spec+="${slot_spec:+;}$(seq -s, $((i * tp)) $((i * tp + tp - 1)))"; done
pin="${PIN_CPUS:-auto}"
cpu_lists=()
slot_args=(--slots "$slot_spec")
[ -n "${TOPO_FILE:-}" ] && slot_args+=(--topo-file "$TOPO_FILE")
[ "$pin" = auto ] && slot_args+=(--require-topology)  # cpu_slots.py reads the whole output (no grep -q: SIGPIPE)
if { [ "$pin" = auto ] || [ "$pin" = 1 ]; } && command -v taskset >/dev/null; then
    mapfile -t cpu_lists < <("$py" bench/cpu_slots.py "${slot_args[@]}" 2>>"$setup_log")
    [ "${#cpu_lists[@]}" -eq "${#groups[@]}" ] \
        || { say "CPU pinning: off (PIN_CPUS=$pin: no GPU topology, or fewer cores than groups)"; cpu_lists=(); }
else
    say "CPU pinning: off (PIN_CPUS=$pin, or taskset missing)"
fi
pids=()
for i in "${!groups[@]}"; do
    g=${groups[$i]}
    gpus=$(seq -s, $((i * tp)) $((i * tp + tp - 1)))
    mkdir -p "$work/$g"
    pin_cmd=()
    if [ -n "${cpu_lists[$i]:-}" ]; then pin_cmd=(taskset -c "${cpu_lists[$i]}"); fi
    say "$g on GPUs $gpus${pin_cmd[*]:+, CPUs ${cpu_lists[$i]}}"
    CUDA_VISIBLE_DEVICES=$gpus OUT="$work/$g" GROUP=$g NAME="frontier_$g" BUDGET_S="${BUDGET_S:-540}" TP="$tp" \
        "${pin_cmd[@]}" bash bench/vs_vllm.sh "$@" >"$work/$g.log" 2>&1 &
    pids+=($!)
    sleep 2  # the free-port pick of one group is not raced by the next
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
reports=()
for g in "${groups[@]}"; do
    # in $OUT a `a+b` group's report is frontier_a_b.json: the device brings back no file whose name has a `+`
    if cp "$work/$g/frontier_$g.json" "$out/frontier_${g//+/_}.json" 2>/dev/null; then
        reports+=("$out/frontier_${g//+/_}.json")
    else say "$g: no frontier report (see $g.log in logs.tar.gz)"; fi
done
read -ra earlier <<<"${MERGE_WITH:-}"
name="${NAME:-frontier_tp}"
if [ "$((${#earlier[@]} + ${#reports[@]}))" -gt 0 ]; then
    ref_args=()
    [ -n "${REFERENCE:-}" ] && ref_args=(--reference "$REFERENCE")
    "$py" bench/compare_merge.py "${earlier[@]}" "${reports[@]}" --out "$out" --name "$name" "${ref_args[@]}" \
        2>&1 | tee -a "$setup_log"
fi
tar -czf "$out/logs.tar.gz" -C "$work" . 2>/dev/null
# with VLLM_CACHE: the archive into $OUT, or into logs.tar.gz when $OUT's 8 files are taken; its line comes last
# the pack's deadline is the device call's (CALL_S, 600 s less a margin), not BUDGET_S's: the groups' budgets start
# after the vLLM install, so at BUDGET_S 540 little is left; with VLLM_CACHE give BUDGET_S ~500 for a ~40-s pack
vcache_line="$(vllm_cache_pack "$out" "$out/logs.tar.gz" $((t0 + ${CALL_S:-585})))"
for g in "${groups[@]}"; do
    echo "== $g (log tail)"
    tail -5 "$work/$g.log"
done
[ -f "$out/$name.md" ] && { echo "===== $out/$name.md"; cat "$out/$name.md"; }
[ -n "$vcache_line" ] && echo "$vcache_line"
rm -rf "$work"
exit $status
