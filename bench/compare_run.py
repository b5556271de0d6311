"""One system's run in `bench/compare.py`: start its server, run every workload's sweep (or goodput search) against
it with the bench client in this process, stop it, and record its status, log and results.

Each workload's prompts, and the follow-up sweep's at --peak-fractions rates, are salted apart from every earlier
run's (`compare_args.SALT_STRIDE`); the reference system records its closed peak per workload.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

# the repo root (rapidserve) and this folder (compare_args, compare_systems...: also when loaded by file path)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_args import SALT_STRIDE, Workload, bench_config  # noqa: E402
from compare_peak import closed_peak, fraction_rates, merge_results  # noqa: E402
from compare_search import RUN_ERRORS, workload_searches  # noqa: E402
from compare_servers import _append_log, _tail, free_port, make_server  # noqa: E402
from compare_systems import EXT, RAPIDSERVE, System  # noqa: E402

from rapidserve.benchmark import run_benchmark, write_outputs  # noqa: E402
from rapidserve.benchmark.cli import safe_name  # noqa: E402
from rapidserve.redaction import redact_command, redact_text, scrub_file, secret_values  # noqa: E402


def run_system(a: argparse.Namespace, system: System, workloads: Sequence[Workload], deadline: float | None,
               results: list[dict[str, Any]], info: dict[str, Any], peaks: dict[str, float | None],
               later: Sequence[str] = (), started: dict[str, float] | None = None,
               carried: Sequence[dict[str, Any]] = ()) -> None:
    """Start one system's server, run every workload's sweep (or goodput search), stop it; append results; set
    info's status. With --peak-fractions the reference system records its closed peak per workload in `peaks`.
    `later`: the kinds of the systems still to run after this one (a search leaves their start-up time, as long as
    the longest of their kind measured so far in `started`, which this one's start-up joins). `carried`: an earlier
    report's frontiers (--continue-from), whose peaks join this run's for --search-shared-ceiling."""
    label = system.label
    port = a.port or free_port()
    url = system.url if system.kind == EXT else f"http://127.0.0.1:{port}"
    log_path = os.path.join(a.out, "compare_logs", f"{a.name}__{safe_name(label)}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    trace = (os.path.join(a.out, "compare_logs", f"{a.name}__{safe_name(label)}.steps.jsonl")
             if a.step_traces and system.kind == RAPIDSERVE else None)
    server = make_server(a, system, port, trace)
    info.update(url=redact_text(url), log=log_path, status="ok", **({"step_trace": trace} if trace else {}))
    if server.cmd is not None:  # recorded and printed without its secrets (--api-key K in --serve-args...)
        info["command"] = redact_command(server.cmd)
    print(f"== {label}: {info.get('command') or url}", flush=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        server.start(log)
    try:
        why = server.wait_ready(url, a.startup_timeout_s)
        info["startup_s"] = round(time.monotonic() - t0, 1)
        if started is not None and why is None:
            started[system.kind] = max(started.get(system.kind, 0.0), info["startup_s"])
        if why is not None:
            info["status"] = f"did not start: {why}"
            print(f"   {label}: {info['status']} (see {log_path})", flush=True)
            return
        for wi, w in enumerate(workloads):
            def sweep(rates: Sequence[float], salt: int, w: Workload = w) -> dict[str, Any]:
                cfg = bench_config(a, w.argv, base_url=url, label=label, deadline=deadline, rates=rates)
                return asyncio.run(run_benchmark(dataclasses.replace(cfg, salt_base=salt)))

            # Each workload's prompts, and the follow-up sweep's, are salted apart from every earlier run's,
            # so no run finds another's prompts in a server's prefix cache; every system gets the same
            # prompts and arrivals at the same rate.
            base = SALT_STRIDE * wi
            if a.goodput_search:  # each search (repetition) an even share of the budget left after later start-ups
                err = workload_searches(a, system, url, w, wi, len(workloads), deadline, later, started, results,
                                        [*carried, *results])
                if err is not None:
                    info["status"] = f"error on {w.title}: {err}"
                    print(f"   {label}: {info['status']}", flush=True)
                continue
            try:
                res = sweep(a.rates, base)
                if a.peak_fractions and label == a.peak_reference and w.title not in peaks:
                    peaks[w.title] = closed_peak(res)  # the reference's closed peak sets every system's rates
                extra = fraction_rates(peaks.get(w.title), a.peak_fractions or (), a.rates)
                if extra:
                    res = merge_results(res, sweep(extra, base + len(a.rates)))
            except RUN_ERRORS as e:
                info["status"] = f"error on {w.title}: {e}"
                print(f"   {label}: {info['status']}", flush=True)
                continue
            res["title"] = w.title
            stem, runs_dir = safe_name(f"{a.name}__{label}__{w.title}"), os.path.join(a.out, "compare_runs")
            res["path"] = write_outputs(res, runs_dir, stem, plot=False)["json"]
            results.append(res)
    except (KeyboardInterrupt, SystemExit):
        info["status"] = "interrupted"
        raise
    finally:
        info["exit_code"] = server.stop()
        _append_log(log_path, server.extra_log())
        scrub_file(log_path, secret_values(server.cmd or []))  # a server may echo its argv (vLLM's args line)
        if info["status"] != "ok":
            info["log_tail"] = _tail(log_path)
