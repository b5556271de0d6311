"""CUDA-event timing shared by the bench scripts; imports nothing of rapidserve (so a script that must run
without the engine's dependencies, e.g. bench/experiments/2026-11/pdl_probe.py, can use it)."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch


def time_ms(fn: Callable[[], object], reps: int, warmup: int = 3, behind: bool = False,
            idle_s: float = 0.0) -> list[float]:
    """Milliseconds of each of `reps` calls of fn (CUDA events around each), after `warmup` calls; `behind`: each
    timed call right behind an untimed one (back_to_back_ms); `idle_s`: the device left idle that long before each
    timed call (a power-limited GPU raises its clocks while idle: bench/gemm_duty_cycle.py)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        if idle_s > 0:
            torch.cuda.synchronize()
            time.sleep(idle_s)
        if behind:
            fn()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return out


def back_to_back_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> list[float]:
    """Milliseconds of the device's work of each of `reps` calls of fn, each timed right behind an untimed call with
    nothing waited for between them: its start event fires when the call before it ends on the device, so where the
    host prepares a call faster than the device runs the one before (the engine's steps, launched one ahead), its
    host work (inputs, launches) is not counted, as it is not in the engine's step times."""
    return time_ms(fn, reps, warmup, behind=True)


def run_record(script: str, **fields: object) -> dict[str, object]:
    """A GPU bench run's record: the GPU, torch, the date (UTC) and `python bench/<script> <its arguments>`, then
    `fields`."""
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": f"python bench/{script} " + " ".join(sys.argv[1:]), **fields}


def write_md(out: str, stem: str, title: str, res: dict[str, object], table: Sequence[str]) -> str:
    """<out>/<stem>.md: `title` with the run record's GPU and date, its command, then the `table` lines; printed too
    (a bench script's table comes last). Its path."""
    lines = [f"# {title}, {res['gpu']} ({res['date']})", "", f"`{res['command']}`", "", *table]
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{stem}.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path


def write_json(out: str, stem: str, res: object) -> str:
    """`res` as <out>/<stem>.json (the folder made); its path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{stem}.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=2)
    return path
