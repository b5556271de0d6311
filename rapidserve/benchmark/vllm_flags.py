"""`rapidserve bench` under the flag names of vLLM's `bench serve`, so that a `vllm bench serve` command line runs
here: each vLLM flag is mapped to ours, or refused by name with what to give instead; none is ignored.

| vLLM's flag                                   | here                                                            |
|-----------------------------------------------|-----------------------------------------------------------------|
| --dataset-name random                         | --workload fixed: prompts of random token ids, fixed lengths    |
| --random-input-len N, --random-output-len N   | --input-len N, --output-len N                                   |
| --random-range-ratio 0, --random-prefix-len 0 | their defaults (fixed lengths, no shared prefix); others refused|
| --host H --port P                             | --base-url http://H:P                                           |
| --backend openai or vllm, --endpoint /v1/completions | what is sent anyway (streamed /v1/completions)           |
| --num-warmups N                               | --warmup N                                                      |
| --ignore-eos                                  | always on: each request asks for exactly its output length      |
| --disable-tqdm                                | no progress bars                                                |
| --percentile-metrics, --metric-percentiles    | the printed table's and --save-result's statistics              |
| --save-result, --save-detailed, --append-result, --result-dir, --result-filename, --metadata | save.py |
The same names here and in vLLM: --model, --label, --request-rate (here also a list of rates), --num-prompts
(default 100 here, 1000 in vLLM), --max-concurrency, --burstiness, --seed, --goodput (here also itl:MS),
--extra-body. Refused by name: other --dataset-name values and --dataset-path (the workloads here are
--workload's), --tokenizer (prompts are token ids and token counts come from the server's usage), other
--backend / --endpoint values. Any other vLLM flag is an unrecognized argument (argparse names it).

`resolve_vllm_flags(a)` maps the given vLLM flags onto ours in the parsed namespace, or raises ValueError naming
the flag; where a vLLM flag and ours both say something (--input-len and --random-input-len), they must agree.
"""

from __future__ import annotations

import argparse
from typing import Any

from rapidserve.benchmark.flags import nonneg_float, nonneg_int, positive_int
from rapidserve.benchmark.serving_result import SERVING_METRICS

DATASETS = ("random",)  # vLLM's --dataset-name values generated here
BACKENDS = ("openai", "vllm")  # vLLM's backends that stream /v1/completions, as this client does
ENDPOINT = "/v1/completions"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def metrics_arg(text: str) -> tuple[str, ...]:
    """'ttft,tpot,itl' -> ('ttft', 'tpot', 'itl'): names of SERVING_METRICS, each once, in the order given."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part not in SERVING_METRICS:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not one of {', '.join(SERVING_METRICS)}")
        if part in out:
            raise argparse.ArgumentTypeError(f"{part!r} appears twice in {text!r}")
        out.append(part)
    return tuple(out)


def percentiles_arg(text: str) -> tuple[float, ...]:
    """'50,90,99' -> (50.0, 90.0, 99.0): percentiles in [0, 100], each once, in the order given."""
    out: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            v = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not a number: give percentiles in [0, 100], "
                                             "e.g. 50,90,99") from None
        if not 0 <= v <= 100:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not in [0, 100]")
        if v in out:
            raise argparse.ArgumentTypeError(f"{part!r} appears twice in {text!r}")
        out.append(v)
    return tuple(out)


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    """vLLM `bench serve`'s flag names that differ from ours (the module docstring's table). Each defaults to None,
    so that `resolve_vllm_flags` knows which were given."""
    g = p.add_argument_group("vLLM bench serve's names (rapidserve/benchmark/vllm_flags.py)")
    g.add_argument("--dataset-name", default=None, metavar="NAME",
                   help="random: --workload fixed (random token ids); vLLM's other datasets are refused")
    g.add_argument("--dataset-path", default=None, help=argparse.SUPPRESS)
    g.add_argument("--random-input-len", type=positive_int, default=None, metavar="N", help="--input-len N")
    g.add_argument("--random-output-len", type=positive_int, default=None, metavar="N", help="--output-len N")
    g.add_argument("--random-range-ratio", type=nonneg_float, default=None, metavar="R",
                   help="0 only (fixed lengths)")
    g.add_argument("--random-prefix-len", type=nonneg_int, default=None, metavar="N", help="0 only (no shared prefix)")
    g.add_argument("--host", default=None, help=f"with --port: --base-url http://HOST:PORT (default {DEFAULT_HOST})")
    g.add_argument("--port", type=positive_int, default=None, help=f"with --host (default {DEFAULT_PORT})")
    g.add_argument("--backend", default=None, help=f"{' or '.join(BACKENDS)} (what this client is); others refused")
    g.add_argument("--endpoint", default=None, help=f"{ENDPOINT} only")
    g.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    g.add_argument("--num-warmups", type=nonneg_int, default=None, metavar="N", help="--warmup N")
    g.add_argument("--ignore-eos", action="store_true",
                   help="always on here: every request asks for exactly its output length (ignore_eos, min_tokens)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    g.add_argument("--percentile-metrics", type=metrics_arg, default=None, metavar="M1,M2,...",
                   help="the statistics printed after each run and written by --save-result, of "
                        + ", ".join(SERVING_METRICS) + " (default: ttft,tpot,itl,e2el; the markdown report of "
                        "--out-dir keeps its own mean/median/p90/p99 of all four)")
    g.add_argument("--metric-percentiles", type=percentiles_arg, default=None, metavar="P1,P2,...",
                   help="their percentiles (default: 99)")


def _given(a: argparse.Namespace, name: str) -> Any:
    return getattr(a, name, None)


def _same(a: argparse.Namespace, ours: str, theirs: str, value: Any) -> None:
    """Set ours from vLLM's flag `theirs`, unless ours was given with another value."""
    mine = getattr(a, ours.lstrip("-").replace("-", "_"))
    if mine is not None and mine != value:
        raise ValueError(f"{ours} {mine} and {theirs} {value} disagree: give one of them")
    setattr(a, ours.lstrip("-").replace("-", "_"), value)


