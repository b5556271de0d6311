#!/usr/bin/env bash
# The goodput frontier of bench/vs_vllm.sh's three system groups side by side, one GPU each, in ONE device call
# of a machine with several GPUs of one model (nvidia-h200-x2 / -x4): the groups run at the same time on
# separate GPUs of one host (same GPU model, same client code, each client its own process), so one 10-minute
# call holds what would otherwise take three.
#
#   run(command="bash bench/frontier_parallel.sh", carry=[".whl"], kind="nvidia-h200-x4", timeout_s=600)
#   (after the --stash calls of bench/vs_vllm.sh, on the same machine)
#
# GPU 0: ours (rapidserve, always-fused, always-split, one after the other); GPU 1: vllm-a (vLLM default and
# --max-num-batched-tokens 1024); GPU 2: vllm-b (2048 and --performance-mode interactivity), where a third GPU
# exists. vLLM is installed and the model folder written once, before the groups start. Each group's
# frontier JSON + markdown come back in $OUT (frontier_<group>.json/.md) with one log per group; join them
# here with `python bench/compare.py --continue-from ...` or read them side by side. Knobs: vs_vllm.sh's
# (WORKLOADS, NUM_PROMPTS, SEARCH_ARGS, MAX_MODEL_LEN, GPU_MEM, PRESET), BUDGET_S (each group's, 540).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${OUT:-bench/results/frontier_parallel}"
mkdir -p "$out"
py="${PYTHON:-python3}"
stash="${PEER_STASH:-/root/peerstash}"
site="${PEER_SITE:-/root/peersite}"  # read by peer_env.sh
export site
model="${PEER_MODEL:-/root/peermodel}"
setup_log="$out/setup.log"
t0=$(date +%s)
say() { echo "frontier_parallel [$(( $(date +%s) - t0 )) s]: $*" | tee -a "$setup_log"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# shellcheck source=bench/wheels.sh
. bench/wheels.sh
carried_wheels frontier_parallel || exit 2
recipe=""
for d in "$stash/peer_vllm" .peer/peer_vllm; do [ -f "$d/install.sh" ] && recipe="$d" && break; done
why_not=""
# shellcheck source=bench/peer_env.sh
. bench/peer_env.sh
peer_install
[ -n "$why_not" ] && say "vLLM not installed: $why_not"
if [ -z "$why_not" ] && [ ! -f "$model/config.json" ] && [ -n "$recipe" ]; then
    "$py" "$recipe/make_model.py" "$model" >>"$setup_log" 2>&1 || say "make_model.py failed"
fi
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
groups=(ours vllm-a vllm-b)
[ "$ngpu" -lt 3 ] && groups=(ours vllm-a)
say "$ngpu GPUs: groups ${groups[*]} on GPUs 0..$(( ${#groups[@]} - 1 ))"
work="$(mktemp -d)"
pids=()
for i in "${!groups[@]}"; do
    g=${groups[$i]}
    mkdir -p "$work/$g"
    CUDA_VISIBLE_DEVICES=$i OUT="$work/$g" GROUP=$g NAME="frontier_$g" BUDGET_S="${BUDGET_S:-540}" \
        bash bench/vs_vllm.sh >"$out/$g.log" 2>&1 &
    pids+=($!)
    sleep 2  # the free-port pick of one group is not raced by the next
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
for g in "${groups[@]}"; do
    cp "$work/$g/frontier_$g.json" "$work/$g/frontier_$g.md" "$out/" 2>/dev/null || say "$g: no frontier report"
done
for g in "${groups[@]}"; do
    echo "== $g"
    head -60 "$out/frontier_$g.md" 2>/dev/null
done
exit $status
