"""bench/compare.py's flags: its parser (each flag's value parser in bench/compare_flags.py, the workload shorthand
IN:OUT among them), each workload's BenchConfig through `rapidserve bench`'s own parser, the combinations that would
be ignored, and the goodput search's settings. bench/compare.py's docstring says what they do."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sys
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_flags import (  # noqa: E402
    flags_arg,
    folder_arg,
    fractions_flag,
    itl_bounds_arg,
    parse_workload,
    port_arg,
    repeats_arg,
    start_from_arg,
    stem_arg,
    workload_flags_arg,
    workloads_arg,
)
from compare_prior import workload_flags  # noqa: E402
from compare_systems import (  # noqa: E402
    EXT,
    FRONTIER_SYSTEMS,
    SHARED_SWITCHES,
    SHARED_VALUE_FLAGS,
    SWEEP_SYSTEMS,
    SYSTEMS,
    VLLM,
    VLLM_BEST,
    VLLM_SERVE_CANDIDATES,
    VLLM_SETTINGS,
)

from rapidserve.benchmark.cli import add_bench_args, config_from_args  # noqa: E402
from rapidserve.benchmark.flags import nonneg_int, positive_float, positive_int, rates_arg, token_range_arg  # noqa: E402
from rapidserve.benchmark.report import workload_title  # noqa: E402
from rapidserve.benchmark.runner import BenchConfig  # noqa: E402
from rapidserve.benchmark.search_config import SearchConfig  # noqa: E402
from rapidserve.benchmark.search_flags import (  # noqa: E402
    SEARCH_FLAGS,
    SEARCH_NUM_PROMPTS,
    add_search_args,
    check_search_workload,
    search_from_args,
)
from rapidserve.benchmark.workloads import WORKLOADS  # noqa: E402
from rapidserve.redaction import redact_text  # noqa: E402

DESCRIPTION = "Engine configurations, and the real vLLM, side by side on one GPU: the same load against each."

NUM_PROMPTS = 32  # per rate, unless --num-prompts says otherwise (a trace: no cap)
# The defaults of the sweep-only flags, by identity: main tells a flag given (a new object) from its default, so that
# --goodput-search refuses them by name instead of ignoring them (check_flags).
RATES = (1.0, 2.0, 4.0, 8.0, math.inf)
ITL_BOUNDS_MS = [100.0, 50.0]
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--model", default="preset:qwen3-8b", help="our servers' --model")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated, run in this order: any of {', '.join(SYSTEMS)}; duet@B (the default "
                        "policy with --slo-itl-ms B, searched at bound B alone) or duet@none (no SLO, searched "
                        f"unbounded); {VLLM} or {VLLM}:FLAGS "
                        f"(the real vLLM; with --goodput-search, a bare {VLLM} is {VLLM_BEST}); {VLLM_BEST} (vLLM at "
                        f"each of its settings: {', '.join(repr(f) for f in VLLM_SETTINGS)}); {EXT}:URL (a running "
                        f"server) (default: {','.join(SWEEP_SYSTEMS)}; with --goodput-search "
                        f"{','.join(FRONTIER_SYSTEMS)})")
    p.add_argument("--system", action="append", default=[], metavar="LABEL=SPEC",
                   help="an extra system: LABEL=FLAGS (ours, e.g. 'mine=--mode rapid --partition static:0.75'), "
                        "LABEL=vllm:FLAGS or LABEL=ext:URL (repeatable)")
    p.add_argument("--serve-args", type=flags_arg, default="",
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
                   help="the system the 'vs vLLM' ratios divide by (default: the first vllm system; with "
                        "--continue-from, the earlier report's)")
    w = p.add_argument_group("workloads and load")
    w.add_argument("--workloads", type=workloads_arg, default=None,
                   help="comma-separated IN:OUT or `rapidserve bench --workload` names: " + ", ".join(WORKLOADS)
                        + " (default, without --workload-args: 4096:64,4096:1024)")
    w.add_argument("--workload-args", type=workload_flags_arg, action="append", default=[], metavar="FLAGS",
                   help="one more workload given as `rapidserve bench` flags, e.g. '--workload multiturn "
                        "--num-turns 6' (repeatable)")
    w.add_argument("--bench-args", type=flags_arg, default="", metavar="FLAGS",
                   help="`rapidserve bench` flags for every workload, e.g. '--input-len 2048 --turn-input-len 256 "
                        "--output-len 64 --num-turns 6' (a workload's own flags come after and win)")
    w.add_argument("--rates", type=rates_arg, default=RATES,
                   help="the sweep's request rates, comma-separated, inf a closed loop (default: 1,2,4,8,inf; not "
                        "with --goodput-search, which picks its rates)")
    w.add_argument("--peak-fractions", type=fractions_flag, default=None, metavar="F,F,...",
                   help="also Poisson rates at these fractions of the reference system's closed peak (its req/s at "
                        "rate inf, run first) on each workload, for every system; needs inf in --rates")
    w.add_argument("--peak-reference", default=None, metavar="LABEL",
                   help="the system whose closed peak sets --peak-fractions' rates (default: the first system)")
    w.add_argument("--continue-from", default=None, metavar="PATH",
                   help="an earlier run's <name>.json (same workloads and --serve-args, same GPU): its systems and "
                        "tables are kept in this report and its reference's closed peaks set --peak-fractions' "
                        "rates, so the reference need not run again")
    w.add_argument("--arrival", default="poisson", choices=("poisson", "fixed"))
    w.add_argument("--token-range", type=token_range_arg, default=(1000, 20000), metavar="LO:HI",
                   help="prompt token ids are drawn from [LO, HI) (default: 1000:20000)")
    w.add_argument("--num-prompts", type=positive_int, default=None,
                   help=f"per rate (default: {NUM_PROMPTS}; with --goodput-search, per probe: {SEARCH_NUM_PROMPTS}; "
                        "multiturn: conversations; with --duration-s: a cap; a trace: a cap on its window, none by "
                        "default)")
    w.add_argument("--duration-s", type=positive_float, default=None, help="per-rate window instead of a count")
    w.add_argument("--max-concurrency", type=positive_int, default=None)
    w.add_argument("--warmup", type=nonneg_int, default=2, help="unrecorded requests before each sweep")
    w.add_argument("--seed", type=nonneg_int, default=0)
    w.add_argument("--timeout-s", type=positive_float, default=300.0, help="per request")
    p.add_argument("--itl-bounds-ms", type=itl_bounds_arg, default=ITL_BOUNDS_MS,
                   help="the sweep's p99 ITL bounds, comma-separated, each once (default: 100,50; with "
                        "--goodput-search: --search-itl-bounds-ms instead)")
    p.add_argument("--duration-budget-s", "--budget-s", dest="duration_budget_s", type=positive_float, default=None,
                   help="no new system or rate starts after this many seconds; with --goodput-search each search gets "
                        "a share of what is left and stops when it is spent, reporting its brackets so far "
                        "(unfinished)")
    p.add_argument("--startup-timeout-s", type=positive_float, default=900.0,
                   help="per server (vLLM takes 2-3 min: torch.compile and CUDA graphs)")
    p.add_argument("--port", type=port_arg, default=0, help="server port, 1-65535 (default, 0: a free one)")
    p.add_argument("--step-traces", action="store_true",
                   help="start each rapidserve server with --step-trace "
                        "<out>/compare_logs/<name>__<system>.steps.jsonl (every landed step of its decode "
                        "worker; python bench/step_fit.py reads them)")
    p.add_argument("--out", type=folder_arg,
                   default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--name", type=stem_arg, default="compare", help="the reports' file stem (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the server commands and the workloads and exit")
    add_search_args(p, budget=False)
    p.add_argument("--search-shared-ceiling", action="store_true",
                   help="with --goodput-search: every system's search may go up to the highest closed-loop peak "
                        "measured so far in this comparison (per workload, this system's own and an earlier "
                        "report's with --continue-from included), not only to its own; probes above its own peak "
                        "are judged by their TTFT backlog (and lengthened by --search-above-peak-factor). Run the "
                        "system with the highest peak first (e.g. duet@none or always-fused), or give one rate to "
                        "every system with --search-max-rate instead")
    p.add_argument("--search-start-from", type=start_from_arg, default=None, metavar="REPORT.json[,...]",
                   help="with --goodput-search: start each system's search on each workload where its search in "
                        "these earlier compare.py reports ended (same system label, same workload): the ends of "
                        "each target's bracket are probed first, then bisected (bench/compare_prior.py); the "
                        "closed-loop peak is still measured (unless --search-peak-from-prior)")
    p.add_argument("--search-peak-from-prior", action="store_true",
                   help="with --search-start-from: where the earlier search of the same system on the same workload "
                        "(the report its brackets come from) recorded a closed-loop peak, reuse that peak and its "
                        "closed-loop median E2E (the first probe's lifetime estimate) instead of running the "
                        "closed-loop probe (35-40 s a system on Mooncake's 64 prompts of 11K tokens); where it "
                        "recorded none, the closed loop runs as without the flag and the log says why. The log and "
                        "each search's report say the peak was reused and from which file (peak_reused_from). Risk: "
                        "a peak measured in another session, even on another machine of the same kind, may differ "
                        "by 10-25%%, which moves the search's start and ceiling (its own peak, or "
                        "--search-shared-ceiling's highest) and which probes count as above the peak (judged by "
                        "their TTFT backlog)")
    p.add_argument("--search-repeats", type=repeats_arg, default=None, metavar="N",
                   help="with --goodput-search: run each system's search on each workload N times against the same "
                        "server, each repetition with its own arrivals and prompts; the report gives each cell's "
                        "median over the repetitions and their spread, takes every ratio of the medians and lists "
                        "each repetition's cells (bench/compare_repeats.py); each repetition gets its own share of "
                        "--budget-s and its own --search-max-probes (default 1: one search, as without the flag)")
    return p


class Workload(NamedTuple):
    """One workload of the comparison: its `rapidserve bench` flags and its (unique) title in the tables."""

    argv: tuple[str, ...]
    title: str


class _BenchFlags(argparse.ArgumentParser):
    """`rapidserve bench`'s parser, raising ValueError instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


