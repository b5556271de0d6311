# Sourced by the bench scripts that use the stashed vLLM on the GPU machine (bench/vs_vllm.sh,
# bench/fa3_check.sh). Needs: stash, site, recipe, py, say (set by the caller).
#
# peer_install: installs vLLM from the stashed parts into $site unless an earlier call did; on failure
#   sets why_not to the reason.
# expose_fa3: puts a folder holding only a link to $site/vllm on PYTHONPATH, so rapidserve's FA3 backend
#   (rapidserve/attention/fa3.py) finds vLLM's FlashAttention-3 library by path, while none of the other
#   packages installed beside vLLM shadows the image's.

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
