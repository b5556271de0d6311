"""Engine configurations, and the real vLLM, side by side on one GPU: the same request-rate sweep against each.

    python bench/compare.py --model preset:qwen3-8b --systems rapid-adaptive,hybrid-2048 \\
        --workloads 4096:64,4096:1024 --rates 1,2,4,8,inf --num-prompts 32 --duration-budget-s 2400
    python bench/compare.py --systems vllm,rapid-adaptive,hybrid-2048 --vllm-model /root/peermodel \\
        --serve-args "--max-model-len 8192 --gpu-memory-utilization 0.8" --workloads multiturn \\
        --bench-args "--input-len 2048 --turn-input-len 256 --output-len 64 --num-turns 6" --rates inf

Systems (`--systems`, comma-separated, run one after the other in that order; `--system LABEL=SPEC` adds one):
- a name of SYSTEMS below: `rapidserve serve --model M --port P <--serve-args> <its flags>` as a subprocess;
  `--system LABEL=FLAGS` is one more with your flags.
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
per-rate summaries, the table rows, the ratios), <name>.md (the tables), <name>.png (one row per workload:
output throughput, p99 ITL and p99 TTFT against offered load, a line per system), and each sweep's full
bench result (every request) in <out>/compare_runs/. The JSON and markdown are rewritten after every system
(and on SIGTERM), so a run cut short keeps what finished.

Definitions (per system and workload, over the rates of its sweep):
- peak throughput: the highest output tokens/s of any rate (with that rate's requests/s, TTFT p50 and p99,
  and p99 ITL).
- throughput at p99 ITL <= B ms: the highest output tokens/s among the rates whose p99 ITL (over every
  token of every request at that rate) is <= B and where no request failed; with that rate and its
  p99 TTFT. "-" when no rate meets it. Reported for B = 100 and 50 (--itl-bounds-ms).
- goodput at p99 ITL <= B ms: the highest, over the rates whose p99 ITL is <= B with no failures, of
  completed requests per second whose TTFT was <= 1 s per 1K prompt tokens (RAPID-Serve's TTFT
  rule): the load a system carries while its token stream keeps the p99 bound.
- strict goodput at B ms (per request): the highest, over the rates, of completed requests per second
  whose every inter-token gap was <= B ms and whose TTFT met the same rule (one slow gap in a
  request's stream disqualifies it).
- versus vLLM (when a vLLM system ran; --vllm-baseline picks another system as the reference): each
  system's figure divided by vLLM's on the same workload: requests/s, output tokens/s, TTFT p50 and p99
  (each at the system's peak rate: with one rate, e.g. `--rates inf`, the same load for all; a TTFT ratio
  below 1 is faster than vLLM), goodput and strict goodput at each ITL bound.
- versus the best hybrid: each non-hybrid system's figures divided by the highest any `hybrid*`
  system reached on the same workload (the issue's targets: goodput >= 1.5x, peak >= 0.9x).
GPU time: the servers start once per system (all workloads run on it); keep --num-prompts small, or use
--duration-s for short fixed windows per rate, and --duration-budget-s to stop starting new rates and
systems once the budget is spent (skips are listed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import IO, Any, NamedTuple, NoReturn

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rapidserve.benchmark import BenchConfig, run_benchmark, write_outputs  # noqa: E402
from rapidserve.benchmark.arrivals import rate_label  # noqa: E402
from rapidserve.benchmark.cli import (  # noqa: E402
    add_bench_args,
    base_url_arg,
    config_from_args,
    nonneg_int,
    positive_float,
    positive_int,
    rates_arg,
    safe_name,
    token_range_arg,
)
from rapidserve.benchmark.plot import plot_sweeps  # noqa: E402
from rapidserve.benchmark.report import fmt, jsonable, workload_title  # noqa: E402
from rapidserve.benchmark.stats import RequestRecord, meets_rapid_ttft, meets_slos  # noqa: E402
from rapidserve.benchmark.workloads import WORKLOADS  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SYSTEMS: dict[str, str] = {
    "rapid-adaptive": "--mode rapid --partition adaptive",
    "rapid-adaptive-slo100": "--mode rapid --partition adaptive --slo-itl-ms 100",
    "rapid-overallocated": "--mode rapid --partition off",
    "rapid-static-0.25": "--mode rapid --partition static:0.25",
    "rapid-static-0.5": "--mode rapid --partition static:0.5",
    "hybrid-512": "--mode hybrid --max-num-batched-tokens 512",
    "hybrid-2048": "--mode hybrid --max-num-batched-tokens 2048",
    "hybrid-8192": "--mode hybrid --max-num-batched-tokens 8192",
}

RAPIDSERVE, VLLM, EXT = "rapidserve", "vllm", "ext"
NUM_PROMPTS = 32  # per rate, unless --num-prompts says otherwise (a trace: no cap)
# Flags of `rapidserve serve` that vLLM's server takes under the same name and meaning: given in
# --serve-args, a vLLM system gets them too.
SHARED_VALUE_FLAGS: tuple[str, ...] = ("--max-model-len", "--gpu-memory-utilization", "--max-num-batched-tokens",
                                       "--max-num-seqs")
SHARED_SWITCHES: tuple[str, ...] = ("--enforce-eager",)
# Where serve_vllm.sh is looked for (relative to the repo root) when --vllm-serve is not given. The
# ../shared folder does not travel to the GPU machine: bench/vs_vllm.sh's header says how the recipe gets there.
VLLM_SERVE_CANDIDATES: tuple[str, ...] = ("shared/peer_vllm/serve_vllm.sh", "../shared/peer_vllm/serve_vllm.sh",
                                          ".peer/peer_vllm/serve_vllm.sh")
# What serve_vllm.sh sets, for a vLLM started without it.
VLLM_ENV: dict[str, str] = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                            "HF_HUB_OFFLINE": "1"}


# ---------------------------------------------------------------- systems and workloads (pure)


class System(NamedTuple):
    """One column of the comparison: our server with `flags`, vLLM with `flags`, or an external `url`."""

    label: str
    kind: str  # RAPIDSERVE, VLLM or EXT
    flags: str = ""  # rapidserve: `rapidserve serve` flags; vllm: vLLM flags after the shared ones
    url: str = ""  # ext only

    def describe(self) -> str:
        if self.kind == VLLM:
            return f"vLLM {self.flags}".strip()
        if self.kind == EXT:
            return f"external server at {self.url}"
        return self.flags


def special_system(text: str, label: str | None = None) -> System | None:
    """`vllm`, `vllm:FLAGS` or `ext:URL` as a System (labelled `label`, else by the text, an ext by its URL);
    None for any other text. ValueError for unbalanced quotes in FLAGS or a URL that is not http(s)://."""
    t = text.strip()
    if t == VLLM or t.startswith(VLLM + ":"):
        flags = t[len(VLLM) + 1:].strip()
        shlex.split(flags)
        return System(label or (VLLM if not flags else f"{VLLM}:{flags}"), VLLM, flags)
    if t.startswith(EXT + ":"):
        try:
            url = base_url_arg(t[len(EXT) + 1:].strip())
        except argparse.ArgumentTypeError as e:
            raise ValueError(str(e)) from None
        return System(label or url, EXT, url=url)
    return None


