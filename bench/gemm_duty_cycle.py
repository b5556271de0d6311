"""The same cuBLAS GEMMs timed back to back and with the GPU idle between them: does a kernel's time depend on the
duty cycle (the clocks a power-limited H200 holds)? bench/step_vs_vllm.sh found our prefill step's GEMMs 5-15% slower
than vLLM's with the SAME cuBLASLt kernels (nvjet_sm90 256x128 / 320x128 / 192x192), and the gap grew with the idle
share of vLLM's requests (gaps 2.5% of its 8192-token step, 21% of its 2048-token one) while ours were timed back to
back. This separates the two.

    python bench/gemm_duty_cycle.py [--tokens 2048,8192] [--idle-ms 0,5,15] [--reps 40] [--out DIR]

For a step's worth of the Qwen3-8B shape's linears (36 layers of qkv 4096->6144, o 4096->4096, gate|up 4096->24576,
down 12288->4096, bf16) at each token count: one "step" (the 144 GEMMs) timed with CUDA events, --reps times, with
`idle` ms of sleep (the GPU idle) before each; ms is the median, TFLOP/s from it; the SM clock (nvidia-smi, sampled
after the reps) beside. Writes <out>/gemm_duty_cycle.json and .md; prints the table last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import run_record, time_ms, write_json, write_md  # noqa: E402

LAYERS = 36
SHAPES = ((4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096))  # (K, N) of qkv, o, gate|up, down


def step_flop(tokens: int) -> float:
    """The floating-point operations of one step's GEMMs at `tokens` rows."""
    return 2.0 * tokens * sum(k * n for k, n in SHAPES) * LAYERS


def table(rows: list[dict[str, object]]) -> list[str]:
    """The markdown table of `rows` (tokens, idle_ms, ms, ms_min, ms_max, tflops, clock_power)."""
    out = ["| tokens | idle before each (ms) | ms [min, max] | TFLOP/s | SM clock, power |", "|---|---|---|---|---|"]
    out += [f"| {r['tokens']} | {r['idle_ms']:g} | {r['ms']:.2f} [{r['ms_min']:.2f}, {r['ms_max']:.2f}] | "
            f"{r['tflops']:.0f} | {r['clock_power']} |" for r in rows]
    return out


def sm_clock() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--idle-ms", default="0,5,15")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    try:
        tokens = [int(t) for t in a.tokens.split(",")]
        idles = [float(t) for t in a.idle_ms.split(",")]
    except ValueError:
        ap.error("--tokens and --idle-ms are comma-separated numbers")
    if a.reps < 1 or min(tokens) < 1 or min(idles) < 0:
        ap.error("--reps and --tokens must be positive, --idle-ms not negative")
    if not torch.cuda.is_available():
        print("gemm_duty_cycle needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for k, n in SHAPES]
    rows = []
    for t in tokens:
        xs = [torch.randn(t, k, device=dev, dtype=torch.bfloat16) for k, _ in SHAPES]
        flop = step_flop(t)

        def step(xs: list[torch.Tensor] = xs) -> None:
            for _ in range(LAYERS):
                for x, w in zip(xs, weights, strict=True):
                    F.linear(x, w)

        for idle in idles:
            ms = time_ms(step, a.reps, warmup=3, idle_s=idle / 1000)
            med = statistics.median(ms)
            rows.append({"tokens": t, "idle_ms": idle, "ms": med, "ms_min": min(ms), "ms_max": max(ms),
                         "tflops": flop / med / 1e9, "clock_power": sm_clock()})
            print(f"{t} tokens, idle {idle} ms: {med:.2f} ms", flush=True)
    res = run_record("gemm_duty_cycle.py", rows=rows)
    write_json(a.out, "gemm_duty_cycle", res)
    write_md(a.out, "gemm_duty_cycle", "A step's GEMMs (Qwen3-8B shape, bf16) by duty cycle", res, table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