SALT_STRIDE = 1000  # prompt salts per workload (bench's rate index is added): far more than any sweep's rates


def repeat_salt(workload: int, repetition: int, workloads: int) -> int:
    """The salt base of repetition `repetition` (0, 1, ...: --search-repeats) of a search on workload number `workload`
    of `workloads`: a stride of its own for each (workload, repetition), repetition 0's that of the workload alone
    (as without repetitions), so that no probe of one meets another's prompts or arrivals, and every system's
    repetition k gets the same ones."""
    return SALT_STRIDE * (workload + repetition * workloads)


def bench_config(a: argparse.Namespace, argv: Sequence[str], base_url: str = "http://127.0.0.1:8000",
                 label: str | None = None, deadline: float | None = None,
                 rates: Sequence[float] | None = None) -> BenchConfig:
    """The BenchConfig of one workload's run: this script's sweep flags as defaults, then --bench-args, then
    the workload's flags, through `rapidserve bench`'s own parser and config_from_args. ValueError when the
    flags are wrong."""
    p = _BenchFlags(prog="rapidserve bench", add_help=False)
    add_bench_args(p)
    sweep_rates = tuple(a.rates if rates is None else rates)
    p.set_defaults(request_rate=sweep_rates, arrival=a.arrival,
                   token_range=a.token_range, num_prompts=a.num_prompts, duration_s=a.duration_s,
                   max_concurrency=a.max_concurrency, seed=a.seed, warmup=a.warmup, timeout_s=a.timeout_s)
    ns = p.parse_args([*shlex.split(a.bench_args), *argv])
    # compare.py sets these per system: given among the workload's flags they would be silently replaced
    own = [f for f, v in (("--base-url", ns.base_url), ("--label", ns.label)) if v is not None]
    if own:
        raise ValueError(f"{', '.join(own)}: compare.py sets each system's server URL and label itself; drop "
                         f"{'it' if len(own) == 1 else 'them'} from --bench-args/--workload-args")
    if a.goodput_search:  # as `rapidserve bench --goodput-search` refuses them (search_flags.check_search_flags)
        sweep = [f for f, given in (("--request-rate", ns.request_rate is not sweep_rates),
                                    ("--time-scale", ns.time_scale is not None)) if given]
        if sweep:
            raise ValueError(f"{', '.join(sweep)} {'sets' if len(sweep) == 1 else 'set'} a sweep's load; "
                             "--goodput-search picks the rates itself (each probe sends --num-prompts Poisson "
                             "arrivals): drop it from --bench-args/--workload-args")
    if not a.goodput_search and ns.workload == "trace" and (ns.trace_arrivals or "timestamps") == "timestamps":
        check_timestamps_sweep(a, ns.request_rate is not sweep_rates,
                               rates is not None and tuple(rates) != tuple(a.rates))
    if ns.num_prompts is None and ns.workload != "trace":  # a trace's window sets its count unless capped
        ns.num_prompts = SEARCH_NUM_PROMPTS if a.goodput_search else NUM_PROMPTS
    if a.goodput_search:
        check_search_workload(argparse.Namespace(**{
            **vars(ns), "search_above_peak_factor": getattr(a, "search_above_peak_factor", None),
            "search_max_probe_arrivals": getattr(a, "search_max_probe_arrivals", None),
            "search_trace_probe": getattr(a, "search_trace_probe", None)}))
        if ns.duration_s is not None and ns.workload != "trace":  # a trace's --duration-s is its window
            raise ValueError("--goodput-search sends --num-prompts arrivals per probe: drop --duration-s")
        search = getattr(a, "search", None)  # compare.py's main sets it first (search_config)
        if ns.workload == "trace" and isinstance(search, SearchConfig):  # its probe and window, before any server
            search.check(ns.num_prompts, trace=True, window=ns.num_prompts)
    cfg = config_from_args(ns)
    if not isinstance(cfg, BenchConfig):
        raise ValueError(f"rapidserve bench made a {type(cfg).__name__}, not a BenchConfig")
    return dataclasses.replace(cfg, base_url=base_url, label=label, deadline=deadline)


