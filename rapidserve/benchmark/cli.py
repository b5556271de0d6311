"""`rapidserve bench`: load any OpenAI-compatible server, sweep request rates, print vLLM's tables, write results.

    rapidserve bench --base-url http://127.0.0.1:8000 --workload fixed --input-len 4096 --output-len 64 \\
        --request-rate 1,2,4,inf --num-prompts 64 --goodput ttft:2000 itl:100 --label rapid --out-dir out/
    rapidserve bench --dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts 200 \\
        --max-concurrency 32 --save-result --result-dir results/      # a `vllm bench serve` command line
    rapidserve bench --workload trace --trace mooncake_conversation.jsonl.gz --trace-start 600 \\
        --duration-s 300 --time-scale 1,2,4 --trace-overflow clip --goodput itl:100 --out-dir out/
    rapidserve bench --goodput-search --workload fixed --input-len 4096 --output-len 64 --num-prompts 80 \\
        --budget-s 300 --out-dir out/    # goodput at p95 ITL bounds 25/50/100/200 ms and unbounded, q = 90%, 99%

Two goodputs: `--goodput METRIC:MS` adds, to each rate of a sweep, the completed requests per second that
met those bounds at that rate (an SLO-met rate); `--goodput-search` finds goodput as the papers define it,
the highest Poisson rate at which a share of requests meet a p95 ITL bound and the TTFT rule, by searching
the rate (rapidserve/benchmark/goodput.py), instead of a sweep.

What it prints: for each run (a rate of the sweep) a progress bar (stderr; not with --quiet or --disable-tqdm)
and then its "Serving Benchmark Result" table, as `vllm bench serve` prints one (serving_result.py); a search
prints a bar per probe and its goodput table at the end. What it writes: nothing unless asked (save.py):
--out-dir for rapidserve's JSON, markdown and plot, --save-result for vLLM's result JSON. vLLM's flag names
are accepted where ours differ (vllm_flags.py), or refused by name.

Every flag is validated by argparse (exit 2 with what is allowed); flag combinations, a trace file
that cannot be read (or a window with nothing to replay) and a workload that cannot fit the
server's max model length also exit 2, naming the flag; a server that cannot be reached exits 1.
Failed requests do not change the exit code (0): they are counted, with their error text, in the report.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
from typing import Any

from rapidserve.benchmark.arrivals import ARRIVAL_PROCESSES
from rapidserve.benchmark.flags import (
    SlosAction,
    base_url_arg,
    extra_body_arg,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    rates_arg,
    time_scales_arg,
    token_range_arg,
)
from rapidserve.benchmark.save import add_output_args, check_output_flags, save_results
from rapidserve.benchmark.search_flags import SEARCH_NUM_PROMPTS, add_search_args, check_search_flags, search_from_args
from rapidserve.benchmark.serving_result import DEFAULT_METRICS, DEFAULT_PERCENTILES
from rapidserve.benchmark.stats import SLO_METRICS
from rapidserve.benchmark.traces import TRACE_ARRIVALS, TRACE_OVERFLOW, TraceSpec
from rapidserve.benchmark.vllm_flags import add_vllm_args, resolve_vllm_flags
from rapidserve.benchmark.workloads import TRACES, WORKLOADS, WorkloadSpec
from rapidserve.redaction import redact_text

DEFAULT_NUM_PROMPTS = 100
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 1024, 128
NUM_TURNS, TURN_INPUT_LEN = 4, 128  # multiturn's defaults (--num-turns, --turn-input-len)
# --penalties: the three penalties at typical values (all on, so every penalty's work is measured)
PENALTIES: dict[str, float] = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}


TRACE_FLAGS: tuple[tuple[str, str], ...] = (("--trace", "trace"), ("--trace-arrivals", "trace_arrivals"),
                                            ("--time-scale", "time_scale"), ("--trace-start", "trace_start"),
                                            ("--trace-overflow", "trace_overflow"), ("--block-size", "block_size"))


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The bench flags (also used by bench/compare.py for the shared ones)."""
    s = p.add_argument_group("server")
    s.add_argument("--base-url", type=base_url_arg, default=None,
                   help=f"the server's address, without /v1 (default: {DEFAULT_BASE_URL})")
    s.add_argument("--model", default=None, help="model id to ask for (default: the first of GET /v1/models)")
    s.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    s.add_argument("--label", default=None, help="this system's name in reports and plots (default: the model id)")
    s.add_argument("--timeout-s", type=positive_float, default=600.0, help="per request (default: %(default)s)")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="fixed", choices=WORKLOADS,
                   help="fixed lengths, a trace-shaped length distribution (" + ", ".join(TRACES)
                        + "), multiturn conversations, or a trace file replayed (trace: needs --trace; see "
                          "rapidserve/benchmark/workloads.py and replay.py)")
    w.add_argument("--input-len", type=positive_int, default=None,
                   help=f"fixed; multiturn: first turn's prompt (default {DEFAULT_INPUT_LEN})")
    w.add_argument("--output-len", type=positive_int, default=None,
                   help=f"fixed and multiturn (each turn) (default {DEFAULT_OUTPUT_LEN})")
    w.add_argument("--num-turns", type=positive_int, default=NUM_TURNS, help="multiturn")
    w.add_argument("--turn-input-len", type=positive_int, default=TURN_INPUT_LEN,
                   help="multiturn: new tokens per later turn")
    w.add_argument("--token-range", type=token_range_arg, default=(1000, 20000), metavar="LO:HI",
                   help="prompt token ids are drawn from [LO, HI) (default: 1000:20000)")
    w.add_argument("--max-model-len", type=positive_int, default=None,
                   help="clip sampled lengths to it (default: the server's, from /v1/models)")

    t = p.add_argument_group("trace replay (--workload trace)")
    t.add_argument("--trace", default=None, metavar="PATH",
                   help="the trace file: an Azure LLM inference CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or "
                        "Mooncake JSON lines (timestamp ms, input_length, output_length, hash_ids), gzipped or not")
    t.add_argument("--trace-arrivals", default=None, choices=TRACE_ARRIVALS,
                   help="timestamps: the trace's own times, scaled by --time-scale; poisson: the trace's lengths "
                        "at Poisson arrivals of each --request-rate (default: timestamps)")
    t.add_argument("--time-scale", type=time_scales_arg, default=None, metavar="S1,S2,...",
                   help="timestamps arrivals: replay S times as fast (inter-arrival times divided by S; 2 = twice "
                        "the load, 0.5 = half), one run per scale (default: 1)")
    t.add_argument("--trace-start", type=nonneg_float, default=None, metavar="SECONDS",
                   help="the window's start, in seconds of trace time from its first request (default: 0); "
                        "--duration-s is the window's length in trace time, --num-prompts caps the requests")
    t.add_argument("--trace-overflow", default=None, choices=TRACE_OVERFLOW,
                   help="a request longer than the max model length is clipped (output first kept, at most half "
                        "the context) or skipped; counted in the report (default: clip)")
    t.add_argument("--block-size", type=positive_int, default=None,
                   help="the server's KV block size in tokens, for the ideal prefix-cache hit rate (default: 16)")

    a = p.add_argument_group("load")
    a.add_argument("--request-rate", type=rates_arg, default=None, metavar="R1,R2,...",
                   help="requests/s, one run per rate, e.g. 1,2,4,inf (default: inf; not with trace timestamps "
                        "arrivals: --time-scale sets their load)")
    a.add_argument("--arrival", default=None, choices=ARRIVAL_PROCESSES,
                   help="the synthetic workloads' arrival process (default: poisson; a trace: --trace-arrivals)")
    a.add_argument("--num-prompts", type=positive_int, default=None,
                   help=f"requests (multiturn: conversations) per rate (default: {DEFAULT_NUM_PROMPTS}; "
                        "with --duration-s: a cap)")
    a.add_argument("--duration-s", type=positive_float, default=None,
                   help="send the arrivals of this many seconds per rate instead of a count (trace: the window's "
                        "length in seconds of trace time, before --time-scale)")
    a.add_argument("--max-concurrency", type=positive_int, default=None, help="requests in flight at most")
    a.add_argument("--burstiness", type=positive_float, default=None, metavar="B",
                   help="Poisson arrivals' burstiness, as vLLM's: gaps from a gamma distribution of shape B and mean "
                        "1/rate (1: Poisson, the default; < 1 burstier, > 1 more even)")
    a.add_argument("--seed", type=nonneg_int, default=0)
    a.add_argument("--penalties", action="store_true",
                   help="every request also asks for " + ", ".join(f"{k}={v:g}" for k, v in PENALTIES.items())
                        + " (still greedy, still exactly the output length): the cost of penalties, against a "
                        "run without this flag")
    a.add_argument("--extra-body", type=extra_body_arg, default={}, metavar="JSON|@FILE",
                   help="a JSON object merged into every request's body, e.g. a structured-output constraint: "
                        "'{\"structured_outputs\": {\"json\": {...}}}' (or @path to a file holding it)")
    a.add_argument("--warmup", type=nonneg_int, default=None, help="unrecorded requests sent first (default 0)")
    a.add_argument("--goodput", nargs="+", action=SlosAction, default={}, metavar="METRIC:MS",
                   help=f"per-rate SLO goodput: at each rate of the sweep, the completed requests/s meeting these "
                        f"bounds in ms, METRIC one of {', '.join(SLO_METRICS)} (itl: a request's largest inter-token "
                        "gap). Not the papers' goodput: for that, --goodput-search")


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Add `bench` to the `rapidserve` subcommands (`sub` from ArgumentParser.add_subparsers)."""
    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server over a request-rate sweep, or search "
                                     "its goodput (--goodput-search)",
                       description=__doc__.splitlines()[0])
    add_bench_args(p)
    add_search_args(p)
    add_vllm_args(p)
    add_output_args(p)
    p.set_defaults(func=cmd_bench)
    return p


def check_flags_apply(a: argparse.Namespace) -> None:
    """ValueError naming the flags given that the chosen workload would ignore (this parser leaves
    them None when not given): the length flags the workload does not read (`check_length_flags`), the trace flags
    without --workload trace, --arrival with a trace,
    --request-rate with timestamps arrivals, --time-scale with poisson arrivals. `rapidserve bench`
    runs it; bench/compare.py, which sets its sweep flags as defaults, does not."""
    check_length_flags(a)
    given = [flag for flag, dest in TRACE_FLAGS if getattr(a, dest, None) is not None]
    if a.workload != "trace":
        if given:
            raise ValueError(f"{', '.join(given)} only apply to --workload trace (not {a.workload})")
        return
    arrivals = a.trace_arrivals or "timestamps"
    if a.arrival is not None:
        raise ValueError("--arrival is for the synthetic workloads: a trace's arrivals are set by "
                         f"--trace-arrivals {'|'.join(TRACE_ARRIVALS)}")
    if arrivals == "timestamps" and a.request_rate is not None:
        raise ValueError("--request-rate goes with --trace-arrivals poisson: with timestamps arrivals, "
                         "--time-scale sets the load")
    if arrivals == "poisson" and a.time_scale is not None:
        raise ValueError("--time-scale goes with --trace-arrivals timestamps: with poisson arrivals, "
                         "--request-rate sets the load")


# the workloads whose request lengths each flag sets (the others draw theirs from a distribution or a trace)
LENGTH_FLAGS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("--input-len", "input_len", ("fixed", "multiturn")), ("--output-len", "output_len", ("fixed", "multiturn")),
    ("--num-turns", "num_turns", ("multiturn",)), ("--turn-input-len", "turn_input_len", ("multiturn",)))


def check_length_flags(a: argparse.Namespace) -> None:
    """ValueError naming the length flags given (not None, nor the parser's default) that the chosen workload does
    not read: --input-len and --output-len set fixed and multiturn's lengths, --num-turns and --turn-input-len
    multiturn's; a length distribution or a trace draws its own."""
    parser_defaults = {"num_turns": NUM_TURNS, "turn_input_len": TURN_INPUT_LEN}
    unread = [f"{flag} ({' or '.join(workloads)} only)" for flag, dest, workloads in LENGTH_FLAGS
              if a.workload not in workloads and getattr(a, dest, None) not in (None, parser_defaults.get(dest))]
    if unread:
        source = {"trace": "the trace file", "fixed": "--input-len and --output-len alone"}.get(a.workload,
                                                                                           "its length distribution")
        raise ValueError(f"{', '.join(unread)}: not read by --workload {a.workload}, whose request lengths come "
                         f"from {source}; drop {'them' if len(unread) > 1 else 'it'}")


def trace_from_args(a: argparse.Namespace) -> TraceSpec | None:
    """The trace's replay options (None for the other workloads, whose trace flags are ignored)."""
    if a.workload != "trace":
        return None
    if a.trace is None:
        raise ValueError("--workload trace needs --trace PATH (an Azure CSV or Mooncake JSONL trace, gzipped or not)")
    return TraceSpec(path=a.trace, arrivals=a.trace_arrivals or "timestamps", start_s=a.trace_start or 0.0,
                     overflow=a.trace_overflow or "clip", block_size=a.block_size or 16)


def workload_from_args(a: argparse.Namespace) -> WorkloadSpec:
    lo, hi = a.token_range
    spec = WorkloadSpec(name=a.workload, input_len=a.input_len if a.input_len is not None else DEFAULT_INPUT_LEN,
                        output_len=a.output_len if a.output_len is not None else DEFAULT_OUTPUT_LEN,
                        num_turns=a.num_turns,
                        turn_input_len=a.turn_input_len, token_lo=lo, token_hi=hi, max_model_len=a.max_model_len,
                        trace=trace_from_args(a))
    spec.check()
    return spec


def config_from_args(a: argparse.Namespace) -> Any:
    """BenchConfig from parsed flags; ValueError for combinations that cannot work (a trace file is
    read and its window checked here, before any request). Flags the workload does not use are
    ignored here (`check_flags_apply` refuses them on the command line)."""
    from rapidserve.benchmark.replay import build_replay
    from rapidserve.benchmark.runner import BenchConfig

    spec = workload_from_args(a)
    rates = tuple(a.request_rate) if a.request_rate is not None else (math.inf,)
    num = a.num_prompts
    if a.duration_s is None and num is None:
        num = DEFAULT_NUM_PROMPTS
    if spec.trace is not None:
        build_replay(spec, num, a.duration_s)  # the file, its window (the server's context is checked later)
    elif a.duration_s is not None and num is None and any(math.isinf(r) for r in rates):
        raise ValueError("--request-rate inf sends everything at once, so with --duration-s it needs --num-prompts")
    burstiness = getattr(a, "burstiness", None)
    if burstiness is not None and burstiness != 1.0:
        if a.arrival == "fixed":
            raise ValueError("--burstiness shapes Poisson arrivals: --arrival fixed has none")
        if spec.trace is not None and spec.trace.arrivals == "timestamps":
            raise ValueError("--burstiness shapes Poisson arrivals: with a trace, add --trace-arrivals poisson")
        if not math.isfinite(burstiness):
            raise ValueError("--burstiness must be finite: for evenly spaced arrivals use --arrival fixed")
    return BenchConfig(base_url=a.base_url or DEFAULT_BASE_URL, model=a.model, api_key=a.api_key, label=a.label,
                       workload=spec, rates=rates, arrival=a.arrival or "poisson", num_prompts=num,
                       duration_s=a.duration_s, max_concurrency=a.max_concurrency, seed=a.seed,
                       slos_ms=dict(a.goodput), warmup=a.warmup or 0, timeout_s=a.timeout_s,
                       quiet=getattr(a, "quiet", False), burstiness=burstiness or 1.0,
                       percentile_metrics=getattr(a, "percentile_metrics", None) or DEFAULT_METRICS,
                       metric_percentiles=getattr(a, "metric_percentiles", None) or DEFAULT_PERCENTILES,
                       progress=not (getattr(a, "quiet", False) or getattr(a, "disable_tqdm", False)),
                       time_scales=tuple(a.time_scale) if a.time_scale is not None else (1.0,),
                       sampling=dict(PENALTIES) if getattr(a, "penalties", False) else {},
                       extra_body=dict(getattr(a, "extra_body", {}) or {}))


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "bench"


def load_points(a: argparse.Namespace) -> int:
    """How many runs the sweep's flags ask for (rates, or a trace's time scales)."""
    if a.workload == "trace" and (a.trace_arrivals or "timestamps") == "timestamps":
        return len(a.time_scale or (1.0,))
    return len(a.request_rate or (math.inf,))


def check_bench_flags(a: argparse.Namespace) -> None:
    """Every check of the flags before any request (ValueError naming a flag: exit 2)."""
    resolve_vllm_flags(a)
    check_flags_apply(a)
    check_search_flags(a)
    check_output_flags(a, load_points(a))


def cmd_bench(a: argparse.Namespace) -> int:
    import aiohttp

    from rapidserve.benchmark.report import workload_title, write_outputs
    from rapidserve.benchmark.runner import run_benchmark

    check_bench_flags(a)
    if a.goodput_search:
        return cmd_search(a)
    cfg = config_from_args(a)
    try:
        result = asyncio.run(run_benchmark(cfg))
    except (aiohttp.ClientError, ConnectionError, OSError, asyncio.TimeoutError) as e:
        print(redact_text(f"rapidserve bench: error: cannot benchmark {cfg.base_url}: {type(e).__name__}: {e}"),
              file=sys.stderr)
        return 1
    written: list[str] = []
    if a.out_dir is not None:
        name = a.name or safe_name(f"bench_{result['label']}_{workload_title(result['workload'])}")
        written += write_outputs(result, a.out_dir, name, plot=not a.no_plot).values()
    if a.save_result:
        written += dict.fromkeys(save_results(result, a.result_dir, a.result_filename, a.append_result,
                                              a.save_detailed, a.metadata or (), cfg.percentile_metrics,
                                              cfg.metric_percentiles))
    if written and not a.quiet:
        print("wrote " + ", ".join(written), flush=True)
    return 0  # failed requests are in the report, not the exit code


def cmd_search(a: argparse.Namespace) -> int:
    """`rapidserve bench --goodput-search`: the search against one server, its table, and (--out-dir) its JSON,
    markdown and plot."""
    import aiohttp

    from rapidserve.benchmark.goodput_report import search_block, write_search_outputs
    from rapidserve.benchmark.report import workload_title
    from rapidserve.benchmark.search_run import run_goodput_search

    if a.num_prompts is None and a.workload != "trace":
        a.num_prompts = SEARCH_NUM_PROMPTS
    scfg = search_from_args(a)
    cfg = config_from_args(a)
    try:
        result = asyncio.run(run_goodput_search(cfg, scfg))
    except (aiohttp.ClientError, ConnectionError, OSError, asyncio.TimeoutError) as e:
        print(redact_text(f"rapidserve bench: error: cannot search {cfg.base_url}: {type(e).__name__}: {e}"),
              file=sys.stderr)
        return 1
    if not a.quiet:
        print(search_block(result), flush=True)
    if a.out_dir is None:
        return 0
    name = a.name or safe_name(f"bench_{result['label']}_{workload_title(result['workload'])}_goodput")
    paths, note = write_search_outputs(result, a.out_dir, name, plot=not a.no_plot)
    if note:
        print(f"rapidserve bench: no plot: {note}", flush=True)
    if not a.quiet:
        print("wrote " + ", ".join(paths.values()), flush=True)
    return 0