def parse_systems(names: str, extra: Sequence[str]) -> list[System]:
    """--systems (comma-separated: SYSTEMS names, vllm, vllm:FLAGS, ext:URL) then each --system LABEL=SPEC
    (SPEC: vllm, vllm:FLAGS, ext:URL or rapidserve flags). ValueError saying what is wrong."""
    chosen: list[System] = []
    for n in (s.strip() for s in names.split(",")):
        if not n:
            continue
        s = special_system(n)
        if s is None:
            if n not in SYSTEMS:
                raise ValueError(f"--systems: unknown {n}; known: {', '.join(SYSTEMS)}, {VLLM}, {VLLM}:FLAGS, "
                                 f"{EXT}:URL")
            s = System(n, RAPIDSERVE, SYSTEMS[n])
        chosen.append(s)
    for item in extra:
        label, sep, spec = item.partition("=")
        if not sep or not label.strip():
            raise ValueError(f"--system {item!r}: expected LABEL=FLAGS (or LABEL=vllm:FLAGS, LABEL=ext:URL)")
        s = special_system(spec, label.strip())
        if s is None:
            shlex.split(spec)
            s = System(label.strip(), RAPIDSERVE, spec.strip())
        chosen.append(s)
    if not chosen:
        raise ValueError("no systems selected")
    seen: set[str] = set()
    for s in chosen:
        if s.label in seen:
            raise ValueError(f"two systems are labelled {s.label!r}: give one a label with --system LABEL=SPEC")
        seen.add(s.label)
    return chosen


def vllm_baseline(systems: Sequence[System], given: str | None) -> str | None:
    """The label the vs-vLLM ratios divide by: `given` (must be a system's), else the first vLLM system's."""
    if given is not None:
        if given not in {s.label for s in systems}:
            labels = ", ".join(s.label for s in systems)
            raise ValueError(f"--vllm-baseline {given!r} is none of the systems ({labels})")
        return given
    return next((s.label for s in systems if s.kind == VLLM), None)


def shared_serve_flags(serve_args: str) -> list[str]:
    """The flags of `serve_args` (ours) that vLLM's server takes under the same name, in their order
    (`--flag value` and `--flag=value`; the switches as they are)."""
    toks = shlex.split(serve_args)
    out: list[str] = []
    i = 0
    while i < len(toks):
        name, eq, value = toks[i].partition("=")
        if name in SHARED_VALUE_FLAGS and eq:
            out += [name, value]
        elif name in SHARED_VALUE_FLAGS and i + 1 < len(toks):
            out += [name, toks[i + 1]]
            i += 1
        elif toks[i] in SHARED_SWITCHES:
            out.append(toks[i])
        i += 1
    return out


def vllm_command(model_dir: str, port: int, serve_args: str, flags: str, serve_script: str | None,
                 python: str = sys.executable) -> list[str]:
    """How a vLLM system is started: through serve_vllm.sh when there is one, else vLLM's OpenAI server
    module directly (dummy weights in bf16, as the script does; `flags` can override both)."""
    vflags = [*shared_serve_flags(serve_args), *shlex.split(flags)]
    if serve_script:
        return ["bash", serve_script, model_dir, str(port), *vflags]
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--load-format", "dummy",
            "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port), *vflags]


