"""Where one prefill step and one decode step spend their GPU time, per attention backend (issue 16).

    python bench/step_profile.py [--model preset:qwen3-8b] [--backends triton,fa3] [--out DIR]

For each backend it builds the model runner (bf16, random weights, KV pool filled with noise), then
under torch.profiler runs a prefill forward of 2 x 4096 prompt tokens and a decode step at batch 64
with 4096-token contexts (a CUDA-graph replay, as the engine runs it). Each device kernel is put in a
category by its name (`CATEGORIES`: GEMM, attention, RMSNorm, RoPE, SiLU-and-mul, KV write, activation
quantization, elementwise, other: sampling, copies), and the table gives each category's time per step and
share of the step's wall time (CUDA events); the rest of the wall time is the gap no kernel ran in (launch
overhead, host work). Writes <out>/step_profile.json and .md; prints the table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_timing import time_ms  # noqa: E402

# (category, substrings of kernel names), first match wins; matched lower-case. Ours (Triton kernels named by op,
# cuBLAS nvjet GEMMs) and vLLM's (bench/vllm_step_profile.py): CUDA ops `vllm::...` (reshape_and_cache_flash before
# attention's "flash"), CUTLASS `cutlass::device_kernel<...>` GEMMs (FA3 is `cutlass::device_kernel<flash::...>`:
# attention first), and torch.compile's Triton kernels, named by the aten ops they fuse (`triton_{poi,red,per}_fused_
# <ops>_N`): RMSNorm's rsqrt (with the residual add and the next GEMM's fp8 quantization fused in: rmsnorm, as ours
# `_rms_norm_fp8_kernel`), RoPE's cos/sin index_select, silu (with its quantization: silu-and-mul), a per-token fp8
# quantization alone (abs, max, reciprocal: act quant, as ours `_quantize_tokens_kernel`), the rest pointwise.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kv write", ("_write_kv", "reshape_and_cache", "concat_and_cache")),
    ("attention", ("flash", "fwd_kernel", "_prefill_kernel", "_decode_split", "_decode_reduce", "attn", "attention")),
    ("rmsnorm", ("rms_norm", "rmsnorm", "rsqrt")),
    ("rope", ("_rope", "rotary", "index_select")),
    ("silu-and-mul", ("_silu_and_mul", "silu", "act_and_mul")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90", "cublas", "splitk")),
    ("act quant", ("quant", "_abs_")),
    ("elementwise", ("triton_poi_", "elementwise", "gather", "copy")),
)
PREFILL_SHAPE = (2, 4096)
DECODE_BATCH, DECODE_CTX = 64, 4096


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def device_events(prof: profile) -> list[Any]:
    """The device's work in `prof`: its kernels, copies and memsets, without the user annotations (record_function
    ranges mirrored on the GPU's timeline, e.g. torch.compile's `## Call CompiledFxGraph ##`: spans, not work)."""
    return [ev for ev in prof.events()
            if ev.device_type == torch.autograd.DeviceType.CUDA and not getattr(ev, "is_user_annotation", False)]


def kernel_times(prof: profile, steps: int, top: int = 12, name_chars: int = 90,
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """(ms per step by category, ms per step of the `top` longest kernels by name, cut to `name_chars`)."""
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for ev in device_events(prof):
        ms = ev.device_time / 1e3 / steps
        by_cat[category(ev.name)] += ms
        by_name[ev.name[:name_chars]] += ms
    longest = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:top])
    return dict(by_cat), longest


def timed_and_profiled(fn: Callable[[], object], steps: int, timer: Callable[..., list[float]] = time_ms,
                       inspect: Callable[[profile], object] | None = None, idle_s: float = 0.0, **kernel_args: int,
                       ) -> tuple[list[float], dict[str, float], dict[str, float]]:
    """`fn`'s ms over `steps` calls (`timer`: gpu_timing's time_ms, each call alone, or back_to_back_ms, its device
    work behind the call before), then `kernel_times` of `steps` more under torch.profiler (`kernel_args`: its top
    and name_chars; `inspect`, when given, is called with the profile too): (each call's ms, ms per call by
    category, ms per call of the longest kernels). `idle_s` > 0: the device left idle that long before each timed
    and each profiled call (`timer` is then called with idle_s: time_ms's), so a power-limited GPU runs every call at
    the clocks of a duty cycle like a server's between requests (bench/gemm_duty_cycle.py)."""
    wall = timer(fn, reps=steps, idle_s=idle_s) if idle_s > 0 else timer(fn, reps=steps)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if idle_s > 0:
                torch.cuda.synchronize()
                time.sleep(idle_s)
            fn()
        torch.cuda.synchronize()
    cats, top = kernel_times(prof, steps, **kernel_args)
    if inspect is not None:
        inspect(prof)
    return wall, cats, top


def measure(model: str, backend: str, steps: int) -> dict[str, object]:
    from model_runner import engine_config, preset_source

    from rapidserve.loader.presets import preset_config
    from rapidserve.runner import DecodeItem, ModelRunner, PrefillItem

    name = model.removeprefix("preset:")
    mcfg = preset_config(name)
    ecfg = engine_config(name, mcfg, "bfloat16", (DECODE_BATCH,), 8192, 0.9)
    ecfg = dataclasses.replace(ecfg, runner=dataclasses.replace(ecfg.runner, attention_backend=backend))
    runner = ModelRunner(ecfg, preset_source(name, mcfg, "cuda", torch.bfloat16), show_progress=False)
    pool = runner.kv_pool
    for layer in range(pool.tensor.shape[0]):
        pool.tensor[layer].normal_()
    runner.capture_decode_graphs(key="full", show_progress=False)
    bs = runner.block_size
    g = torch.Generator().manual_seed(0)
    nseq, qlen = PREFILL_SHAPE
    per = -(-qlen // bs)
    prefill_items = [PrefillItem(torch.randint(0, mcfg.vocab_size, (qlen,), generator=g).tolist(), 0,
                                 list(range(i * per, (i + 1) * per))) for i in range(nseq)]
    per = DECODE_CTX // bs
    decode_items = [DecodeItem(1, DECODE_CTX - 1, [(i * per + j) % pool.num_blocks for j in range(per)])
                    for i in range(DECODE_BATCH)]
    out: dict[str, object] = {"backend": runner.attn.name}
    steps_fns = (("prefill", functools.partial(runner.prefill, prefill_items)),
                 ("decode", functools.partial(runner.decode, decode_items, graph_key="full")))
    for phase, fn in steps_fns:
        wall, cats, top = timed_and_profiled(fn, steps)
        out[phase] = {"wall_ms": statistics.median(wall), "wall_min_ms": min(wall), "wall_max_ms": max(wall),
                      "categories_ms": cats, "top_kernels_ms": top}
    del runner, steps_fns
    torch.cuda.empty_cache()
    return out


def table(results: list[dict[str, object]]) -> str:
    cats = [c for c, _ in CATEGORIES] + ["other"]
    lines = ["| phase | backend | wall ms (min-max) | " + " | ".join(cats) + " | no kernel running |",
             "|---|---|---|" + "---|" * (len(cats) + 1)]
    for phase in ("prefill", "decode"):
        for r in results:
            p = r[phase]
            wall = float(p["wall_ms"])  # type: ignore[index]
            c = p["categories_ms"]  # type: ignore[index]
            busy = sum(c.values())
            cells = [f"{c.get(k, 0.0):.2f} ({c.get(k, 0.0) / wall:.0%})" for k in cats]
            lines.append(f"| {phase} | {r['backend']} | {wall:.2f} ({p['wall_min_ms']:.2f}-{p['wall_max_ms']:.2f}) | "
                         + " | ".join(cells) + f" | {max(0.0, wall - busy):.2f} ({max(0.0, 1 - busy / wall):.0%}) |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:qwen3-8b")
    ap.add_argument("--backends", default="triton,fa3")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("step_profile needs a GPU", file=sys.stderr)
        return 2
    results = []
    for b in a.backends.split(","):
        try:
            results.append(measure(a.model, b, a.steps))
        except Exception as e:  # a backend this machine lacks: say so, measure the others
            print(f"{b}: not measured ({type(e).__name__}: {e})", flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"), "model": a.model,
           "prefill": f"{PREFILL_SHAPE[0]}x{PREFILL_SHAPE[1]}", "decode": f"b={DECODE_BATCH} ctx={DECODE_CTX}",
           "command": "python bench/step_profile.py " + " ".join(sys.argv[1:]), "results": results}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "step_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    text = (f"# One step's GPU time by kernel category: {a.model} bf16 on {res['gpu']} ({res['date']})\n\n"
            f"Command: `{res['command']}`. Prefill {res['prefill']} tokens; decode {res['decode']} "
            "(CUDA graph). Milliseconds per step (share of the wall time).\n\n" + table(results) + "\n")
    for r in results:
        for phase in ("prefill", "decode"):
            text += f"\nLongest kernels, {phase}, {r['backend']} (ms per step):\n\n"
            text += "\n".join(f"- {v:.3f} `{k}`" for k, v in r[phase]["top_kernels_ms"].items()) + "\n"
    with open(os.path.join(a.out, "step_profile.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