def resolve_vllm_flags(a: argparse.Namespace) -> None:
    """Map the vLLM flags given (add_vllm_args) onto ours in `a`; ValueError naming a flag that cannot be honoured
    or that disagrees with ours."""
    ds = _given(a, "dataset_name")
    if ds is not None:
        if ds not in DATASETS:
            raise ValueError(f"--dataset-name {ds}: rapidserve bench generates vLLM's 'random' dataset only (prompts "
                             "of random token ids); its own workloads are --workload fixed, azure-code, azure-conv, "
                             "mooncake, arxiv-summarization, lmsys, multiturn, trace (a trace file: --trace)")
        if a.workload != "fixed":
            raise ValueError(f"--dataset-name random is --workload fixed, not --workload {a.workload}: give one")
    if _given(a, "dataset_path") is not None:
        raise ValueError("--dataset-path: rapidserve bench reads no dataset file; a request trace is replayed with "
                         "--workload trace --trace PATH (Azure CSV or Mooncake JSONL)")
    if _given(a, "tokenizer") is not None:
        raise ValueError("--tokenizer: rapidserve bench uses no tokenizer (its prompts are token ids, and output "
                         "tokens are the server's usage counts): drop it")
    for theirs, ours in (("random_input_len", "--input-len"), ("random_output_len", "--output-len")):
        v = _given(a, theirs)
        if v is not None:
            if a.workload != "fixed":
                raise ValueError(f"--{theirs.replace('_', '-')} is for vLLM's random dataset (--workload fixed), not "
                                 f"--workload {a.workload}: give {ours}")
            _same(a, ours, f"--{theirs.replace('_', '-')}", v)
    for theirs, what in (("random_range_ratio", "fixed lengths"), ("random_prefix_len", "no shared prefix")):
        v = _given(a, theirs)
        if v:
            raise ValueError(f"--{theirs.replace('_', '-')} {v:g}: rapidserve bench's random prompts have {what} "
                             f"(only 0 is accepted); for length distributions use --workload azure-code, azure-conv, "
                             "mooncake, ... and for shared prefixes --workload multiturn or a Mooncake trace")
    host, port = _given(a, "host"), _given(a, "port")
    if host is not None or port is not None:
        if a.base_url is not None:
            raise ValueError("--host/--port and --base-url both name the server: give one")
        a.base_url = f"http://{host or DEFAULT_HOST}:{port or DEFAULT_PORT}"
    backend = _given(a, "backend")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"--backend {backend}: rapidserve bench streams {ENDPOINT} (vLLM's backends "
                         f"{' and '.join(BACKENDS)}); other endpoints are not supported")
    endpoint = _given(a, "endpoint")
    if endpoint is not None and endpoint.rstrip("/") != ENDPOINT:
        raise ValueError(f"--endpoint {endpoint}: rapidserve bench sends {ENDPOINT} requests only")
    if _given(a, "num_warmups") is not None:
        _same(a, "--warmup", "--num-warmups", a.num_warmups)