def serve_command(model: str, port: int, serve_args: str, flags: str) -> list[str]:
    return [sys.executable, "-m", "rapidserve.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), *shlex.split(serve_args), *shlex.split(flags)]


def find_vllm_serve(given: str | None, root: str = REPO) -> str | None:
    """serve_vllm.sh's path: `given` ('none' or '': launch vLLM directly), else the first candidate that exists."""
    if given is not None:
        return None if given.strip().lower() in ("", "none") else given
    for rel in VLLM_SERVE_CANDIDATES:
        path = os.path.normpath(os.path.join(root, rel))
        if os.path.isfile(path):
            return path
    return None


def parse_workload(text: str) -> list[str]:
    """'4096:64' (fixed input:output) or a `rapidserve bench --workload` name, as bench flags."""
    t = text.strip()
    if t in WORKLOADS:
        return ["--workload", t]
    parts = t.split(":")
    if len(parts) == 2 and all(p.strip().isdigit() and int(p) > 0 for p in parts):
        return ["--workload", "fixed", "--input-len", parts[0].strip(), "--output-len", parts[1].strip()]
    raise argparse.ArgumentTypeError(f"{text!r} is not IN:OUT (positive token counts, e.g. 4096:64) or one of "
                                     f"{', '.join(WORKLOADS)} (or give its flags with --workload-args)")


class Workload(NamedTuple):
    """One workload of the comparison: its `rapidserve bench` flags and its (unique) title in the tables."""

    argv: tuple[str, ...]
    title: str


class _BenchFlags(argparse.ArgumentParser):
    """`rapidserve bench`'s parser, raising ValueError instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def bench_config(a: argparse.Namespace, argv: Sequence[str], base_url: str = "http://127.0.0.1:8000",
                 label: str | None = None, deadline: float | None = None) -> BenchConfig:
    """The BenchConfig of one workload's run: this script's sweep flags as defaults, then --bench-args, then
    the workload's flags, through `rapidserve bench`'s own parser and config_from_args. ValueError when the
    flags are wrong."""
    p = _BenchFlags(prog="rapidserve bench", add_help=False)
    add_bench_args(p)
    p.set_defaults(request_rate=tuple(a.rates), arrival=a.arrival, token_range=a.token_range,
                   num_prompts=a.num_prompts, duration_s=a.duration_s, max_concurrency=a.max_concurrency,
                   seed=a.seed, warmup=a.warmup, timeout_s=a.timeout_s)
    ns = p.parse_args([*shlex.split(a.bench_args), *argv])
    if ns.num_prompts is None and ns.workload != "trace":  # a trace's window sets its count unless capped
        ns.num_prompts = NUM_PROMPTS
    cfg = config_from_args(ns)
    if not isinstance(cfg, BenchConfig):
        raise ValueError(f"rapidserve bench made a {type(cfg).__name__}, not a BenchConfig")
    return dataclasses.replace(cfg, base_url=base_url, label=label, deadline=deadline)


def workload_list(a: argparse.Namespace) -> list[Workload]:
    """--workloads then --workload-args (default 4096:64 and 4096:1024), checked by the bench parser, each
    titled as the bench report titles it (' #2', ... where two would share a title)."""
    argvs = [*(a.workloads or []), *(shlex.split(w) for w in a.workload_args)]
    if not argvs:
        argvs = [parse_workload("4096:64"), parse_workload("4096:1024")]
    out: list[Workload] = []
    for argv in argvs:
        try:
            spec = bench_config(a, argv).workload
        except ValueError as e:
            raise ValueError(f"workload `{shlex.join([*shlex.split(a.bench_args), *argv])}`: {e}") from None
        title = base = workload_title(spec.describe())
        k = 1
        while any(w.title == title for w in out):
            k += 1
            title = f"{base} #{k}"
        out.append(Workload(tuple(argv), title))
    return out


# ---------------------------------------------------------------- the table's numbers (pure)


def _stat(summary: Mapping[str, Any], key: str, stat: str = "p99") -> float | None:
    v = (summary.get(key) or {}).get(stat)
    return float(v) if isinstance(v, (int, float)) else None


def _p99(summary: Mapping[str, Any], key: str) -> float | None:
    return _stat(summary, key, "p99")


def _point(run: Mapping[str, Any]) -> dict[str, Any]:
    s = run["summary"]
    return {"rate": run["rate"], "output_throughput": s["output_throughput"],
            "request_throughput": s["request_throughput"], "p99_itl_ms": _p99(s, "itl_ms"),
            "p50_ttft_ms": _stat(s, "ttft_ms", "median"), "p99_ttft_ms": _p99(s, "ttft_ms")}


def peak(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The rate with the highest output throughput."""
    done = [r for r in runs if r["summary"]["completed"]]
    return _point(max(done, key=lambda r: r["summary"]["output_throughput"])) if done else None


def within_itl(runs: Sequence[Mapping[str, Any]], bound_ms: float) -> list[Mapping[str, Any]]:
    """The rates with completions, no failures and p99 ITL <= bound_ms."""
    return [r for r in runs if r["summary"]["completed"] and not r["summary"]["failed"]
            and (p := _p99(r["summary"], "itl_ms")) is not None and p <= bound_ms]


def best_under_itl(runs: Sequence[Mapping[str, Any]], bound_ms: float) -> dict[str, Any] | None:
    """The highest output throughput among rates with no failures and p99 ITL <= bound_ms."""
    ok = within_itl(runs, bound_ms)
    return _point(max(ok, key=lambda r: r["summary"]["output_throughput"])) if ok else None


def request_goodput(run: Mapping[str, Any], itl_bound_ms: float | None = None) -> float:
    """Requests/s of one rate that completed with the RAPID TTFT rule met and, given a bound, every
    ITL within it."""
    dur = run["summary"]["duration_s"]
    slos = {} if itl_bound_ms is None else {"itl": itl_bound_ms}
    recs = [RequestRecord.from_json(r) for r in run.get("requests", [])]
    good = sum(1 for r in recs if meets_slos(r, slos) and meets_rapid_ttft(r))
    return good / dur if dur > 0 else 0.0


def best_goodput_p99(runs: Sequence[Mapping[str, Any]], itl_bound_ms: float) -> dict[str, Any] | None:
    """The most TTFT-rule requests/s among the rates whose p99 ITL is within the bound (no failures)."""
    ok = within_itl(runs, itl_bound_ms)
    if not ok:
        return None
    g, rate = max(((request_goodput(r), r["rate"]) for r in ok), key=lambda x: x[0])
    return {"goodput": g, "rate": rate}


def best_goodput(runs: Sequence[Mapping[str, Any]], itl_bound_ms: float) -> dict[str, Any] | None:
    scored = [(request_goodput(r, itl_bound_ms), r["rate"]) for r in runs]
    if not scored:
        return None
    g, rate = max(scored, key=lambda x: x[0])
    return {"goodput": g, "rate": rate}


def table_row(label: str, result: Mapping[str, Any], bounds_ms: Sequence[float]) -> dict[str, Any]:
    runs = result.get("runs", [])
    row: dict[str, Any] = {"system": label,
                           "workload": result.get("title") or workload_title(result.get("workload", {})),
                           "peak": peak(runs)}
    for b in bounds_ms:
        row[f"itl_le_{b:g}ms"] = best_under_itl(runs, b)
        row[f"goodput_p99_itl_le_{b:g}ms"] = best_goodput_p99(runs, b)
        row[f"goodput_itl_le_{b:g}ms"] = best_goodput(runs, b)
    row["skipped_rates"] = list(result.get("skipped_rates", []))
    return row


def ratio_keys(bounds_ms: Sequence[float]) -> list[str]:
    p99 = [f"goodput_p99_itl_le_{b:g}ms" for b in bounds_ms]
    return ["peak", *p99, *(f"goodput_itl_le_{b:g}ms" for b in bounds_ms)]


def versus_best_hybrid(rows: Sequence[Mapping[str, Any]], bounds_ms: Sequence[float]) -> list[dict[str, Any]]:
    """Per workload and non-hybrid system: its peak and goodputs over the best hybrid's (None: no hybrid
    figure, or the hybrid's is 0)."""
    def value(r: Mapping[str, Any], key: str) -> float | None:
        v = r.get(key)
        if v is None:
            return None
        return float(v["output_throughput"] if key == "peak" else v["goodput"])

    keys = ratio_keys(bounds_ms)
    out: list[dict[str, Any]] = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == w]
        hybrids = [r for r in mine if str(r["system"]).startswith("hybrid")]
        if not hybrids:
            continue
        best = {k: max((v for r in hybrids if (v := value(r, k)) is not None), default=None) for k in keys}
        for r in mine:
            if r in hybrids:
                continue
            ratios: dict[str, Any] = {"system": r["system"], "workload": w}
            for k in keys:
                v, b = value(r, k), best[k]
                ratios[k] = None if v is None or not b else v / b
            out.append(ratios)
    return out


