#!/usr/bin/env bash
# The whole `pytest -m gpu` suite on a GPU machine, in one call, optionally several times in a row.
#
#   bench/gpu_suite.sh [--repeat N] [--budget-s S] [--timeout-s T] [--part K/N | --spread] [--triton-cache DIR]
#                      [-- extra pytest args]
#
# - Installs the wheels carried in .whl/ (if any, and msgspec / posix_ipc are missing) into /tmp/site
#   and puts it on PYTHONPATH (the lent GPU machines lack those two and reach no registry).
# - Runs every test file holding a `gpu` mark, in pytest's default order (tests/test_attention.py
#   first: the order that exposed the graph-capture stream race), `-m gpu`, N times.
# - --budget-s: a further run starts only if the last run's time still fits in S seconds overall.
# - --timeout-s: per-test limit through pytest-timeout when it is installed (default 300).
# - --part K/N: only the K-th of N contiguous slices of the sorted file list (the whole suite outgrew one 600-s device
#   call on one H200: 546 s on 2026-11-29), cut to about equal time by bench/gpu_suite_times.json
#   (bench/gpu_suite_parts.py; the summary's file_seconds refresh it). Parts 1..N, one call each back to back, run
#   every file once in the default order; the summary says which part it was.
# - --spread (a machine of G >= 2 GPUs): part K/G on GPU K-1 (CUDA_VISIBLE_DEVICES), the G parts at the same time,
#   then the tests that need two GPUs (their names hold `two_gpus`; the parts skip them) on all of them; logs and
#   summaries under $OUT/partK/ and $OUT/multi/, and one table of them last. The whole suite on 2 x H200: ~400 s
#   (2026-11-29: 236 s and 364 s side by side, then 29 s), where one H200 takes ~550 s.
# - Logs go to $OUT (when set) or bench/results/gpu_suite_logs/: gpu_suite_runN.log, and the summary
#   as gpu_suite.md / gpu_suite.json (command, GPU, date, versions, per-run counts and failures).
# - The summary table (run, passed, failed, skipped, seconds) is printed last.
# - --triton-cache DIR (a repo-relative, git-ignored folder the session carries, e.g. .triton): Triton's kernel cache
#   carried between sessions (each GPU machine starts bare, and half the suite's time was Triton compiling: the MoE
#   files ~335 s of ~690 s of test time). TRITON_CACHE_DIR is set to a fresh folder under /tmp, seeded from DIR's
#   triton_cache.tar.xz (or triton_cache.part00, .part01, ...) when there is one; after the runs, what loading needs
#   (each kernel's metadata json, cubin and group file, Triton's gcc-built launcher .so; no IRs) of every entry the
#   runs read or wrote goes to $OUT/triton_cache.tar.xz, or parts of <= 15 MiB (bench/triton_cache.py; --spread: the
#   parts and the two-GPU run share the one cache). Its line ("triton cache: N of M entries packed (R read from the
#   seed, C compiled in this run): ...") comes after the table. Entries are keyed by the kernels' source (and line),
#   Triton's own build, ptxas and the arch (90), so a cache from an older commit only misses, never loads a stale
#   kernel. The archive lies at $OUT's top level: of more than 8 files (--spread leaves 14) the device brought the
#   top-level ones back first in an earlier call; check the call's files_left_out all the same.
#   First session:  run(command="bash bench/gpu_suite.sh --spread --triton-cache .triton", carry=[".whl"],
#                   kind="nvidia-h200-x2"), then here:
#                   mkdir -p .triton && cp /work/.device/N/triton_cache* .triton/ && echo /.triton/ >>.git/info/exclude
#                   (N: the call's files folder; replace .triton/'s old archive files, never mix two packs' parts).
#   Next sessions:  the same command with carry=[".whl", ".triton"]; copy the new archive over .triton/ again.
#   Through fa3_check.sh: env TRITON_CACHE=.triton (run(command="TRITON_CACHE=.triton bash bench/fa3_check.sh", ...)).
#   What it saves: compare the summaries' file_seconds (gpu_suite.json) of a run without and one with a seed.
#   Without the flag nothing of this runs.
# Exit status: 0 when every run passed with no failure or error, else 1.
set -uo pipefail