def check_timestamps_sweep(a: argparse.Namespace, workload_rate: bool, follow_up: bool) -> None:
    """ValueError naming what sets Poisson rates for a trace replayed at its own timestamps, which reads none of them
    (its load is --time-scale): --rates other than compare.py's default, --peak-fractions (`follow_up`: the
    follow-up sweep at those fractions of a peak), a --request-rate among the workload's flags (`workload_rate`), as
    `rapidserve bench` refuses it (benchmark/cli.check_flags_apply)."""
    fractions = follow_up or bool(a.peak_fractions)
    given = [f for f, on in (("--rates", tuple(a.rates) != RATES), ("--peak-fractions", fractions),
                             ("--request-rate", workload_rate)) if on]
    if given:
        raise ValueError(f"{', '.join(given)} set Poisson rates, which a trace replayed at its own timestamps does "
                         "not read (its load is --time-scale): give the workload --trace-arrivals poisson to sweep "
                         f"rates on its requests, or drop {'it' if len(given) == 1 else 'them'}")


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
            raise ValueError(redact_text(f"workload `{workload_flags(a.bench_args, argv)}`: {e}")) from None
        title = base = workload_title(spec.describe())
        k = 1
        while any(w.title == title for w in out):
            k += 1
            title = f"{base} #{k}"
        out.append(Workload(tuple(argv), title))
    return out