def vllm_keys(bounds_ms: Sequence[float]) -> list[str]:
    """The figures the vs-vLLM ratios are taken of, in the table's order."""
    return ["request_throughput", "output_throughput", "ttft_p50_ms", "ttft_p99_ms",
            *(f"goodput_p99_itl_le_{b:g}ms" for b in bounds_ms), *(f"goodput_itl_le_{b:g}ms" for b in bounds_ms)]


def row_figures(row: Mapping[str, Any], bounds_ms: Sequence[float]) -> dict[str, float | None]:
    """A table row's figures by vllm_keys: requests/s, output tokens/s and TTFT p50 / p99 at its peak rate,
    goodput and strict goodput at each ITL bound (None where the row has none)."""
    pk = row.get("peak") or {}
    out: dict[str, float | None] = {"request_throughput": pk.get("request_throughput"),
                                    "output_throughput": pk.get("output_throughput"),
                                    "ttft_p50_ms": pk.get("p50_ttft_ms"), "ttft_p99_ms": pk.get("p99_ttft_ms")}
    for b in bounds_ms:
        for k in (f"goodput_p99_itl_le_{b:g}ms", f"goodput_itl_le_{b:g}ms"):
            g = row.get(k)
            out[k] = None if g is None else g.get("goodput")
    return {k: (None if v is None else float(v)) for k, v in out.items()}


