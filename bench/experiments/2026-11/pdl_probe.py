"""Does programmatic dependent launch (PDL) shorten a chain of small-batch linear layers? (issue 16)

    python bench/experiments/2026-11/pdl_probe.py [--batch 1] [--out DIR]

A decode step at batch 1-16 is some 330 kernels back to back, each depending on the one before; the
small ones (Qwen3-8B's o and qkv projections) pay ~2-3 us of start-up and tail on 14-20 us of weight
reads (bench/decode_profile.py). With PDL (Hopper's griddepcontrol) a kernel lets the next one launch
before it ends; the next one waits (`gdc_wait`) before reading what the first wrote, and may read what
it does not depend on (its weights) before that wait.

Four variants of rapidserve's skinny kernel (rapidserve/ops/triton_skinny.py, the same tiles) run a
chain of 36 "layers" in one CUDA graph, each a [M, 4096] x [4096, 4096] product (o_proj's shape) whose
input is the previous layer's output, with a 2.2 us RMSNorm-like row kernel between them in a second
chain (as in the real step):
  plain     no PDL (as the engine runs today)
  pdl       launched with PDL; waits at its start, lets its dependents launch at its start
  prefetch  as pdl, and loads its first weight tile before the wait
  late      as prefetch, but lets its dependents launch only after its K loop (so their waiting
            programs do not take SM room from its weight reads)
Medians of 20 replays; the chain's weights are distinct (no L2 reuse). Prints a table last; writes
<out>/pdl_probe.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

BENCH = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for gpu_timing
sys.path.insert(0, BENCH)
from gpu_timing import time_ms  # noqa: E402

LAYERS, N, K = 36, 4096, 4096
BLOCK_N, BLOCK_K, WARPS, STAGES = 32, 256, 4, 4


@triton.jit
def _gemv(x_ptr, w_ptr, out_ptr, M, N, K, PDL: tl.constexpr, PREFETCH: tl.constexpr, LATE: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if PDL and not LATE:
        tl.extra.cuda.gdc_launch_dependents()
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None] * K
    w_rows = w_ptr + rn[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = 0
    if PREFETCH:  # the first weight tile does not depend on the previous kernel: read it before the wait
        w = tl.load(w_rows + rk[None, :])
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_rows + rk[None, :], mask=rm[:, None] < M, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        start = BLOCK_K
    elif PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(start, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_rows + kk[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_rows + kk[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    if PDL and LATE:  # the next kernel's programs take SM room only once this one's reads are done
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=rm[:, None] < M)


@triton.jit
def _row_scale(x_ptr, out_ptr, N, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """A stand-in for RMSNorm: one program per row, x / rms(x)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / N + 1e-6)
    tl.store(out_ptr + row * N + cols, (x * r).to(out_ptr.dtype.element_ty), mask=cols < N)


def chain(ws: list[torch.Tensor], x: torch.Tensor, variant: str, norms: bool) -> float:
    """Per-layer microseconds of the chain in one graph."""
    pdl = variant != "plain"
    bufs = [torch.empty_like(x) for _ in range(3)]  # a product's output is never its own input
    m = x.shape[0]

    def run() -> None:
        cur = x
        for w in ws:
            out = next(b for b in bufs if b is not cur)
            _gemv[(N // BLOCK_N,)](cur, w, out, m, N, K, PDL=pdl, PREFETCH=variant in ("prefetch", "late"),
                                   LATE=variant == "late", BLOCK_M=16,
                                   BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=WARPS, num_stages=STAGES,
                                   launch_pdl=pdl)
            cur = out
            if norms:
                nxt = next(b for b in bufs if b is not cur)
                _row_scale[(m,)](cur, nxt, N, PDL=pdl, BLOCK=triton.next_power_of_2(N), num_warps=4,
                                 launch_pdl=pdl)
                cur = nxt

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = time_ms(graph.replay, reps=20)
    return statistics.median(ms) * 1e3 / len(ws)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(BENCH, "results"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("pdl_probe needs a GPU", file=sys.stderr)
        return 2
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(LAYERS)]
    x = torch.randn(a.batch, K, device="cuda", dtype=torch.bfloat16)
    rows = []
    ref = None
    for variant in ("plain", "pdl", "prefetch", "late"):
        for norms in (False, True):
            try:
                us = chain(ws, x, variant, norms)
                err = None
            except Exception as e:  # e.g. this Triton cannot launch with PDL: say so
                us, err = float("nan"), f"{type(e).__name__}: {str(e)[:160]}"
            rows.append({"variant": variant, "norms": norms, "us_per_layer": us, "error": err})
    # the three variants compute the same chain: compare the last outputs once (no graph)
    for variant in ("plain", "prefetch"):
        out = torch.empty_like(x)
        try:
            _gemv[(N // BLOCK_N,)](x, ws[0], out, a.batch, N, K, PDL=variant != "plain",
                                   PREFETCH=variant == "prefetch", LATE=False, BLOCK_M=16, BLOCK_N=BLOCK_N,
                                   BLOCK_K=BLOCK_K, num_warps=WARPS, num_stages=STAGES)
        except Exception:
            break
        if ref is None:
            ref = out
        else:
            rows.append({"variant": "check", "max_abs_diff_vs_plain": float((out - ref).abs().max())})
    nbytes = N * K * 2
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "batch": a.batch,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
           "command": "python bench/experiments/2026-11/pdl_probe.py " + " ".join(sys.argv[1:]), "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "pdl_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"PDL probe: {res['gpu']}, triton {res['triton']}, batch {a.batch}, {res['date']}\n")
    print("| variant | RMSNorm-like kernel between | us per layer | weight read rate |")
    print("|---|---|---|---|")
    for r in rows:
        if r["variant"] == "check":
            print(f"\nprefetch vs plain, one layer: max |diff| {r['max_abs_diff_vs_plain']:.3g}")
            continue
        rate = nbytes / (r["us_per_layer"] * 1e-6) / 1e12
        print(f"| {r['variant']} | {'yes' if r['norms'] else 'no'} | {r['us_per_layer']:.2f} | {rate:.2f} TB/s |"
              + (f" {r['error']}" if r["error"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
