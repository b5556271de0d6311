"""KV capacity at one memory share: the tokens the GPU pool holds per KV dtype, and where the rest of the share goes.

    python bench/kv_capacity.py [--model preset:qwen3-8b] [--quantization none|fp8] [--kv-dtypes auto,fp8]
                                [--gpu-memory-utilization 0.8] [--max-model-len 8192] [--step-processes 2]
                                [--peak-breakdown] [--out DIR]

For each KV dtype it builds the model runner alone in this process (weights loaded, the pool sized as the decode
worker sizes it: runner/kv_budget.py), reads the pool's blocks and the budget's terms, and frees it before the next.
Issue 39's "fp8 KV cache: tokens of KV capacity 2x bf16's at the same memory" is the `vs first` column of the fp8
row. Beside a served engine's start-up line ("KV cache: N blocks") it also says what the server's other processes
cost: the runner here is alone on the GPU, the server's decode worker is not (the API server and the prefill worker
may hold CUDA contexts by then). The 2026-12-01 H200 run that asked for it: Llama-3.1-70B fp8 got 37.13 GiB of KV
served, vLLM 41.59 GiB, at 0.8.
--peak-breakdown records the allocator's history while the first KV dtype's runner is built and lists the source
lines whose tensors are alive at the profiled step's activation peak (bench/memory_peak.py): the budget keeps that
peak once per process running full steps (`--step-processes`, 2 as rapid mode serves), so it is KV lost twice.
Writes <out>/kv_capacity.json and .md with --out; prints the table last. Needs a GPU (the CPU test covers `row`
and `table`).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from table_out import write_table_files  # noqa: E402

from rapidserve.runner.kv_budget import GIB, KVBudget  # noqa: E402

KV_DTYPES = ("auto", "fp8")


def row(kv_dtype: str, blocks: int, block_size: int, pool_bytes: int, budget: KVBudget | None) -> dict[str, Any]:
    """One table row: the pool and, where the runner sized it from the GPU, the budget's terms in GiB."""
    r: dict[str, Any] = {"kv_dtype": kv_dtype, "blocks": blocks, "tokens": blocks * block_size,
                         "pool_gib": round(pool_bytes / GIB, 2)}
    if budget is not None:
        r.update(total_gib=round(budget.total / GIB, 2), in_use_gib=round(budget.engine_used / GIB, 2),
                 not_charged_gib=round(budget.baseline_used / GIB, 2), step_processes=budget.step_processes,
                 tensors_gib=round(budget.torch_allocated / GIB, 2),
                 cache_gib=round(max(0, budget.torch_reserved - budget.torch_allocated) / GIB, 2),
                 outside_torch_gib=round(budget.outside_torch / GIB, 2),
                 step_peak_gib=round(budget.step_peak / GIB, 2), logits_floor_gib=round(budget.logits_floor / GIB, 2))
    return r


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: a row per KV dtype; `vs first`: its tokens over the first row's."""
    cols = ["kv_dtype", "blocks", "tokens", "vs first", "pool_gib", "in_use_gib", "tensors_gib", "cache_gib",
            "outside_torch_gib", "step_peak_gib", "step_processes", "logits_floor_gib", "not_charged_gib"]
    out = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    first = rows[0]["tokens"] if rows else 0
    for r in rows:
        cells = {**r, "vs first": f"{r['tokens'] / first:.2f}x" if first else "-"}
        out.append("| " + " | ".join(f"{cells[c]:,}" if isinstance(cells.get(c), int) else str(cells.get(c, "-"))
                                     for c in cols) + " |")
    return "\n".join(out)


