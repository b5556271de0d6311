"""A/B of the engine's TTFT and inter-token latency between two versions of the code, in one GPU run.

Runs bench/engine_itl.py (this tree's copy, for both versions) as a subprocess with `--code <dir>`
for two labelled code directories, alternating A, B, A, B, ... for `--repeat` rounds, each run under
a wall-clock timeout and all of them under one overall budget (no run starts that would not fit; the
report says which were skipped). Extra arguments after `--` go to every engine_itl run unchanged.
Prints a table last, one row per metric: A median [min-max], B median [min-max], B/A (ratio of the
medians; above 1 is slower for latencies, faster for tokens/s) and the number of runs of each; writes
it to <out>/route_ab.md, and every run's figures (engine_itl's JSON without its token trace) plus the
medians, the command, the date and the GPU to <out>/route_ab.json. A run that fails or times out is
recorded as failed with the tail of its stderr and the others go on.

Make the old tree (the bench script itself always comes from this tree; COMMIT records which code it was):

    mkdir -p _before && git archive <commit> rapidserve | tar -x -C _before && echo <commit> > _before/COMMIT

Then, e.g. (on the GPU machine; write into $OUT there so the results come back):

    python bench/experiments/2026-11/route_ab.py --a before=_before --b after=. --repeat 3 --out $OUT \\
        --runs-dir $OUT/runs -- --model preset:llama-3-8b --decode-tokens 1500

`--before DIR --after DIR` is the same as `--a before=DIR --b after=DIR`. The device machine copies the
working tree's tracked and untracked-but-not-ignored files; a git-ignored old tree (or one under an
ignored folder) travels only when it is named in the run's `carry`. A CPU smoke run (two runs of the
same tree): `python bench/experiments/2026-11/route_ab.py --before . --after . --repeat 1 --out /tmp/ab -- --model
preset:tiny-llama --dtype float32 --num-decodes 4 --decode-prompt 64 --long-prompt 256 --num-long 2
--max-model-len 1024 --decode-tokens 900 --probe 5 --gap 0.2 --warm 0.5`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
REPO = os.path.dirname(HERE)
BENCH = os.path.join(HERE, "engine_itl.py")  # maintained, in bench/
TERM_GRACE_S = 30.0  # after SIGTERM (the engine shuts its workers down), then SIGKILL to the process group
RESERVED = ("--code", "--out", "--tag")  # set by this driver for each run


def _long_ttft_median(r: dict[str, Any]) -> float:
    return statistics.median(x["ttft_s"] for x in r["long_prompts"])


# (key, row label, unit, digits, getter from an engine_itl JSON)
METRICS: list[tuple[str, str, str, int, Callable[[dict[str, Any]], float]]] = [
    ("idle_ttft_p50", "idle short request TTFT p50", "ms", 2, lambda r: r["idle_short_requests"]["ttft_ms"]["p50"]),
    ("idle_ttft_p90", "idle short request TTFT p90", "ms", 2, lambda r: r["idle_short_requests"]["ttft_ms"]["p90"]),
    ("idle_itl_p50", "idle short request ITL p50", "ms", 2, lambda r: r["idle_short_requests"]["itl_ms"]["p50"]),
    ("phase1_ttft_p50", "phase-1 TTFT p50 (all sent at once)", "s", 3, lambda r: r["phase1_ttft_s"]["p50"]),
    ("phase1_ttft_p90", "phase-1 TTFT p90 (all sent at once)", "s", 3, lambda r: r["phase1_ttft_s"]["p90"]),
    ("itl_decode_p50", "decode-only ITL p50", "ms", 2, lambda r: r["itl_ms_decode_only"]["p50"]),
    ("itl_decode_p95", "decode-only ITL p95", "ms", 2, lambda r: r["itl_ms_decode_only"]["p95"]),
    ("itl_decode_p99", "decode-only ITL p99", "ms", 2, lambda r: r["itl_ms_decode_only"]["p99"]),
    ("itl_prefill_p50", "ITL during prefill p50", "ms", 2, lambda r: r["itl_ms_during_prefill"]["p50"]),
    ("itl_prefill_p95", "ITL during prefill p95", "ms", 2, lambda r: r["itl_ms_during_prefill"]["p95"]),
    ("itl_prefill_p99", "ITL during prefill p99", "ms", 2, lambda r: r["itl_ms_during_prefill"]["p99"]),
    ("long_ttft_median", "long-prompt TTFT median", "s", 3, _long_ttft_median),
    ("prefill_tok_s", "prefill tokens/s beside decode", "tok/s", 0, lambda r: r["prefill_tokens_per_s"]),
    ("engine_start_s", "engine start", "s", 1, lambda r: r["engine_start_s"]),
]


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__,
                                 usage="%(prog)s (--a L=DIR --b L=DIR | --before DIR --after DIR) [options] "
                                       "[-- engine_itl args]",
                                 epilog="arguments after -- go to bench/engine_itl.py",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", metavar="LABEL=DIR", help="version A: a label and the directory holding its rapidserve/")
    ap.add_argument("--b", metavar="LABEL=DIR", help="version B")
    ap.add_argument("--before", metavar="DIR", help="same as --a before=DIR")
    ap.add_argument("--after", metavar="DIR", help="same as --b after=DIR")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of A then B")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="wall-clock limit of one engine_itl run")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="overall limit: no run starts that would not fit in what is left")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="where route_ab.json and .md go")
    ap.add_argument("--runs-dir", default=None, help="where each run's engine_itl files and logs go "
                    "(default: a new temporary directory)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the runs")
    a = ap.parse_args(own)
    if (a.a or a.b) and (a.before or a.after):
        ap.error("use --a/--b or --before/--after, not both")
    a.versions = []
    for flag, spec, default_label in (("--a", a.a, None), ("--b", a.b, None),
                                      ("--before", a.before, "before"), ("--after", a.after, "after")):
        if spec is None:
            continue
        if default_label is None:
            label, sep, d = spec.partition("=")
            if not sep or not label or not d:
                ap.error(f"{flag} {spec!r}: use LABEL=DIR")
        else:
            label, d = default_label, spec
        d = os.path.realpath(d)
        if not os.path.isfile(os.path.join(d, "rapidserve", "__init__.py")):
            ap.error(f"{flag}: {d} holds no rapidserve/__init__.py")
        a.versions.append((label, d))
    if len(a.versions) != 2:
        ap.error("give two versions: --a LABEL=DIR --b LABEL=DIR, or --before DIR --after DIR")
    if a.versions[0][0] == a.versions[1][0]:
        ap.error("the two labels must differ")
    if a.repeat < 1:
        ap.error("--repeat must be >= 1")
    bad = [x for x in extra if x.split("=")[0] in RESERVED]
    if bad:
        ap.error(f"{bad}: the driver sets {', '.join(RESERVED)} itself")
    return a, extra


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def run_one(a: argparse.Namespace, extra: list[str], label: str, code: str, i: int, timeout: float) -> dict[str, Any]:
    """One engine_itl run in its own process group; returns its record (figures or why it failed)."""
    tag = f"{label}-{i}"
    cmd = [a.python, BENCH, "--code", code, "--out", a.runs_dir, "--tag", tag, *extra]
    log_out, log_err = os.path.join(a.runs_dir, tag + ".stdout"), os.path.join(a.runs_dir, tag + ".stderr")
    rec: dict[str, Any] = {"label": label, "round": i, "code_dir": code, "cmd": shlex.join(cmd),
                           "timeout_s": round(timeout, 1)}
    print(f"[route_ab] {tag}: {shlex.join(cmd)} (timeout {timeout:.0f} s)", flush=True)
    t0 = time.monotonic()
    with open(log_out, "w") as fo, open(log_err, "w") as fe:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fo, stderr=fe, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGTERM)  # engine_itl cancels its run and shuts the engine down
            try:
                rc = proc.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        if _group_alive(proc.pid):  # leftover workers of this run's own process group
            rec["leftover_processes_killed"] = True
            os.killpg(proc.pid, signal.SIGKILL)
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    rec["rc"] = rc
    path = os.path.join(a.runs_dir, f"engine_itl_mps-{_mps(extra)}_{tag}.json")
    if timed_out or rc != 0 or not os.path.isfile(path):
        rec["status"] = "timeout" if timed_out else "failed"
        rec["stderr_tail"] = _tail(log_err) or _tail(log_out)
        print(f"[route_ab] {tag}: {rec['status']} (rc {rc}) after {rec['wall_s']} s; stderr tail:\n"
              + "\n".join(rec["stderr_tail"].splitlines()[-15:]), flush=True)
        return rec
    with open(path) as f:
        res = json.load(f)
    res.pop("trace", None)
    rec["status"] = "ok"
    rec["json"] = path
    rec["code_commit"] = res.get("code_commit")
    rec["metrics"] = {}
    for key, *_, get in METRICS:
        try:
            rec["metrics"][key] = get(res)
        except (KeyError, TypeError, ValueError, statistics.StatisticsError):
            rec["metrics"][key] = None
    rec["engine_itl"] = res
    print(f"[route_ab] {tag}: ok in {rec['wall_s']} s", flush=True)
    return rec


def _mps(extra: list[str]) -> str:
    """The --mps value engine_itl will use (it names its files after it)."""
    for j, x in enumerate(extra):
        if x == "--mps" and j + 1 < len(extra):
            return extra[j + 1]
        if x.startswith("--mps="):
            return x.split("=", 1)[1]
    return "auto"


def _finite(xs: list[float | None]) -> list[float]:
    return [x for x in xs if x is not None and x == x]  # drops None and nan


def summarize(runs: list[dict[str, Any]], versions: list[tuple[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, *_ in METRICS:
        row: dict[str, Any] = {}
        for label, _ in versions:
            xs = _finite([r["metrics"].get(key) for r in runs if r["label"] == label and r["status"] == "ok"])
            row[label] = ({"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs
                          else {"median": None, "min": None, "max": None, "n": 0})
        ma, mb = (row[label]["median"] for label, _ in versions)
        row["ratio_b_over_a"] = mb / ma if ma and mb is not None else None
        out[key] = row
    return out


def table(summary: dict[str, Any], versions: list[tuple[str, str]]) -> str:
    (la, _), (lb, _) = versions

    def cell(s: dict[str, Any], digits: int) -> str:
        if s["median"] is None:
            return "n/a"
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"

    lines = [f"| metric | unit | A = {la}: median [min-max] | B = {lb}: median [min-max] | B/A | n (A / B) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key, name, unit, digits, _ in METRICS:
        row = summary[key]
        ratio = row["ratio_b_over_a"]
        lines.append(f"| {name} | {unit} | {cell(row[la], digits)} | {cell(row[lb], digits)} | "
                     f"{'n/a' if ratio is None else f'{ratio:.3f}'} | {row[la]['n']} / {row[lb]['n']} |")
    return "\n".join(lines) + "\n"


def gpu_name(runs: list[dict[str, Any]]) -> str:
    for r in runs:
        if r["status"] == "ok":
            return str(r["engine_itl"].get("gpu"))
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        return out.splitlines()[0] if out else "n/a"
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def main() -> int:
    a, extra = parse(sys.argv[1:])
    t_start = time.monotonic()
    a.runs_dir = os.path.realpath(a.runs_dir or tempfile.mkdtemp(prefix="route_ab-"))
    os.makedirs(a.runs_dir, exist_ok=True)
    command = "python bench/experiments/2026-11/route_ab.py " + shlex.join(sys.argv[1:])
    plan = [(i, label, code) for i in range(a.repeat) for label, code in a.versions]
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    notes: list[str] = []
    for k, (i, label, code) in enumerate(plan):
        left = a.budget_s - (time.monotonic() - t_start)
        # the longest run so far is the estimate for the next one (nothing to go by before the first)
        est = max((r["wall_s"] for r in runs), default=0.0) * 1.1 + 5
        need = max(est, 30.0) + TERM_GRACE_S  # + the time a timed-out run gets to shut its engine down
        if left < need:
            skipped = [f"{lb}-{j}" for j, lb, _ in plan[k:]]
            notes.append(f"budget: {left:.0f} s of --budget-s {a.budget_s:.0f} left, a run needs {need:.0f} s "
                         f"(longest so far x 1.1 + 5 s, at least 30 s, + {TERM_GRACE_S:.0f} s to shut down): "
                         f"not started: {', '.join(skipped)}")
            print(f"[route_ab] {notes[-1]}", flush=True)
            break
        runs.append(run_one(a, extra, label, code, i, min(a.timeout_s, left - TERM_GRACE_S)))
    summary = summarize(runs, a.versions)
    for r in runs:
        if r["status"] != "ok":
            notes.append(f"{r['label']}-{r['round']} {r['status']} (rc {r['rc']}, {r['wall_s']} s); "
                         f"stderr tail in route_ab.json; logs in {a.runs_dir}")
    commits = {label: sorted({str(r.get("code_commit")) for r in runs if r["label"] == label and r["status"] == "ok"})
               for label, _ in a.versions}
    report = {
        "command": command, "engine_itl_args": extra,
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": gpu_name(runs),
        "versions": [{"label": lb, "code_dir": d, "code_commit": commits[lb]} for lb, d in a.versions],
        "repeat": a.repeat, "timeout_s": a.timeout_s, "budget_s": a.budget_s,
        "total_wall_s": round(time.monotonic() - t_start, 1), "runs_dir": a.runs_dir,
        "skipped": skipped, "notes": notes, "medians": summary, "runs": runs,
    }
    tab = table(summary, a.versions)
    (la, da), (lb, db) = a.versions
    md = [f"# Engine TTFT / ITL A/B: {la} vs {lb} on {report['gpu']} ({report['date']})", "",
          f"Command: `{command}`  ",
          f"A = {la}: `{da}` at {', '.join(commits[la]) or 'n/a'}  ",
          f"B = {lb}: `{db}` at {', '.join(commits[lb]) or 'n/a'}  ",
          f"Runs alternate A, B; {a.repeat} round(s); B/A is the ratio of the medians (above 1: B is slower for "
          f"latencies, faster for tokens/s). Total {report['total_wall_s']} s.", ""]
    md += [f"- {n}" for n in notes] + ([""] if notes else []) + [tab]
    text = "\n".join(md)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "route_ab.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(a.out, "route_ab.md"), "w") as f:
        f.write(text)
    print("\n" + text, flush=True)
    return 0 if any(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
