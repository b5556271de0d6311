#!/usr/bin/env bash
# An earlier commit's engine beside this one's, on the GPU machine, in ONE device call: the before/after of a
# change measured with the same client, GPU and flags (vLLM's FlashAttention-3 found for both, as bench/vs_vllm.sh
# does after the --stash calls, one per part `bash bench/vs_vllm.sh --split` cut).
#   Here:  git archive COMMIT | tar -x -C .oldtree     (.oldtree ignored in .git/info/exclude, carried)
#   There: run(command="bash bench/tree_ab.sh ARGS...", carry=[".whl", ".oldtree"])
# ARGS go to bench/compare.py in both trees (e.g. --systems rapid-adaptive --workloads multiturn,multiturn
# --bench-args '...' --rates inf); the old tree's tables are `<NAME>_before`, this tree's `<NAME>_after`
# (NAME: compare.py's --name, default tree_ab). Each tree's compare.py starts its own servers (`python -m
# rapidserve.cli` from that tree), one after the other. Tables and JSON land in $OUT (or bench/results/tree_ab).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
old="${OLD_TREE:-.oldtree}"
[ -f "$old/bench/compare.py" ] || { echo "tree_ab: no earlier tree at $old (see the header)" >&2; exit 2; }
out="${OUT:-bench/results/tree_ab}"
name="${NAME:-tree_ab}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# shellcheck source=bench/wheels.sh
. bench/wheels.sh
carried_wheels tree_ab || exit 2
# peer_env.sh reads stash, site, recipe and say
stash="${PEER_STASH:-/root/peerstash}"
export site="${PEER_SITE:-/root/peersite}"
setup_log="$out/tree_ab_setup.log"
: >"$setup_log"
t_start=$(date +%s)
say() { echo "tree_ab [$(($(date +%s) - t_start)) s]: $*" | tee -a "$setup_log"; }
export recipe=""
for d in .peer/peer_vllm "$stash/peer_vllm"; do [ -f "$d/install.sh" ] && recipe="$d" && break; done
# shellcheck source=bench/peer_env.sh
. bench/peer_env.sh
why_not=""
peer_install
if [ -n "$why_not" ]; then say "vLLM (so FA3) not installed: $why_not; both trees on Triton"; else expose_fa3; fi
here="$PWD"
status=0
for side in before after; do
    tree="$old"; [ "$side" = after ] && tree="$here"
    say "$side: $(cd "$tree" && "$py" -c 'import rapidserve; print(rapidserve.__file__)')"
    (cd "$tree" && "$py" bench/compare.py --model "${MODEL:-preset:qwen3-8b}" --out "$out" --name "${name}_$side" "$@") \
        >"$out/${name}_$side.log" 2>&1
    s=$?; say "$side: compare.py exited with $s"; status=$((status || s))
done
for side in before after; do
    grep -E "^== |rate " "$out/${name}_$side.log" | sed "s/^/$side: /"
done
exit "$status"