def measure(model: str, quantization: str, kv_dtype: str, util: float, max_len: int,
            step_processes: int = 2, breakdown: bool = False) -> dict[str, Any]:
    """One row; `breakdown`: with the sites alive at the profiled step's peak (bench/memory_peak.py) under
    "peak_sites" and the table under "peak_table"."""
    import contextlib

    import torch
    from memory_peak import peak_sites, record
    from memory_peak import table as peak_table
    from model_runner import engine_config, preset_source

    from rapidserve.loader.presets import preset_config
    from rapidserve.runner import ModelRunner

    name = model.removeprefix("preset:")
    mcfg = preset_config(name)
    cfg = engine_config(name, mcfg, "bfloat16", (512,), max_len, util,  # 512 seats: the server's default cap
                        fp8=quantization == "fp8", kv_cache_dtype=kv_dtype)
    trace: list[Any] = []
    with record() if breakdown else contextlib.nullcontext():
        runner = ModelRunner(cfg, preset_source(name, mcfg, "cuda", torch.bfloat16), show_progress=False,
                             step_processes=step_processes)
        if breakdown:
            trace = torch.cuda.memory._snapshot()["device_traces"][runner.device.index or 0]
    pool = runner.kv_pool.tensor
    r = row(kv_dtype, runner.kv_pool.num_blocks, runner.block_size, pool.numel() * pool.element_size(),
            runner.kv_budget)
    if breakdown:
        peak, sites = peak_sites(trace, "_gpu_kv_budget", skip=("kv_pool.py:allocate",))
        r["peak_sites"] = [{"where": x.where, "bytes": x.bytes, "blocks": x.blocks} for x in sites]
        r["peak_table"] = peak_table(peak, sites)
    del runner, pool
    gc.collect()
    torch.cuda.empty_cache()
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:qwen3-8b", help="a preset (preset:NAME): random weights of its shape")
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none")
    ap.add_argument("--kv-dtypes", default=",".join(KV_DTYPES),
                    help=f"comma-separated, each one of {', '.join(KV_DTYPES)} (the first is the `vs first` base)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--step-processes", type=int, choices=(1, 2), default=2,
                    help="processes keeping a full step's activations: 2 as rapid mode serves (its prefill worker "
                         "too), 1 as --mode hybrid and LLM")
    ap.add_argument("--peak-breakdown", action="store_true",
                    help="for the first KV dtype, record the allocator's history and list the source lines whose "
                         "tensors are alive at the profiled step's activation peak (bench/memory_peak.py)")
    ap.add_argument("--out", type=Path, default=None, help="folder for kv_capacity.json and .md")
    a = ap.parse_args(argv)
    kinds = [k.strip() for k in a.kv_dtypes.split(",") if k.strip()]
    if not kinds or any(k not in KV_DTYPES for k in kinds):
        ap.error(f"--kv-dtypes: give some of {', '.join(KV_DTYPES)}, comma-separated; got {a.kv_dtypes!r}")
    if not 0 < a.gpu_memory_utilization <= 1:
        ap.error(f"--gpu-memory-utilization must be in (0, 1]; got {a.gpu_memory_utilization}")
    if a.max_model_len < 1:
        ap.error(f"--max-model-len must be >= 1; got {a.max_model_len}")
    if not a.model.startswith("preset:"):
        ap.error(f"--model: give a preset (preset:NAME); got {a.model!r}")
    import torch

    if not torch.cuda.is_available():
        print("kv_capacity needs a GPU", file=sys.stderr)
        return 2
    rows = [measure(a.model, a.quantization, k, a.gpu_memory_utilization, a.max_model_len, a.step_processes,
                    breakdown=a.peak_breakdown and i == 0) for i, k in enumerate(kinds)]
    peaks = [f"\n\n{r.pop('peak_table')}" for r in rows if "peak_table" in r]
    weights = "bf16" if a.quantization == "none" else a.quantization
    md = (f"KV capacity, {a.model} ({weights} weights) on {torch.cuda.get_device_name()}, "
          f"--gpu-memory-utilization {a.gpu_memory_utilization}, --max-model-len {a.max_model_len} (GiB):\n\n"
          + table(rows) + "".join(peaks))
    write_table_files(a.out, "kv_capacity", a, rows, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