def versus_vllm(rows: Sequence[Mapping[str, Any]], bounds_ms: Sequence[float],
                baseline: str | None) -> list[dict[str, Any]]:
    """Per workload and system other than `baseline` (vLLM's label): each figure of row_figures divided by
    the baseline's on the same workload (None: either figure missing, or the baseline's is 0). Empty when
    there is no baseline; a workload the baseline has no row for is left out."""
    if baseline is None:
        return []
    keys = vllm_keys(bounds_ms)
    out: list[dict[str, Any]] = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == w]
        base = next((r for r in mine if r["system"] == baseline), None)
        if base is None:
            continue
        bf = row_figures(base, bounds_ms)
        for r in mine:
            if r is base:
                continue
            f = row_figures(r, bounds_ms)
            ratios: dict[str, Any] = {"system": r["system"], "workload": w, "baseline": baseline}
            for k in keys:
                v, b = f[k], bf[k]
                ratios[k] = None if v is None or not b else v / b
            out.append(ratios)
    return out


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def to_markdown(rows: Sequence[Mapping[str, Any]], bounds_ms: Sequence[float], meta: Mapping[str, Any]) -> str:
    def at(p: Mapping[str, Any] | None) -> str:
        return "-" if p is None else f"{fmt(p['output_throughput'], '.0f')} @ {rate_label(float(p['rate']))}"

    def num(p: Mapping[str, Any] | None, key: str, spec: str = ".0f") -> str:
        return "-" if p is None else fmt(p.get(key), spec)

    def gp(g: Mapping[str, Any] | None) -> str:
        return "-" if g is None else f"{fmt(g['goodput'], '.2f')} @ {rate_label(float(g['rate']))}"

    baseline = meta.get("vllm_baseline")
    head = ["system", "peak out tok/s @ rate", "req/s at peak", "TTFT p50 at peak (ms)", "p99 TTFT at peak (ms)",
            "p99 ITL at peak (ms)"]
    for b in bounds_ms:
        head += [f"out tok/s @ rate, p99 ITL <= {b:g} ms", "p99 TTFT there (ms)",
                 f"goodput, p99 ITL <= {b:g} ms (req/s)", f"strict goodput, every gap <= {b:g} ms (req/s)"]
    lines = [f"# rapidserve compare: {meta.get('model')}", "",
             f"- {meta.get('created')}; serve args: `{meta.get('serve_args') or '(none)'}`",
             f"- sweep: rates {meta.get('rates')}, {meta.get('per_rate')} per rate, arrivals {meta.get('arrival')}, "
             f"seed {meta.get('seed')}",
             "- definitions: bench/compare.py's docstring (p99 ITL over all tokens of a rate; goodput: TTFT-rule "
             "requests/s at the best rate within the p99 ITL bound; strict goodput: requests with every gap within "
             "the bound and TTFT <= 1 s per 1K prompt tokens)", ""]
    for s in meta.get("systems", []):
        lines.append(f"- {s['label']}: `{s['flags']}` - {s['status']}")
    for w in meta.get("workloads", []):
        lines.append(f"- workload {w['title']}: `rapidserve bench {w['flags']}`")
    vs_vllm = versus_vllm(rows, bounds_ms, baseline)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    for w in workloads:
        lines += ["", f"## {w}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for r in (r for r in rows if r["workload"] == w):
            pk = r["peak"]
            cells = [r["system"], at(pk), num(pk, "request_throughput", ".2f"), num(pk, "p50_ttft_ms"),
                     num(pk, "p99_ttft_ms"), num(pk, "p99_itl_ms", ".1f")]
            for b in bounds_ms:
                p = r[f"itl_le_{b:g}ms"]
                cells += [at(p), num(p, "p99_ttft_ms"), gp(r[f"goodput_p99_itl_le_{b:g}ms"]),
                          gp(r[f"goodput_itl_le_{b:g}ms"])]
            lines.append("| " + " | ".join(cells) + " |")
        vs = [x for x in vs_vllm if x["workload"] == w]
        if vs:
            vhead = ["system", "req/s vs vLLM", "out tok/s vs vLLM", "TTFT p50 vs vLLM", "TTFT p99 vs vLLM"] + \
                [f"goodput p99 ITL <= {b:g} ms vs vLLM" for b in bounds_ms] + \
                [f"strict <= {b:g} ms vs vLLM" for b in bounds_ms]
            lines += ["", f"Versus vLLM (`{baseline}`) on this workload: each figure over vLLM's (requests/s, output "
                      "tokens/s and TTFT at each system's peak rate: a TTFT ratio below 1 is faster than vLLM; "
                      "goodputs at each ITL bound):", "", "| " + " | ".join(vhead) + " |", "|---" * len(vhead) + "|"]
            for x in vs:
                lines.append("| " + " | ".join([x["system"], *(_x(x[k]) for k in vllm_keys(bounds_ms))]) + " |")
        ratios = [x for x in versus_best_hybrid(rows, bounds_ms) if x["workload"] == w]
        if ratios:
            rhead = ["system", "peak"] + [f"goodput p99 <= {b:g} ms" for b in bounds_ms] + \
                [f"strict <= {b:g} ms" for b in bounds_ms]
            lines += ["", "Versus the best hybrid on this workload (ratio of each figure to the highest any hybrid "
                      "budget reached):", "", "| " + " | ".join(rhead) + " |", "|---" * len(rhead) + "|"]
            keys = ratio_keys(bounds_ms)
            for x in ratios:
                lines.append("| " + " | ".join([x["system"]] + [_x(x[k]) for k in keys]) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def probe(url: str) -> bool:
    """GET /health answers 200 (or, on a server without /health (404), GET /v1/models does)."""
    for path in ("/health", "/v1/models"):
        try:
            with urllib.request.urlopen(url + path, timeout=5) as r:
                return bool(r.status == 200)
        except urllib.error.HTTPError as e:
            if e.code != 404:
                return False
        except (urllib.error.URLError, OSError, ValueError):
            return False
    return False


def wait_healthy(proc: subprocess.Popen[bytes] | None, url: str, timeout_s: float) -> str | None:
    """None once the server answers (see probe); else why not (the process exited, or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return f"the server exited with code {proc.returncode} before it was healthy"
        if probe(url):
            return None
        time.sleep(1.0)
    return f"not healthy after {timeout_s:g} s"


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 120.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def group_alive(pgid: int) -> bool:
    """Whether a process of process group `pgid` is still running (zombies count as gone)."""
    if os.path.isdir("/proc/self"):
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()  # state, ppid, pgrp, ...
            if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int, grace_s: float = 60.0) -> None:
    """SIGTERM process group `pgid` (a server and its workers), wait until none of it runs; SIGKILL what
    is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            if not group_alive(pgid):
                return
            time.sleep(0.25)


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class Server:
    """A system's server: `start` (log to an open file), `wait_ready`, `stop` (its exit code where known).
    This base is an external server: never started nor stopped, only probed."""

    cmd: list[str] | None = None

    def start(self, log: IO[bytes]) -> None:
        pass

    def wait_ready(self, url: str, timeout_s: float) -> str | None:
        why = wait_healthy(None, url, min(timeout_s, 30.0))
        return None if why is None else f"the external server does not answer: {why}"

    def stop(self) -> int | None:
        return None

    def extra_log(self) -> str | None:
        """A log the server wrote elsewhere, to append to ours after the stop."""
        return None


class ChildServer(Server):
    """A server this script runs as its child: rapidserve (SIGTERM to it, which stops its workers) or vLLM
    launched directly (its own session: SIGTERM to the whole group, vLLM's engine processes included)."""

    def __init__(self, cmd: list[str], env: Mapping[str, str] | None = None, own_group: bool = False) -> None:
        self.cmd, self.argv, self.env, self.own_group = cmd, cmd, env, own_group
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, log: IO[bytes]) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     env=None if self.env is None else dict(self.env), start_new_session=self.own_group)

    def wait_ready(self, url: str, timeout_s: float) -> str | None:
        return wait_healthy(self.proc, url, timeout_s)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if not self.own_group:
            return stop_server(self.proc)
        stop_group(self.proc.pid)
        return self.proc.wait()


