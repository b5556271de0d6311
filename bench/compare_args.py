"""bench/compare.py's flags: its parser, and the workload shorthand (IN:OUT or a bench workload name).
bench/compare.py's docstring says what they do."""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_peak import fractions_arg  # noqa: E402
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

from rapidserve.benchmark.cli import (  # noqa: E402
    nonneg_int,
    positive_float,
    positive_int,
    rates_arg,
    token_range_arg,
)
from rapidserve.benchmark.search_flags import SEARCH_NUM_PROMPTS, add_search_args  # noqa: E402
from rapidserve.benchmark.workloads import WORKLOADS  # noqa: E402

DESCRIPTION = "Engine configurations, and the real vLLM, side by side on one GPU: the same load against each."

NUM_PROMPTS = 32  # per rate, unless --num-prompts says otherwise (a trace: no cap)


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--model", default="preset:qwen3-8b", help="our servers' --model")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated, run in this order: any of {', '.join(SYSTEMS)}; {VLLM} or {VLLM}:FLAGS "
                        f"(the real vLLM; with --goodput-search, a bare {VLLM} is {VLLM_BEST}); {VLLM_BEST} (vLLM at "
                        f"each of its settings: {', '.join(repr(f) for f in VLLM_SETTINGS)}); {EXT}:URL (a running "
                        f"server) (default: {','.join(SWEEP_SYSTEMS)}; with --goodput-search "
                        f"{','.join(FRONTIER_SYSTEMS)})")
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
                   help="the system the 'vs vLLM' ratios divide by (default: the first vllm system; with "
                        "--continue-from, the earlier report's)")
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
    w.add_argument("--peak-fractions", type=_fractions, default=None, metavar="F,F,...",
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
    p.add_argument("--itl-bounds-ms", type=lambda t: [positive_float(x) for x in t.split(",")], default=[100.0, 50.0],
                   help="the sweep's p99 ITL bounds (with --goodput-search: --search-itl-bounds-ms)")
    p.add_argument("--duration-budget-s", "--budget-s", dest="duration_budget_s", type=positive_float, default=None,
                   help="no new system or rate starts after this many seconds; with --goodput-search each search gets "
                        "a share of what is left and stops when it is spent, reporting its brackets so far "
                        "(unfinished)")
    p.add_argument("--startup-timeout-s", type=positive_float, default=900.0,
                   help="per server (vLLM takes 2-3 min: torch.compile and CUDA graphs)")
    p.add_argument("--port", type=nonneg_int, default=0, help="server port (default: a free one)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--name", default="compare")
    p.add_argument("--dry-run", action="store_true", help="print the server commands and the workloads and exit")
    add_search_args(p, budget=False)
    return p


def _fractions(text: str) -> tuple[float, ...]:
    try:
        return fractions_arg(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
