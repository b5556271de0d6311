# shellcheck shell=bash disable=SC2154,SC2034  # the caller sets stash, site, recipe, py, say, setup_log; reads why_not
# Sourced by the bench scripts that use the stashed vLLM on the GPU machine (bench/vs_vllm.sh,
# bench/fa3_check.sh, bench/frontier_parallel.sh). Needs: stash, site, recipe, py, say (set by the caller).
#
# peer_install: installs vLLM from the stashed parts into $site unless an earlier call did; on failure
#   sets why_not to the reason.
# expose_fa3: puts a folder holding only a link to $site/vllm on PYTHONPATH, so rapidserve's FA3 backend
#   (rapidserve/attention/fa3.py) finds vLLM's FlashAttention-3 library by path, while none of the other
#   packages installed beside vLLM shadows the image's.
# vllm_cache_seed DIR / vllm_cache_pack OUT FALLBACK END: VLLM_CACHE=DIR (bench/vllm_cache.py), once per script
#   before its first vLLM start and after its last: every vLLM started in between (compare.py passes its environment
#   to serve_vllm.sh and to vLLM's server module alike) compiles into and loads from VLLM_CACHE_ROOT.

peer_install() {
    if [ -f "$site/vllm/__init__.py" ] && have="$(PYTHONPATH="$site" "$py" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"; then
        say "vLLM $have already installed in $site (an earlier call on this machine)"
    elif [ -z "$recipe" ]; then
        why_not="the recipe (peer_vllm: install.sh, make_model.py, serve_vllm.sh) was not found; see bench/vs_vllm.sh step 0 and 1"
    elif ! compgen -G "$stash/part*" >/dev/null; then
        why_not="no stashed parts in $stash (bench/vs_vllm.sh step 1: the --stash calls right before this one)"
    else
        local parts=("$stash"/part*)
        say "installing vLLM from ${#parts[@]} stashed parts ($recipe/install.sh)"
        if ! bash "$recipe/install.sh" 2>&1 | tee -a "$setup_log"; then
            why_not="install.sh failed (missing or partial parts? every stash call must reach the same machine)"
        fi
    fi
}

expose_fa3() {
    local dir=/root/fa3site
    mkdir -p "$dir" && ln -sfn "$site/vllm" "$dir/vllm" || { say "could not link $site/vllm into $dir"; return 1; }
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$dir"
    say "FA3 for rapidserve: $("$py" -c 'import torch; from rapidserve.attention import fa3; print(fa3.find_fa3(torch.device("cuda")).source)' 2>&1 | tail -1)"
}

# vLLM's torch.compile cache carried between sessions (VLLM_CACHE=DIR, a repo-relative folder the session carries).
# VLLM_CACHE_ROOT (exported) is one fixed folder, /tmp/vllm_cache_root (or VLLM_CACHE_ROOT when the caller set it):
# vLLM's vllm_compile_cache.py and Inductor's Triton group files name ABSOLUTE paths under it, so the root must be
# the same in every session; a machine still held from an earlier call keeps it, and the seed is written over it.
# Seeded from DIR's vllm_cache.tar.xz (or .partNN) when there is one; sets vcache_since (the unpack's end) for
# vllm_cache_pack. Without an archive, or with one that cannot be read, vLLM compiles as without VLLM_CACHE.
vllm_cache_seed() {
    local dir=$1 line
    export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-/tmp/vllm_cache_root}"
    vcache_since=""
    if ! mkdir -p "$VLLM_CACHE_ROOT" 2>/dev/null; then
        say "vllm cache: cannot make $VLLM_CACHE_ROOT: vLLM keeps its default cache (nothing packed)"
        unset VLLM_CACHE_ROOT
        return 1
    fi
    rm -f "$VLLM_CACHE_ROOT/vllm_cache_seed.json"  # an earlier call's on this machine: the unpack writes this seed's
    if [ -d "$dir" ] && compgen -G "$dir/vllm_cache.*" >/dev/null; then
        if line=$("$py" bench/vllm_cache.py unpack "$dir" "$VLLM_CACHE_ROOT" 2>&1); then
            say "$line"
        else
            say "vllm cache: the carried archive in $dir could not be read ($(tail -1 <<<"$line")): vLLM compiles as" \
                "without it into VLLM_CACHE_ROOT=$VLLM_CACHE_ROOT"
        fi
    else
        say "vllm cache: no vllm_cache.tar.xz nor vllm_cache.partNN in $dir: vLLM compiles as without it into" \
            "VLLM_CACHE_ROOT=$VLLM_CACHE_ROOT"
    fi
    vcache_since=$(date +%s)
}

# After the runs: what VLLM_CACHE_ROOT's compile cache holds (bench/vllm_cache.py pack: the seed's entries and this
# run's, the least recently used left out over 30 MiB) into OUT as vllm_cache.tar.xz (or .partNN of <= 15 MiB), or
# into the .tar.gz FALLBACK (as vllm_cache/...) when OUT's 8 files (64 MiB) have no room; nothing when the seed
# already held all of it. The pack gets until END (epoch seconds), at least 10 s. One line says what it did.
vllm_cache_pack() {
    [ -n "${vcache_since:-}" ] || return 0
    local out=$1 fallback=$2 end=$3 left line rc user n
    left=$((end - $(date +%s)))
    if [ "$left" -lt 10 ]; then
        say "vllm cache: not packed: $left s left of the call's budget"
        return 0
    fi
    line=$(timeout -k 5 "$left" "$py" bench/vllm_cache.py pack "$VLLM_CACHE_ROOT" "$out" --since "$vcache_since" \
        --skip-unchanged ${fallback:+--fallback "$fallback"} 2>&1)
    rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then line="vllm cache: not packed: the pack took over $left s"; fi
    say "$line"
    # Inductor's default cache: vLLM's AOT compile points TORCHINDUCTOR_CACHE_DIR into VLLM_CACHE_ROOT before it
    # compiles or loads, so this should stay empty (not carried); said when it is not
    user="$(id -un 2>/dev/null || echo root)"
    n=$(find "/tmp/torchinductor_$user" -type f 2>/dev/null | wc -l)
    if [ "$n" -gt 0 ]; then
        say "vllm cache: /tmp/torchinductor_$user (not carried) holds $n files," \
            "$(du -sh "/tmp/torchinductor_$user" 2>/dev/null | cut -f1)"
    fi
}