class ScriptVllm(Server):
    """vLLM through serve_vllm.sh: the script starts vLLM in a session of its own (pid in
    <run_dir>/vllm_PORT.pid, log in <run_dir>/vllm_PORT.log) and exits 0 once /health is 200."""

    def __init__(self, cmd: list[str], port: int, run_dir: str) -> None:
        self.cmd = self.argv = cmd
        self.pid_file = os.path.join(run_dir, f"vllm_{port}.pid")
        self.log_file = os.path.join(run_dir, f"vllm_{port}.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, log: IO[bytes]) -> None:
        with contextlib.suppress(OSError):
            os.remove(self.pid_file)  # an older run's: never end a process this run did not start
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, url: str, timeout_s: float) -> str | None:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return f"serve_vllm.sh did not return in {timeout_s:g} s"
        if rc != 0:
            return f"serve_vllm.sh exited with code {rc}"
        why = wait_healthy(None, url, 30.0)
        return None if why is None else f"serve_vllm.sh returned but vLLM is {why}"

    def server_pid(self) -> int | None:
        try:
            with open(self.pid_file) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def stop(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        pid = self.server_pid()
        if pid is None:
            return None
        try:
            leader = os.getpgid(pid) == pid  # setsid made it its group's leader
        except ProcessLookupError:
            return None
        if leader:
            stop_group(pid)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        return None

    def extra_log(self) -> str | None:
        return self.log_file


def make_server(a: argparse.Namespace, system: System, port: int) -> Server:
    if system.kind == EXT:
        return Server()
    if system.kind == RAPIDSERVE:
        return ChildServer(serve_command(a.model, port, a.serve_args, system.flags))
    cmd = vllm_command(a.vllm_model, port, a.serve_args, system.flags, a.vllm_serve_path)
    if a.vllm_serve_path:
        return ScriptVllm(cmd, port, a.vllm_run_dir)
    env = {**os.environ, **VLLM_ENV}
    if a.vllm_site and os.path.isdir(a.vllm_site):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (a.vllm_site, os.environ.get("PYTHONPATH")) if p)
    return ChildServer(cmd, env, own_group=True)


def _append_log(log_path: str, other: str | None, limit: int = 4 << 20) -> None:
    if not other or not os.path.isfile(other):
        return
    with open(log_path, "ab") as log:
        log.write(f"\n---- {other} (the server's own log) ----\n".encode())
        log.write(_tail(other, limit).encode())


