"""Would pulling the o projection's weight into L2 while decode attention runs shorten a small-batch decode step?
A probe for issue 16's "decode >= 90% of the memory roofline" (batch 1-16 is at 85-86%).

    python bench/experiments/2026-11/l2_prefetch_probe.py [--batches 1,4,16] [--ctx 2048] [--layers 36]
        [--programs 32,66,132] [--out DIR]

Why it might: at batch 1 a layer's attention takes ~9 us and reads ~8 MB (latency-bound: HBM mostly idle), and the
o projection after it (Qwen3-8B: [4096, 4096] bf16, 33.5 MB, less than the H100's 50 MB L2) then takes ~14 us
reading its weight from HBM. A side stream that reads the weight while attention runs would leave part of it in
L2 for the projection. This times `--layers` layers of (decode attention -> o projection), each layer with its own
cache and weight (so nothing is in L2 from the layer before), as one CUDA graph:
  - plain: attention, then the projection (the engine's order);
  - prefetch P: a side stream forks at the layer's start, runs a kernel of P programs reading the layer's o
    weight (a sum the graph keeps, so the loads are not dropped), and joins before the projection.
Both use the engine's kernels (`triton_paged_decode.decode_attention`, `ops.triton_skinny.linear` for <= 16 rows, else
F.linear). Outputs are checked equal. Prints us per layer for each; writes <out>/l2_prefetch_probe.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))  # bench/experiments/2026-11
BENCH = os.path.dirname(os.path.dirname(HERE))  # bench/: the shared helpers (gpu_timing, model_runner)
sys.path[:0] = [HERE, BENCH, os.path.dirname(BENCH)]  # and the repository root, for rapidserve

from decode_attn_sweep import BLOCK, HQ, D, layer_caches  # noqa: E402
from gpu_timing import time_ms  # noqa: E402

from rapidserve.attention import triton_paged_decode as tp  # noqa: E402

HIDDEN = 4096  # Qwen3-8B's hidden size: the o weight is [HIDDEN, HQ * D]
TOUCH_BLOCK = 16384  # elements a prefetch program reads per step: 32 KB in flight each


@triton.jit
def _touch_kernel(w_ptr, out_ptr, n, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """Program p reads elements [p * CHUNK, (p + 1) * CHUNK) of w and writes their sum to out[p]."""
    p = tl.program_id(0)
    offs = tl.arange(0, TILE)
    acc = tl.zeros((TILE,), dtype=tl.float32)
    start = p.to(tl.int64) * CHUNK
    for i in range(0, CHUNK, TILE):
        idx = start + i + offs
        acc += tl.load(w_ptr + idx, mask=idx < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


def touch(w: torch.Tensor, out: torch.Tensor) -> None:
    n = w.numel()
    programs = out.numel()
    chunk = triton.cdiv(triton.cdiv(n, programs), TOUCH_BLOCK) * TOUCH_BLOCK
    _touch_kernel[(programs,)](w, out, n, CHUNK=chunk, TILE=TOUCH_BLOCK, num_warps=8)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from rapidserve.ops import triton_skinny

    return triton_skinny.linear(x, w) if x.shape[0] <= triton_skinny.MAX_ROWS else torch.nn.functional.linear(x, w)


def build(batch: int, ctx: int, layers: int, max_blocks: int) -> dict[str, object]:
    """Each layer's cache (decode_attn_sweep's) and o weight, and the queries."""
    caches, table, ctxs = layer_caches(batch, ctx, layers, max_blocks, torch.Generator().manual_seed(batch))
    return {"q": torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16), "caches": caches,
            "weights": [torch.randn(HIDDEN, HQ * D, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(layers)],
            "table": table, "ctx": ctxs}


def step_fn(s: dict[str, object], programs: int) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """One graph-capturable step over every layer; programs 0: plain, else the side stream's prefetch."""
    q, table, ctx = s["q"], s["table"], s["ctx"]
    caches, weights = s["caches"], s["weights"]
    outs: list[torch.Tensor] = []
    side = torch.cuda.Stream()
    sums = [torch.empty(max(programs, 1), device="cuda", dtype=torch.float32) for _ in weights]  # type: ignore[arg-type]

    def step() -> None:
        outs.clear()
        main = torch.cuda.current_stream()
        for (kc, vc), w, acc in zip(caches, weights, sums, strict=True):  # type: ignore[arg-type]
            if programs:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    touch(w, acc)
            o = tp.decode_attention(q, kc, vc, table, ctx, D**-0.5)  # type: ignore[arg-type]
            if programs:
                main.wait_stream(side)
            outs.append(linear(o.reshape(o.shape[0], -1), w))
    return step, outs


def graph_us(step: Callable[[], None], layers: int) -> float:
    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return statistics.median(time_ms(g.replay, reps=30)) * 1e3 / layers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--programs", default="32,66,132")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("l2_prefetch_probe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    batches = [int(x) for x in a.batches.split(",")]
    programs = [int(x) for x in a.programs.split(",")]
    if min(batches) < 1 or min(programs) < 1 or not 0 < a.ctx <= a.max_model_len or a.layers < 1:
        ap.error("--batches and --programs must be positive, 0 < --ctx <= --max-model-len, --layers >= 1")
    rows = []
    for batch in batches:
        s = build(batch, a.ctx, a.layers, -(-a.max_model_len // BLOCK))
        plain, want = step_fn(s, 0)
        row: dict[str, object] = {"batch": batch, "ctx": a.ctx, "plain_us": graph_us(plain, a.layers)}
        ref = [o.clone() for o in want]
        for p in programs:
            fn, got = step_fn(s, p)
            row[f"prefetch{p}_us"] = graph_us(fn, a.layers)
            fn()
            torch.cuda.synchronize()
            if any(not torch.equal(x, y) for x, y in zip(got, ref, strict=True)):
                raise SystemExit(f"batch {batch}, prefetch {p}: outputs differ from the plain order")
        rows.append(row)
        print(row, flush=True)
        del s
        torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(0),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python bench/experiments/2026-11/l2_prefetch_probe.py " + " ".join(sys.argv[1:]), "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "l2_prefetch_probe.json"), "w") as f:
        json.dump(meta, f, indent=1)
    head = ["batch", "plain us/layer"] + [f"prefetch {p} programs" for p in programs]
    print(f"\n{meta['gpu']}: decode attention (context {a.ctx}) then the o projection, {a.layers} layers in a "
          "graph, us per layer\n")
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    for r in rows:
        cells = [str(r["batch"]), f"{r['plain_us']:.1f}"] + [f"{r[f'prefetch{p}_us']:.1f}" for p in programs]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
