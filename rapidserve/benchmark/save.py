"""Where `rapidserve bench` writes its results: only where asked, as vLLM's `bench serve` (nothing by default; the
tables are printed either way).

- `--out-dir DIR`: rapidserve's own files, DIR/NAME.json (every request of every run, each run's summary and
  the server's counters), NAME.md (the tables) and NAME.png (the plot, when matplotlib is installed; else one
  line says `pip install rapidserve[bench]`). `--name` and `--no-plot` go with it.
- `--save-result`: what `vllm bench serve --save-result` writes (serving_result.saved_result), one JSON object
  per run of the sweep, each in its own file named as vLLM names it (`<label>-<rate>qps[-concurrency<N>]-
  <model>-<date>.json`), in `--result-dir` (default: the current folder), or in `--result-filename`; with
  `--append-result` each object is appended as a line to the file. `--save-detailed` adds the per-request
  lists; `--metadata KEY=VALUE ...` adds fields. Each of these flags implies `--save-result`. Several rates
  into one `--result-filename` need `--append-result`. A goodput search writes to --out-dir only.
Both may be given: the two formats from the same runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rapidserve.benchmark.report import jsonable
from rapidserve.benchmark.serving_result import (
    DEFAULT_METRICS,
    DEFAULT_PERCENTILES,
    saved_result,
    serving_metrics,
)
from rapidserve.benchmark.serving_result import result_filename as vllm_filename
from rapidserve.benchmark.stats import RequestRecord

SAVE_FLAGS: tuple[tuple[str, str], ...] = (("--save-detailed", "save_detailed"), ("--append-result", "append_result"),
                                           ("--result-dir", "result_dir"), ("--result-filename", "result_filename"),
                                           ("--metadata", "metadata"))


def metadata_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key.strip(), value.strip()


def add_output_args(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("output (nothing is written unless asked: rapidserve/benchmark/save.py)")
    o.add_argument("--out-dir", default=None, help="write NAME.json (every request), NAME.md and NAME.png here")
    o.add_argument("--name", default=None, help="with --out-dir: the file name stem (default: "
                                                "bench_<label>_<workload>, and _goodput with --goodput-search)")
    o.add_argument("--no-plot", action="store_true", help="with --out-dir: no NAME.png")
    o.add_argument("--quiet", action="store_true", help="print nothing but errors (no tables, no progress bars)")
    o.add_argument("--save-result", action="store_true",
                   help="write vllm bench serve's result JSON of each run (its fields, its file name)")
    o.add_argument("--save-detailed", action="store_true",
                   help="with the per-request lists (input_lens, output_lens, ttfts, itls, generated_texts, ...); "
                        "implies --save-result, as do the four below")
    o.add_argument("--append-result", action="store_true", help="append each run's JSON as a line to the file")
    o.add_argument("--result-dir", default=None, help="where --save-result writes (default: the current folder)")
    o.add_argument("--result-filename", default=None, help="the file --save-result writes (default: vLLM's name)")
    o.add_argument("--metadata", type=metadata_arg, nargs="+", default=None, metavar="KEY=VALUE",
                   help="fields added to --save-result's JSON")


def check_output_flags(a: argparse.Namespace, load_points: int) -> None:
    """Turn --save-result on when a flag of it is given; ValueError naming a flag that would write nothing or
    cannot be honoured (`load_points`: the runs of the sweep, rates or time scales)."""
    for flag, dest in (("--name", "name"), ("--no-plot", "no_plot")):
        if getattr(a, dest) and a.out_dir is None:
            raise ValueError(f"{flag} names or leaves out files of --out-dir: give --out-dir DIR too")
    implied = [flag for flag, dest in SAVE_FLAGS if getattr(a, dest)]
    if implied:
        a.save_result = True
    if a.goodput_search and a.save_result:
        given = implied or ["--save-result"]
        raise ValueError(f"{', '.join(given)}: vllm bench serve's result is one run's, and a goodput search has no "
                         "such run: its result goes to --out-dir DIR")
    if a.result_filename and load_points > 1 and not a.append_result:
        raise ValueError(f"--result-filename {a.result_filename} holds one run, and this sweep has {load_points}: "
                         "add --append-result (one JSON line per run) or drop --result-filename (a file per run)")


def save_results(result: Mapping[str, Any], result_dir: str | None = None, result_filename: str | None = None,
                 append: bool = False, detailed: bool = False, metadata: Sequence[tuple[str, str]] = (),
                 metrics: Sequence[str] = DEFAULT_METRICS,
                 percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> list[str]:
    """Write each run of a sweep's result as `vllm bench serve --save-result` would (see the module docstring);
    return the paths written, in run order (a path repeats when runs were appended to one file)."""
    paths: list[str] = []
    cfg = result.get("config", {})
    for run in result.get("runs", []):
        date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        records = [RequestRecord.from_json(r) for r in run["requests"]]
        m = serving_metrics(records, run["summary"], metrics, percentiles)
        doc = saved_result(result, run, m, date, detailed, dict(metadata))
        path = vllm_filename(cfg.get("label"), float(run["rate"]), cfg.get("max_concurrency"), str(result.get("model")),
                         date, result_dir, result_filename)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a+" if append else "w", encoding="utf-8") as f:
            if append and f.tell() != 0:
                f.write("\n")
            json.dump(jsonable(doc), f, allow_nan=False)
        paths.append(path)
    return paths