def run_system(a: argparse.Namespace, system: System, workloads: Sequence[Workload], deadline: float | None,
               results: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """Start one system's server, run every workload's sweep, stop it; append results; set info's status."""
    label = system.label
    port = a.port or free_port()
    url = system.url if system.kind == EXT else f"http://127.0.0.1:{port}"
    log_path = os.path.join(a.out, "compare_logs", f"{a.name}__{safe_name(label)}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    server = make_server(a, system, port)
    info.update(url=url, log=log_path, status="ok")
    if server.cmd is not None:
        info["command"] = shlex.join(server.cmd)
    print(f"== {label}: {info.get('command') or url}", flush=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        server.start(log)
    try:
        why = server.wait_ready(url, a.startup_timeout_s)
        info["startup_s"] = round(time.monotonic() - t0, 1)
        if why is not None:
            info["status"] = f"did not start: {why}"
            print(f"   {label}: {info['status']} (see {log_path})", flush=True)
            return
        for w in workloads:
            try:
                cfg = bench_config(a, w.argv, base_url=url, label=label, deadline=deadline)
                res = asyncio.run(run_benchmark(cfg))
            except (ValueError, ConnectionError, OSError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                info["status"] = f"error on {w.title}: {e}"
                print(f"   {label}: {info['status']}", flush=True)
                continue
            res["title"] = w.title
            stem = safe_name(f"{a.name}__{label}__{w.title}")
            res["path"] = write_outputs(res, os.path.join(a.out, "compare_runs"), stem, plot=False)["json"]
            results.append(res)
    except (KeyboardInterrupt, SystemExit):
        info["status"] = "interrupted"
        raise
    finally:
        info["exit_code"] = server.stop()
        _append_log(log_path, server.extra_log())
        if info["status"] != "ok":
            info["log_tail"] = _tail(log_path)


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="preset:qwen3-8b", help="our servers' --model")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, run in this order: any of {', '.join(SYSTEMS)}; {VLLM} or {VLLM}:FLAGS "
                        f"(the real vLLM); {EXT}:URL (a running server) (default: all of ours)")
    p.add_argument("--system", action="append", default=[], metavar="LABEL=SPEC",
                   help="an extra system: LABEL=FLAGS (ours, e.g. 'mine=--mode rapid --partition static:0.75'), "
                        "LABEL=vllm:FLAGS or LABEL=ext:URL (repeatable)")
    p.add_argument("--serve-args", default="",
                   help="flags every server of ours gets, e.g. '--max-model-len 8192 --gpu-memory-utilization 0.8'; "
                        f"vLLM gets those of {', '.join(SHARED_VALUE_FLAGS + SHARED_SWITCHES)}")
    v = p.add_argument_group("vLLM systems")
    v.add_argument("--vllm-model", default=None, metavar="DIR",
                   help="the model folder vLLM serves (e.g. /root/peermodel from ../shared/peer_vllm/make_model.py)")
    v.add_argument("--vllm-serve", default=None, metavar="PATH",
                   help="serve_vllm.sh, or 'none' to start vLLM's server module directly (default: the first of "
                        f"{', '.join(VLLM_SERVE_CANDIDATES)} under the repo root that exists, else none)")
    v.add_argument("--vllm-run-dir", default="/root",
                   help="where serve_vllm.sh writes vllm_PORT.pid and vllm_PORT.log (default: %(default)s)")
    v.add_argument("--vllm-site", default="/root/peersite",
                   help="without serve_vllm.sh: put this folder (vLLM installed with pip --target) first on "
                        "PYTHONPATH when it exists (default: %(default)s)")
    v.add_argument("--vllm-baseline", default=None, metavar="LABEL",
                   help="the system the 'vs vLLM' ratios divide by (default: the first vllm system)")
    w = p.add_argument_group("workloads and load")
    w.add_argument("--workloads", type=lambda t: [parse_workload(x) for x in t.split(",") if x.strip()], default=None,
                   help="comma-separated IN:OUT or `rapidserve bench --workload` names: " + ", ".join(WORKLOADS)
                        + " (default, without --workload-args: 4096:64,4096:1024)")
    w.add_argument("--workload-args", action="append", default=[], metavar="FLAGS",
                   help="one more workload given as `rapidserve bench` flags, e.g. '--workload multiturn "
                        "--num-turns 6' (repeatable)")
    w.add_argument("--bench-args", default="", metavar="FLAGS",
                   help="`rapidserve bench` flags for every workload, e.g. '--input-len 2048 --turn-input-len 256 "
                        "--output-len 64 --num-turns 6' (a workload's own flags come after and win)")
    w.add_argument("--rates", type=rates_arg, default=(1.0, 2.0, 4.0, 8.0, math.inf))
    w.add_argument("--arrival", default="poisson", choices=("poisson", "fixed"))
    w.add_argument("--token-range", type=token_range_arg, default=(1000, 20000), metavar="LO:HI",
                   help="prompt token ids are drawn from [LO, HI) (default: 1000:20000)")
    w.add_argument("--num-prompts", type=positive_int, default=None,
                   help=f"per rate (default: {NUM_PROMPTS}; multiturn: conversations; with --duration-s: a cap; "
                        "a trace: a cap on its window, none by default)")
    w.add_argument("--duration-s", type=positive_float, default=None, help="per-rate window instead of a count")
    w.add_argument("--max-concurrency", type=positive_int, default=None)
    w.add_argument("--warmup", type=nonneg_int, default=2, help="unrecorded requests before each sweep")
    w.add_argument("--seed", type=nonneg_int, default=0)
    w.add_argument("--timeout-s", type=positive_float, default=300.0, help="per request")
    p.add_argument("--itl-bounds-ms", type=lambda t: [positive_float(x) for x in t.split(",")], default=[100.0, 50.0])
    p.add_argument("--duration-budget-s", type=positive_float, default=None,
                   help="no new system or rate starts after this many seconds")
    p.add_argument("--startup-timeout-s", type=positive_float, default=900.0,
                   help="per server (vLLM takes 2-3 min: torch.compile and CUDA graphs)")
    p.add_argument("--port", type=nonneg_int, default=0, help="server port (default: a free one)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--name", default="compare")
    p.add_argument("--dry-run", action="store_true", help="print the server commands and the workloads and exit")
    return p


def select_systems(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[System]:
    """The systems, checked (exits 2 with what is wrong); sets a.vllm_serve_path."""
    try:
        systems = parse_systems(a.systems or "", a.system)
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
    except ValueError as e:
        p.error(f"--serve-args: {e}")
    return systems


def write_report(a: argparse.Namespace, meta: dict[str, Any], results: Sequence[Mapping[str, Any]],
                 plot: bool) -> list[str]:
    """<name>.json and <name>.md (and, when `plot`, <name>.png) from the results so far; their paths."""
    rows = [table_row(r["label"], r, a.itl_bounds_ms) for r in results]
    base = os.path.join(a.out, a.name)
    sweeps = [{"label": r["label"], "workload": r["workload"], "title": r.get("title"), "path": r.get("path"),
               "skipped_rates": r.get("skipped_rates", []),
               "runs": [{"rate": x["rate"], "summary": x["summary"]} for x in r["runs"]]} for r in results]
    with open(base + ".json", "w") as f:
        json.dump(jsonable({**meta, "itl_bounds_ms": a.itl_bounds_ms, "rows": rows,
                            "versus_vllm": versus_vllm(rows, a.itl_bounds_ms, meta.get("vllm_baseline")),
                            "versus_best_hybrid": versus_best_hybrid(rows, a.itl_bounds_ms), "sweeps": sweeps}),
                  f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(to_markdown(rows, a.itl_bounds_ms, meta))
    paths = [base + ".json", base + ".md"]
    if plot and results:
        plot_sweeps(list(results), base + ".png", title=f"{a.model}: systems against offered load",
                    itl_bounds_ms=a.itl_bounds_ms)
        paths.append(base + ".png")
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    systems = select_systems(p, a)
    try:
        workloads = workload_list(a)
        baseline = vllm_baseline(systems, a.vllm_baseline)
    except ValueError as e:
        p.error(str(e))
    if a.dry_run:
        for s in systems:
            if s.kind == EXT:
                print(f"{s.label}: external server at {s.url} (not started)")
            else:
                server = make_server(a, s, a.port or 8000)
                print(f"{s.label}: {shlex.join(server.cmd or [])}")
        for w in workloads:
            print(f"workload {w.title}: rapidserve bench {shlex.join([*shlex.split(a.bench_args), *w.argv])}")
        return 0
    os.makedirs(a.out, exist_ok=True)
    deadline = time.monotonic() + a.duration_budget_s if a.duration_budget_s else None
    results: list[dict[str, Any]] = []
    infos: list[dict[str, Any]] = []
    meta = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": a.model, "serve_args": a.serve_args, "rates": ",".join(rate_label(r) for r in a.rates),
            "per_rate": (f"{a.duration_s:g} s of arrivals" if a.duration_s
                         else f"{a.num_prompts or NUM_PROMPTS} requests"),
            "arrival": a.arrival, "seed": a.seed, "systems": infos, "vllm_baseline": baseline,
            "vllm_model": a.vllm_model, "vllm_serve": a.vllm_serve_path, "bench_args": a.bench_args,
            "workloads": [{"title": w.title, "flags": shlex.join([*shlex.split(a.bench_args), *w.argv])}
                          for w in workloads]}
    paths: list[str] = []
    try:
        for s in systems:
            info: dict[str, Any] = {"label": s.label, "kind": s.kind, "flags": s.describe()}
            infos.append(info)
            if deadline is not None and time.monotonic() >= deadline:
                info["status"] = "skipped: duration budget spent"
                continue
            run_system(a, s, workloads, deadline, results, info)
            write_report(a, meta, results, plot=False)
    finally:
        for s in systems[len(infos):]:  # interrupted before their turn
            infos.append({"label": s.label, "kind": s.kind, "flags": s.describe(),
                          "status": "not run: the comparison was interrupted"})
        paths = write_report(a, meta, results, plot=True)
    with open(paths[1]) as f:
        print(f.read(), flush=True)
    print("wrote " + ", ".join(paths), flush=True)
    return 0 if all(i["status"] == "ok" for i in infos) else 1


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: the running server is stopped and the report written


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(main())
