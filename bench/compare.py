"""Engine configurations, and the real vLLM, side by side on one GPU: the same load against each, as a
request-rate sweep or (`--goodput-search`) as each system's goodput frontier.

    python bench/compare.py --model preset:qwen3-8b --systems rapid-adaptive,hybrid-2048 \\
        --workloads 4096:64,4096:1024 --rates 1,2,4,8,inf --num-prompts 32 --duration-budget-s 2400
    python bench/compare.py --systems vllm,rapid-adaptive,hybrid-2048 --vllm-model /root/peermodel \\
        --serve-args "--max-model-len 8192 --gpu-memory-utilization 0.8" --workloads multiturn \\
        --bench-args "--input-len 2048 --turn-input-len 256 --output-len 64 --num-turns 6" --rates inf
    python bench/compare.py --goodput-search --systems rapidserve,always-fused,always-split,vllm \\
        --vllm-model /root/peermodel --workloads 4096:64 --num-prompts 80 --budget-s 540

The goodput frontier (`--goodput-search`; bench/compare_frontier.py): per system and workload, `rapidserve bench
--goodput-search`'s search (rapidserve/benchmark/goodput.py: the highest Poisson rate at which a share of requests,
90% and 99%, meet a per-request p95 ITL bound, 25/50/100/200 ms or none, and the TTFT rule), started from that
system's own closed-loop peak; the `--search-*` flags are bench's. The default systems are ours: `rapidserve` (the
engine's default policy), `always-fused` (--mode hybrid) and `always-split` (--policy rapid); a bare `vllm` (or
`vllm-best`) is vLLM at each of its settings (compare_systems.VLLM_SETTINGS), the best of which at each bound is the
better vLLM our ratios divide by. `duet@B` (B in ms) is the adaptive policy (--policy duet) started with
`--slo-itl-ms B`, searched at bound B alone (the search stops once B's brackets close), `duet@none` the same without
an SLO, searched unbounded; with any of them the report has the composite row `default (SLO = bound)`, duet@B's
goodput at each bound B, and takes the ratios of it (bench/compare_slo.py). `--budget-s` shares the time left evenly
among the searches still to run (after the later systems' start-ups, each as long as the longest of its kind so far,
else a guess): a search that runs out reports its brackets so far, marked unfinished, and the report says so. One
frontier plot per workload (<name>__<workload>_frontier.png: goodput against the ITL bound, a line per system and
share).

One search is one draw of Poisson arrivals, and its goodput is as noisy as that draw (the same vLLM setting: [30.9,
33.5) req/s one day, [23.4, 25.9) the next). `--search-repeats N` runs each system's search on each workload N times
against the same server (not restarted between them), each repetition a whole search (its closed-loop peak, then at
most --search-max-probes probes) with arrivals and prompts of its own (compare_args.repeat_salt; repetition k of every
system meets the same ones) and its own share of --budget-s (the searches still to run count every repetition). Each
cell of the report is then the median over the repetitions with their spread, `31 (30.9–33.5, n=3)`; a repetition
that did not settle makes the cell a bracket of the median, `[30, 32]* (20–35, n=3, 1 unsettled)`, never a figure
(bench/compare_repeats.py says how the median of brackets is formed); the better vLLM and every ratio are of the
medians; a table per workload and share lists each repetition's own cells; the JSON keeps every repetition's search
(compare_runs/<name>__<system>__<workload>__rep<k>.json has every request) beside the medians; the plot draws the
medians with the spread as error bars. A report continues (--continue-from) or merges (bench/compare_merge.py) only
with reports of the same N.

A search's ceiling is by default its system's own closed-loop peak, which for a server with an ITL SLO (duet@B, vLLM
at a small chunk) understates what it sustains under Poisson arrivals: its cells read `>= own peak`, floors that do
not compare across systems. `--search-shared-ceiling` lets every system's search go up to the highest closed-loop
peak measured so far in the comparison on that workload (its own included; an earlier report's with
--continue-from; run the highest-peak system first, e.g. duet@none or always-fused), `--search-max-rate R` gives
every system one rate instead; probes above a system's own peak fail where their TTFT backlog grew, and
`--search-above-peak-factor F` makes them F x longer (rapidserve/benchmark/sustain.py says why both).

`--search-start-from REPORT.json[,...]` starts each system's search from its brackets in an earlier report (same
label, same workload: bench/compare_prior.py); `--search-peak-from-prior` also reuses the closed-loop peak and median
E2E that earlier search recorded instead of running the closed loop (where it recorded none, the closed loop runs and
the log says why). A peak of another session may be 10-25% off this server's: it moves the start, the ceiling and
which probes count as above the peak. Each frontier's `search` says where its peak came from ("peak_reused_from"),
and so does its `search` column; a report with reused peaks continues and merges with one without.

Every probe starts from an empty server, whose requests in flight ramp up over one request lifetime (Little's law), so
it first sends a warm-up, the larger of `--search-discard` arrivals and those within 1.25 lifetimes (estimated from
the search's own probes, the closed-loop run's before any), and counts only the arrivals released after the lifetime
it measured; a probe left with too few (short) is run once more with a longer warm-up and fails every target if still
short, or where steady state needs more than `--search-max-probe-arrivals N` arrivals (default 1024; the ramp rule,
rapidserve/benchmark/sustain.py). Decode-heavy workloads (1024:256: lifetimes of 5-8 s on an H200) make long probes.

Systems (`--systems`, comma-separated, run one after the other in that order; `--system LABEL=SPEC` adds one):
- a name of SYSTEMS below: `rapidserve serve --model M --port P <--serve-args> <its flags>` as a subprocess;
  `--system LABEL=FLAGS` is one more with your flags. `--tensor-parallel-size N` in --serve-args shards ours and
  vLLM over N GPUs; `disagg-npmd` then runs prefill on N/2 of them and decode on N/2 (bench/compare_tp.py).
- `vllm` or `vllm:FLAGS` (`--system LABEL=vllm:FLAGS`): the real vLLM on `--vllm-model DIR` (a model folder,
  e.g. the Qwen3-8B-shaped one ../shared/peer_vllm/make_model.py writes). Started through serve_vllm.sh
  (`--vllm-serve`; default: shared/peer_vllm/serve_vllm.sh in the repo, ../shared/peer_vllm/serve_vllm.sh,
  .peer/peer_vllm/serve_vllm.sh, the first that exists) as `serve_vllm.sh DIR PORT <flags>` (it starts vLLM in
  its own session, writes <--vllm-run-dir>/vllm_PORT.pid and .log and returns once /health is 200), or
  without one (`--vllm-serve none`) as `python -m vllm.entrypoints.openai.api_server --model DIR
  --load-format dummy --dtype bfloat16 --port P <flags>` with <--vllm-site> on PYTHONPATH. Its flags: the
  ones of --serve-args that vLLM takes under the same name (--max-model-len, --gpu-memory-utilization,
  --max-num-batched-tokens, --max-num-seqs, --enforce-eager), then FLAGS (they win). Prefix caching is
  vLLM's default (on); `vllm:--no-enable-prefix-caching` turns it off. The stop: SIGTERM to vLLM's process
  group, then wait until every process of it has exited (SIGKILL after a minute); its log is appended to
  ours.
- `ext:URL` (`--system LABEL=ext:URL`): a server already running at URL, named by its URL or LABEL; never
  started or stopped.

For each system in turn: start its server (log in <out>/compare_logs/), wait for GET /health = 200 (or, where
/health is 404, GET /v1/models = 200; up to --startup-timeout-s: vLLM takes 2-3 min), run every workload's
sweep with the bench client in this process (`rapidserve.benchmark.run_benchmark`: token-id prompts to
/v1/completions with the model id the server reports on GET /v1/models, a few unrecorded warm-up requests
first), then stop the server and wait for it to exit. A system whose server does not start is recorded as
such and the next one runs. The flags are passed through as given (the servers validate them).
`--dry-run` prints the commands and the workloads' bench flags only.

Workloads: `--workloads` takes IN:OUT (fixed lengths) or any `rapidserve bench --workload` name (the
trace-shaped ones, `multiturn`, ...); `--workload-args "FLAGS"` (repeatable) adds one given as `rapidserve
bench` flags (e.g. `--workload-args "--workload trace --trace t.jsonl"`: whatever `rapidserve bench` accepts);
`--bench-args "FLAGS"` go to every workload. Each run's bench flags are: this script's sweep flags (--rates as
--request-rate, --arrival, --token-range, --num-prompts, --duration-s, --max-concurrency, --seed, --warmup,
--timeout-s), then --bench-args, then the workload's own (later flags win), parsed by `rapidserve bench`'s own
parser (rapidserve/benchmark/cli.py), so a flag added there works here unchanged.

Outputs, in --out (default bench/results): <name>.json (every system's flags and status, each sweep's
per-rate summaries, the table rows, the ratios; a search's frontiers), <name>.md (the tables), <name>.png (a
sweep: one row per workload: output throughput, p99 ITL and p99 TTFT against offered load, a line per system;
a search: the frontier plots above), and each sweep's or search's full bench result (every request) in
<out>/compare_runs/. The JSON and markdown are rewritten after every system
(and on SIGTERM), so a run cut short keeps what finished.

`--peak-fractions 0.25,0.5,0.75,0.9` (with inf in --rates) adds Poisson rates at those fractions of the
reference system's closed peak (`--peak-reference`, default the first system, run first) on each
workload, for every system: e.g. the TTFT of every system at 75% of vLLM's peak, at the same rate. Every
system runs the --rates sweep first, then those rates. Each workload's runs, and the follow-up sweep's, draw
their prompts with their own salt (`SALT_STRIDE`), so that no run meets an earlier run's prompts in a
server's prefix cache (a 4096-token prompt would otherwise start with the 1024-token prompt of the same
index, and a rate re-run would find all of its prompts cached), and every system gets the same prompts and
arrivals at the same rate.

`--continue-from PATH` continues an earlier run's report (its <name>.json) when one run cannot hold every system
(vLLM's start takes 2-3 minutes, and a GPU call 10): the earlier systems' rows, sweeps and reference peaks are
carried into this run's report, and this run's systems run at the same --peak-fractions rates. The two runs must
share the model, --serve-args, workloads, rates, prompts, arrivals, seed, ITL bounds and fractions
(bench/compare_continue.py says what is checked and kept).

The sweep's figures (peak, throughput and goodput at p99 ITL bounds, strict goodput, versus vLLM, versus the
best hybrid) are defined in bench/compare_tables.py's docstring.
GPU time: the servers start once per system (all workloads run on it); keep --num-prompts small, or use
--duration-s for short fixed windows per rate, and --duration-budget-s to stop starting new rates and
systems once the budget is spent (skips are listed).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

# the repo root (rapidserve) and this folder (compare_systems, compare_tables: also when loaded by file path)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Some names below are only re-exported: callers and tests reach them as compare.NAME.
from compare_args import (  # noqa: E402
    NUM_PROMPTS,
    Workload,
    build_parser,
    check_flags,
    parse_workload,  # noqa: F401
    probe_text,
    search_config,
    workload_list,
)
from compare_continue import carried_systems, choose_baseline, choose_reference, load_prior  # noqa: E402
from compare_frontier import write_frontier_report  # noqa: E402
from compare_prior import hints_text, load_searches, peak_for, workload_flags  # noqa: E402
from compare_repeats import REPEATS  # noqa: E402
from compare_run import run_system  # noqa: E402
from compare_search import repeats, system_search  # noqa: E402
from compare_servers import make_server  # noqa: E402
from compare_systems import (  # noqa: E402
    EXT,
    FRONTIER_SYSTEMS,
    RAPIDSERVE,
    SWEEP_SYSTEMS,
    SYSTEMS,  # noqa: F401
    VLLM,
    System,
    find_vllm_serve,
    parse_systems,
    shared_serve_flags,  # noqa: F401
    vllm_baseline,
    vllm_command,  # noqa: F401
)
from compare_tables import (  # noqa: E402
    best_goodput,  # noqa: F401
    best_goodput_p99,  # noqa: F401
    best_under_itl,  # noqa: F401
    peak,  # noqa: F401
    request_goodput,  # noqa: F401
    table_row,  # noqa: F401
    to_markdown,  # noqa: F401
    versus_best_hybrid,  # noqa: F401
    versus_vllm,  # noqa: F401
    vllm_keys,  # noqa: F401
    write_report,
)
from compare_tp import resolve_tp_systems  # noqa: E402

from rapidserve.benchmark.arrivals import rate_label  # noqa: E402
from rapidserve.benchmark.search_flags import SEARCH_NUM_PROMPTS  # noqa: E402
from rapidserve.benchmark.workloads import WORKLOADS  # noqa: E402, F401
from rapidserve.redaction import redact_args, redact_command, redact_text  # noqa: E402

# ---------------------------------------------------------------- main


def select_systems(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[System]:
    """The systems, checked (exits 2 with what is wrong); sets a.vllm_serve_path."""
    names = a.systems if a.systems is not None else ",".join(FRONTIER_SYSTEMS if a.goodput_search else SWEEP_SYSTEMS)
    try:
        systems = parse_systems(names, a.system, search=a.goodput_search)
    except ValueError as e:
        p.error(str(e))
    a.vllm_serve_path = find_vllm_serve(a.vllm_serve)
    if any(s.kind == VLLM for s in systems):
        if not a.vllm_model:
            p.error("a vllm system needs --vllm-model DIR (a model folder, e.g. the one "
                    "../shared/peer_vllm/make_model.py writes)")
        if a.vllm_serve_path and not os.path.isfile(a.vllm_serve_path):
            p.error(f"--vllm-serve {a.vllm_serve_path}: no such file")
    try:
        shlex.split(a.serve_args)
        systems = resolve_tp_systems(systems, a.serve_args)  # disagg-npmd's halves of the TP size
    except ValueError as e:
        p.error(f"--serve-args: {e}" if "disagg" not in str(e) else str(e))
    return systems


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    systems = select_systems(p, a)
    if a.step_traces and not any(s.kind == RAPIDSERVE for s in systems):
        p.error("--step-traces starts rapidserve servers with --step-trace, and none of the systems is one (vLLM "
                "and ext: servers write no step trace): add one of ours, or drop --step-traces")
    labels = [s.label for s in systems]
    try:
        a.search = search_config(a)
        check_flags(a)
        for s in systems if a.search is not None else ():
            system_search(a.search, s)
        a.search_hints, a.search_peaks = load_searches(a.search_start_from) if a.search_start_from else ({}, {})
        workloads = workload_list(a)
        meta = report_meta(a, workloads)
        prior = None if a.continue_from is None else load_prior(a.continue_from, meta)
        carried = [] if prior is None else carried_systems(prior, a.continue_from, labels)
        own = a.vllm_baseline if a.vllm_baseline is None or a.vllm_baseline in labels or prior is None else None
        baseline = choose_baseline(prior, a.vllm_baseline, labels, vllm_baseline(systems, own))
        if a.peak_fractions:
            if math.inf not in a.rates:
                raise ValueError("--peak-fractions needs inf in --rates (the reference's closed peak sets the "
                                 "other rates)")
            a.peak_reference, _ = choose_reference(prior or {}, a.peak_reference, labels)
            systems.sort(key=lambda s: s.label != a.peak_reference)  # the reference runs first
    except ValueError as e:
        p.error(str(e))
    if a.dry_run:
        for s in systems:
            if s.kind == EXT:
                print(f"{s.label}: external server at {redact_text(s.url or '')} (not started)")
            else:
                server = make_server(a, s, a.port or 8000)
                print(f"{s.label}: {redact_command(server.cmd or [])}")
        for w in workloads:
            print(f"workload {w.title}: rapidserve bench {workload_flags(a.bench_args, w.argv)}")
        if repeats(a) > 1:
            print(f"each search runs {repeats(a)} times (--search-repeats), each repetition with its own arrivals")
        for s in systems if a.search_start_from else ():
            for w in workloads:
                hints = a.search_hints.get((s.label, w.title))
                print(f"{s.label} on {w.title}: " + (f"starts from its earlier brackets {hints_text(hints)}" if hints
                                                     else "no earlier brackets: starts from its closed-loop peak"))
                if a.search_peak_from_prior:
                    setup = {"model": a.model, "serve_args": redact_args(a.serve_args),
                             "workload": workload_flags(a.bench_args, w.argv)}
                    print(f"  {peak_for(a.search_peaks, s.label, w.title, setup)[1]}")
        return 0
    os.makedirs(a.out, exist_ok=True)
    deadline = time.monotonic() + a.duration_budget_s if a.duration_budget_s else None
    results: list[dict[str, Any]] = []
    infos: list[dict[str, Any]] = list(carried)
    peaks: dict[str, float | None] = dict(prior["peaks"]) if prior is not None and a.peak_fractions else {}
    meta.update(systems=infos, vllm_baseline=baseline, peak_reference=a.peak_reference, peaks=peaks)
    paths: list[str] = []
    n_prior = len(infos)
    started: dict[str, float] = {}  # the longest start-up of each kind so far: the later searches' reserve
    report = write_frontier_report if a.goodput_search else write_report
    try:
        for s in systems:
            info: dict[str, Any] = {"label": s.label, "kind": s.kind, "flags": redact_text(s.describe())}
            infos.append(info)
            if deadline is not None and time.monotonic() >= deadline:
                info["status"] = "skipped: duration budget spent"
                continue
            later = [x.kind for x in systems[len(infos) - n_prior:]]
            run_system(a, s, workloads, deadline, results, info, peaks, later, started,
                       prior.get("frontiers", []) if prior is not None else [])
            report(a, meta, results, plot=False, prior=prior)
    finally:
        for s in systems[len(infos) - n_prior:]:  # interrupted before their turn
            infos.append({"label": s.label, "kind": s.kind, "flags": redact_text(s.describe()),
                          "status": "not run: the comparison was interrupted"})
        paths = report(a, meta, results, plot=True, prior=prior)
    with open(paths[1]) as f:
        print(f.read(), flush=True)
    print("wrote " + ", ".join(paths), flush=True)
    return 0 if all(i["status"] == "ok" for i in infos[n_prior:]) else 1


def report_meta(a: argparse.Namespace, workloads: Sequence[Workload]) -> dict[str, Any]:
    """The report's header from the flags (`compare_continue.MATCH` among them: what a continuation must share)."""
    probe_n = a.num_prompts or SEARCH_NUM_PROMPTS
    return {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": a.model, "serve_args": redact_args(a.serve_args),  # what is recorded: never a secret
            "rates": ",".join(rate_label(r) for r in a.rates),
            "per_rate": (f"{probe_n} Poisson arrivals per probe" if a.goodput_search
                         else f"{a.duration_s:g} s of arrivals" if a.duration_s
                         else f"{a.num_prompts or NUM_PROMPTS} requests"),
            "mode": "goodput_search" if a.goodput_search else "sweep",
            **({"search_start_from": list(a.search_start_from)} if getattr(a, "search_start_from", None) else {}),
            # not among the `search` settings (compare_continue.MATCH_NEWER): a report whose peaks were reused
            # continues, and merges with, one whose were measured; each frontier's search says which it was
            **({"search_peak_from_prior": True} if getattr(a, "search_peak_from_prior", False) else {}),
            "search": None if a.search is None else {**dataclasses.asdict(a.search),
                                                     **({"shared_ceiling": True} if a.search_shared_ceiling else {}),
                                                     **({REPEATS: repeats(a)} if repeats(a) > 1 else {})},
            "arrival": a.arrival, "seed": a.seed, "vllm_model": a.vllm_model,
            "vllm_serve": getattr(a, "vllm_serve_path", None), "bench_args": redact_args(a.bench_args),
            "peak_fractions": a.peak_fractions, "itl_bounds_ms": a.itl_bounds_ms,
            "workloads": [{"title": w.title, "flags": workload_flags(a.bench_args, w.argv)}
                          for w in workloads],
            **({"probe_text": probe_text(a, workloads)} if a.goodput_search else {})}


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: the running server is stopped and the report written


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(main())