def check_flags(a: argparse.Namespace) -> None:
    """ValueError naming a flag that the other flags would make compare.py ignore (after search_config, which
    refuses the sweep's flags with --goodput-search): --peak-reference without --peak-fractions."""
    if a.peak_reference is not None and not a.peak_fractions:
        raise ValueError("--peak-reference names the system whose closed peak sets --peak-fractions' rates: give "
                         "--peak-fractions F,F,... (with inf in --rates) too, or drop --peak-reference")


def search_config(a: argparse.Namespace) -> SearchConfig | None:
    """The goodput search's settings (None without --goodput-search); ValueError for flags that do not go."""
    given = [f for f, v in (("--duration-s", a.duration_s), ("--peak-fractions", a.peak_fractions)) if v is not None]
    # the sweep's --rates and --itl-bounds-ms: given where they are not the default objects (RATES, ITL_BOUNDS_MS)
    given += [f for f, v, default in (("--rates", a.rates, RATES), ("--itl-bounds-ms", a.itl_bounds_ms, ITL_BOUNDS_MS))
              if v is not default]
    shared = getattr(a, "search_shared_ceiling", False)
    if not a.goodput_search:
        search_flags = [f for f, _ in SEARCH_FLAGS if getattr(a, f[2:].replace("-", "_")) is not None]
        search_flags += ["--search-shared-ceiling"] if shared else []
        search_flags += ["--search-repeats"] if getattr(a, "search_repeats", None) is not None else []
        search_flags += ["--search-start-from"] if getattr(a, "search_start_from", None) is not None else []
        search_flags += ["--search-peak-from-prior"] if getattr(a, "search_peak_from_prior", False) else []
        if search_flags:
            raise ValueError(f"{', '.join(search_flags)} only apply with --goodput-search")
        return None
    if given:
        raise ValueError(f"{', '.join(given)} belong to a sweep; --goodput-search sends --num-prompts Poisson "
                         "arrivals per probe at the rates it picks" + (" (its ITL bounds: --search-itl-bounds-ms)"
                                                                       if "--itl-bounds-ms" in given else ""))
    cfg = search_from_args(a, shared_ceiling=shared)
    if shared and cfg.max_rate is not None:
        raise ValueError("--search-shared-ceiling takes the ceiling from the systems' peaks, --search-max-rate gives "
                         "one: drop one of them")
    if shared and cfg.start_rate is not None:
        raise ValueError("--search-shared-ceiling needs each system's closed-loop peak, which --search-start-rate "
                         "skips measuring: drop one of them")
    if getattr(a, "search_peak_from_prior", False):
        if getattr(a, "search_start_from", None) is None:
            raise ValueError("--search-peak-from-prior reuses the closed-loop peaks of --search-start-from's "
                             "reports: give --search-start-from REPORT.json[,...] too")
        if cfg.start_rate is not None:
            raise ValueError("--search-peak-from-prior reuses each system's closed-loop peak to start its search "
                             "from, and --search-start-rate starts every search without one: drop one of them")
    if cfg.max_probes >= SALT_STRIDE:
        raise ValueError(f"--search-max-probes {cfg.max_probes}: at most {SALT_STRIDE - 1} (each probe's prompts are "
                         "salted apart within a workload's stride)")
    return cfg


