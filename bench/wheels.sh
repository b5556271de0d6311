# shellcheck shell=bash
# Sourced (from the repository root) by the bench/*.sh scripts that run on the GPU machine, which reaches no
# package index: the wheels carried in .whl/ (msgspec, posix_ipc, ...: the device README's `pip download`)
# are installed into /tmp/site when the Python modules they provide are missing, and /tmp/site goes first
# on PYTHONPATH. Uses $py (default python3).
#   carried_wheels WHO [MODULES]   -> 0 (installed, or nothing to do); 2, with a message naming WHO, when pip fails
carried_wheels() {
    local who=$1 modules=${2:-msgspec, posix_ipc} python=${py:-python3}
    compgen -G ".whl/*.whl" >/dev/null || return 0
    "$python" -c "import $modules" 2>/dev/null && return 0
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "$who: installing the carried wheels (.whl) failed" >&2; return 2; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
}
