"""Where an fp8 linear's time goes, per Qwen3-8B projection shape and row count (issue 39), on one GPU.

    python bench/fp8_linear_probe.py [--out bench/results]

Rows: bf16 (the engine's bf16 linear: the skinny Triton kernel at <= 16 rows, cuBLAS above), fp8 (the engine's
`fp8_gpu.gpu_linear` as routed now), and its parts: the per-token quantizer in torch (six passes) and in Triton,
`torch._scaled_mm` alone with and without fast accumulation, and the skinny fp8 kernel (<= 16 rows,
triton_fp8_skinny).
Microseconds per call (20 calls in a CUDA graph, median of 20 replays), and for the skinny kernel other tile
sizes (skinny_fp8_nNkKsS: BLOCK_N, BLOCK_K, stages). Writes <out>/fp8_linear_probe.json / .md; table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_timing import run_record, time_ms, write_json  # noqa: E402

from rapidserve.ops import fp8, fp8_gpu, get_ops, triton_fp8, triton_fp8_skinny, triton_skinny  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = (1, 16, 64, 256, 8192)


def us(fn: object, calls: int = 20) -> float:
    """Microseconds per call of fn, `calls` calls captured in one CUDA graph (no host launch cost: what a
    decode step's graph pays), median of 20 replays."""
    f = fn  # type: ignore[assignment]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            f()  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            f()  # type: ignore[operator]
    return 1e3 * statistics.median(time_ms(g.replay, reps=20)) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    ops = get_ops(dev)
    dt = fp8.fp8_dtype(dev)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev) / k**0.5
        wb = w.to(torch.bfloat16)
        layer = fp8.Fp8Linear(n, k, dt, "token", None, dev)
        w8, s = fp8.quantize_weight(w, "channel", None, dt)
        layer.weight.copy_(w8)
        layer.weight_scale.copy_(s)
        sb = s.reshape(1, -1)
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            x8, sx = triton_fp8.quantize_tokens(x, dt)
            r = {"shape": name, "n": n, "k": k, "m": m,
                 "bf16": us(lambda x=x, wb=wb: ops.linear(x, wb)),
                 "fp8": us(lambda x=x, layer=layer: fp8_gpu.gpu_linear(x, layer)),
                 "quant_torch": us(lambda x=x: fp8.quantize_input(x, "token", dt)),
                 "quant_triton": us(lambda x=x: triton_fp8.quantize_tokens(x, dt)),
                 "mm_exact": us(lambda x8=x8, sx=sx, w8=w8, sb=sb: torch._scaled_mm(
                     x8, w8.t(), scale_a=sx, scale_b=sb, out_dtype=torch.bfloat16)),
                 "mm_fast": us(lambda x8=x8, sx=sx, w8=w8, sb=sb: torch._scaled_mm(
                     x8, w8.t(), scale_a=sx, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True))}
            if m <= triton_skinny.MAX_ROWS:
                r["skinny_fp8"] = us(lambda x=x, w8=w8, s=s: triton_fp8_skinny.skinny_fp8_linear(x, w8, s))
                for bn, bk, st in ((32, 256, 4), (32, 512, 3), (64, 512, 4), (32, 1024, 3), (16, 512, 4)):
                    cfg = triton_skinny.SkinnyConfig(bn, bk, 4, st)
                    r[f"skinny_fp8_n{bn}k{bk}s{st}"] = us(lambda x=x, w8=w8, s=s, cfg=cfg:
                                                          triton_fp8_skinny.skinny_fp8_linear(x, w8, s, config=cfg))
            r["bytes_bf16"] = n * k * 2 + m * (k + n) * 2
            r["bytes_fp8"] = n * k + m * (k + n) * 2
            rows.append(r)
            print(json.dumps(r), flush=True)
    res = run_record("fp8_linear_probe.py", rows=rows)
    write_json(a.out, "fp8_linear_probe", res)
    cols = ("bf16", "fp8", "quant_torch", "quant_triton", "mm_exact", "mm_fast", "skinny_fp8", "skinny_fp8_n32k256s4",
            "skinny_fp8_n32k512s3", "skinny_fp8_n64k512s4", "skinny_fp8_n32k1024s3", "skinny_fp8_n16k512s4")
    lines = [f"# fp8 linear, where the time goes: {res['gpu']} ({res['date']})", "",
             f"Command: `{res['command']}`. Microseconds per call inside a CUDA graph.", "",
             "| shape | rows | " + " | ".join(cols) + " | fp8 / bf16 |", "|---" * (len(cols) + 3) + "|"]
    for r in rows:
        cells = " | ".join(f"{r[c]:.1f}" if c in r else "-" for c in cols)
        lines.append(f"| {r['shape']} [{r['n']}x{r['k']}] | {r['m']} | {cells} | {r['bf16'] / r['fp8']:.2f}x |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "fp8_linear_probe.md"), "w") as fh:
        fh.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