def probe_text(a: argparse.Namespace, workloads: Sequence[Workload]) -> str:
    """What a probe of the search sends, for the report's header: `per_rate` (in compare_continue.MATCH, so kept as
    it was) says "N Poisson arrivals per probe" with N the --num-prompts, which on a trace is the window the probes
    draw from, not a probe (--search-trace-probe's arrivals, else the whole window)."""
    probe_n = a.num_prompts or SEARCH_NUM_PROMPTS
    traces = sum(1 for w in workloads if _is_trace(w.argv))
    fixed = f"{probe_n} Poisson arrivals per probe"
    if not traces:
        return fixed
    trace_probe = getattr(a.search, "trace_probe", None)
    each = (f"the first {trace_probe} requests of its window per probe (more where the ramp rule or a probe above "
            "the peak asks)" if trace_probe is not None else "its whole window per probe")
    on_traces = f"on a trace (its requests at Poisson arrivals of the probe's rate) {each}"
    return on_traces if traces == len(workloads) else f"{fixed}; {on_traces}"


def _is_trace(argv: Sequence[str]) -> bool:
    """Whether a workload's `rapidserve bench` flags replay a trace (`--workload trace` or `--workload=trace`)."""
    pairs = zip(argv, [*argv[1:], ""], strict=True)
    return any(x == "--workload=trace" or (x == "--workload" and nxt == "trace") for x, nxt in pairs)