all_args="$*"
repeat=1
budget=0
per_test=300
part=""
spread=0
tcache=""
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --repeat) repeat="$2"; shift 2 ;;
        --budget-s) budget="$2"; shift 2 ;;
        --timeout-s) per_test="$2"; shift 2 ;;
        --part) part="$2"; shift 2 ;;
        --spread) spread=1; shift ;;
        --triton-cache) tcache="$2"; shift 2 ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,43p' "$0"; exit 0 ;;
        *) echo "gpu_suite.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [ -n "$part" ]; then
    if ! [[ "$part" =~ ^([0-9]+)/([0-9]+)$ ]] || [ "${BASH_REMATCH[1]}" -lt 1 ] \
        || [ "${BASH_REMATCH[1]}" -gt "${BASH_REMATCH[2]}" ]; then
        echo "gpu_suite.sh: --part must be K/N with 1 <= K <= N (got '$part')" >&2
        exit 2
    fi
    k="${BASH_REMATCH[1]}"
    n="${BASH_REMATCH[2]}"
fi

cd "$(dirname "$0")/.." || exit 2
out="${OUT:-bench/results/gpu_suite_logs}"
mkdir -p "$out"
work="$(mktemp -d)"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

# shellcheck source=bench/wheels.sh
. bench/wheels.sh
carried_wheels gpu_suite.sh || exit 2

if [ -n "$tcache" ]; then  # Triton's cache, seeded from the carried archive (bench/triton_cache.py)
    tcache_work="$(mktemp -d /tmp/triton_cache.XXXXXX)"
    export TRITON_CACHE_DIR="$tcache_work/cache"
    mkdir -p "$TRITON_CACHE_DIR"
    if [ -d "$tcache" ] && compgen -G "$tcache/triton_cache.*" >/dev/null; then
        "$py" bench/triton_cache.py unpack "$tcache" "$TRITON_CACHE_DIR" \
            || echo "gpu_suite: the carried Triton cache in $tcache could not be read: starting without it"
    else
        echo "gpu_suite: no triton_cache.tar.xz nor triton_cache.partNN in $tcache: Triton compiles every kernel"
    fi
    tcache_since=$(date +%s)  # after the unpack, whose files' times lie in the past: pack tells what the runs read
fi
# pack_triton_cache: with --triton-cache, what loading needs of the entries read or written since the unpack into
# $out/triton_cache.tar.xz (or .partNN), its line printed; the working cache removed
pack_triton_cache() {
    [ -n "$tcache" ] || return 0
    "$py" bench/triton_cache.py pack "$TRITON_CACHE_DIR" "$out" --since "$tcache_since" 2>&1 \
        || echo "gpu_suite: the Triton cache was not packed"
    rm -rf "$tcache_work"
}

if [ "$spread" = 1 ]; then
    if [ -n "$part" ]; then
        echo "gpu_suite.sh: give --part or --spread, not both" >&2
        exit 2
    fi
    ngpu="$(nvidia-smi -L 2>/dev/null | wc -l)"
    if [ "$ngpu" -lt 2 ]; then
        echo "gpu_suite.sh: --spread needs a machine of two or more GPUs ($ngpu found); run it without --spread" >&2
        exit 2
    fi
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    pids=()
    for ((g = 1; g <= ngpu; g++)); do
        CUDA_VISIBLE_DEVICES=$((g - 1)) OUT="$out/part$g" bash "$0" --repeat 1 --timeout-s "$per_test" \
            --part "$g/$ngpu" -- "${extra[@]}" >"$out/part$g.txt" 2>&1 &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    mkdir -p "$out/multi"
    OUT="$out/multi" bash "$0" --repeat 1 --timeout-s "$per_test" -- -k two_gpus "${extra[@]}" \
        >"$out/multi.txt" 2>&1 || status=1
    # the parts' seconds per file, one file first among $OUT's (a call brings back a limited count):
    # review it and copy it to bench/gpu_suite_times.json to balance the next --spread
    "$py" bench/gpu_suite_parts.py --merge "$out"/part*/gpu_suite.json >"$out/gpu_suite_times.json" 2>/dev/null \
        || rm -f "$out/gpu_suite_times.json"
    echo "gpu_suite --spread over $ngpu GPUs: part K/$ngpu on GPU K-1 side by side, then the two-GPU tests"
    echo "| slice | passed | failed | errors | skipped | seconds |"
    echo "| --- | --- | --- | --- | --- | --- |"
    for d in $(seq -f "part%g" 1 "$ngpu") multi; do
        "$py" - "$out/$d/gpu_suite.json" "$d" <<'EOF2'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["runs"]
except (OSError, ValueError, KeyError):
    print(f"| {sys.argv[2]} | no summary: see {sys.argv[2]}.txt | | | | |")
    sys.exit(0)
for r in rows:
    print(f"| {sys.argv[2]} | {r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} | {r['seconds']} |")
    for f in r["failures"]:
        print(f"|   {f} | | | | | |")
EOF2
    done
    pack_triton_cache
    exit $status
fi

mapfile -t files < <(grep -l -E 'mark\.gpu' tests/test_*.py | sort)
if [ -n "$part" ]; then  # contiguous slices balanced by bench/gpu_suite_times.json (bench/gpu_suite_parts.py)
    mapfile -t files < <("$py" bench/gpu_suite_parts.py --part "$k/$n" "${files[@]}")
fi
timeout_args=()
if "$py" -c 'import pytest_timeout' 2>/dev/null; then
    timeout_args=(--timeout="$per_test")
fi
gpu="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
gpu="${gpu:-$("$py" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")')}"
versions="$("$py" -c 'import sys, torch, triton; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}")' 2>&1 | tail -1)"
echo "gpu_suite: $gpu; $versions; ${#files[@]} files: ${files[*]}"

t_start=$(date +%s)
last=0
runs=0
for ((i = 1; i <= repeat; i++)); do
    now=$(date +%s)
    if [ "$budget" -gt 0 ] && [ "$i" -gt 1 ] && [ $((now - t_start + last)) -gt "$budget" ]; then
        echo "gpu_suite: run $i not started: $((now - t_start)) s used, the last run took $last s, budget $budget s"
        break
    fi
    echo "===== gpu_suite run $i/$repeat: $(date -u +%FT%TZ)"
    t0=$(date +%s%N)
    "$py" -m pytest -m gpu -ra -p no:cacheprovider "${timeout_args[@]}" --junitxml="$work/run$i.xml" \
        "${files[@]}" "${extra[@]}" 2>&1 | tee "$out/gpu_suite_run$i.log"
    ms=$((($(date +%s%N) - t0) / 1000000))
    echo "$i $ms" >>"$work/times"
    last=$((ms / 1000))
    runs=$i
done

"$py" - "$work" "$out" "$runs" "$gpu" "$versions" "$all_args" <<'EOF'
import json, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

work, out, runs, gpu, versions, args = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
times = dict(line.split() for line in (work / "times").read_text().splitlines()) if (work / "times").exists() else {}
rows = []
for i in range(1, runs + 1):
    row = {"run": i, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "seconds": round(int(times.get(str(i), 0)) / 1000, 1),
           "failures": []}
    xml = work / f"run{i}.xml"
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            kinds = {c.tag for c in case}
            if "failure" in kinds or "error" in kinds:
                key = "failed" if "failure" in kinds else "errors"
                row[key] += 1
                node = case.find("failure") if "failure" in kinds else case.find("error")
                msg = (node.get("message", "") if node is not None else "").splitlines()
                row["failures"].append(f"{name}: {msg[0][:200] if msg else ''}")
            elif "skipped" in kinds:
                row["skipped"] += 1
            else:
                row["passed"] += 1
    else:
        row["errors"] = 1
        row["failures"].append("no junit report: pytest did not finish")
    rows.append(row)
summary = {"command": f"bench/gpu_suite.sh {args}".strip(), "gpu": gpu, "versions": versions,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": rows}
if (work / "run1.xml").exists():  # seconds per file, for bench/gpu_suite_times.json (bench/gpu_suite_parts.py --merge)
    sys.path.insert(0, "bench")
    from gpu_suite_parts import file_seconds, slowest_tests
    summary["file_seconds"] = file_seconds(work / "run1.xml")
    summary["slowest_tests"] = slowest_tests(work / "run1.xml")
(out / "gpu_suite.json").write_text(json.dumps(summary, indent=2) + "\n")
table = ["| run | passed | failed | errors | skipped | seconds |", "| --- | --- | --- | --- | --- | --- |"]
table += [f"| {r['run']} | {r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} | {r['seconds']} |" for r in rows]
fails = [f"- run {r['run']}: {f}" for r in rows for f in r["failures"]]
md = [f"# `pytest -m gpu` on {gpu} ({summary['date']})", "", f"`{summary['command']}`; {versions}.", "", *table]
if fails:
    md += ["", "Failures:", *fails]
if summary.get("slowest_tests"):
    md += ["", "Slowest tests (run 1, s):", *(f"- {t:.1f} {name}" for name, t in summary["slowest_tests"][:10])]
(out / "gpu_suite.md").write_text("\n".join(md) + "\n")
print("\n".join(fails))
print("\n".join(table))
ok = rows and all(r["failed"] == 0 and r["errors"] == 0 for r in rows)
sys.exit(0 if ok else 1)
EOF
status=$?
rm -rf "$work"
if [ -n "$tcache" ]; then
    line="$(pack_triton_cache)"
    echo "$line"
    printf '\n%s\n' "$line" >>"$out/gpu_suite.md"
fi
exit $status
