"""Decode attention's launch configuration at small batches, as a decode step sees it (issue 16: decode >= 90%
of the roofline at batch 1-16).

    python bench/experiments/2026-11/decode_attn_sweep.py [--batches 1,4,16] [--ctxs 1024,2048,4096] [--layers 36]
        [--out DIR]

A step calls decode attention once per layer, each over its own layer's cache, with the weights read in
between, so no K/V is found in L2. This times `--layers` calls over `--layers` separate caches in one CUDA
graph (Qwen3-8B's attention: 32 q heads, 8 kv heads, head_dim 128, bf16, block 16, a block table as wide as
--max-model-len allows) and reports microseconds per call for every (num_splits, block_n, num_stages) of
the sweep against the engine's default (`decode_num_splits` / `_decode_config`), each output checked
against the default's first. Writes <out>/decode_attn_sweep.json; prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys

import torch
from triton.runtime.errors import OutOfResources

HERE = os.path.dirname(os.path.abspath(__file__))  # bench/experiments/2026-11
BENCH = os.path.dirname(os.path.dirname(HERE))  # bench/: the shared helpers (gpu_timing, model_runner)
sys.path[:0] = [HERE, BENCH, os.path.dirname(BENCH)]  # and the repository root, for rapidserve

from gpu_timing import time_ms  # noqa: E402

from rapidserve.attention import triton_paged_decode as tp  # noqa: E402
from rapidserve.attention.decode_config import decode_num_splits  # noqa: E402

HQ, HKV, D, BLOCK = 32, 8, 128, 16
SPLITS = (4, 8, 12, 16, 24, 32, 48, 64)
BLOCK_NS = (32, 64, 128)
STAGES = (2, 3, 4)


def layer_caches(batch: int, ctx: int, layers: int, max_blocks: int, gen: torch.Generator,
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """`layers` caches (random K/V) sharing one shuffled block table [batch, max_blocks] and context lengths."""
    need = -(-ctx // BLOCK)
    blocks = batch * need + 1
    perm = torch.randperm(blocks, generator=gen).to(torch.int32)
    table = torch.zeros(batch, max_blocks, dtype=torch.int32)
    for b in range(batch):
        table[b, :need] = perm[b * need:(b + 1) * need]
    caches = [(torch.randn(blocks, HKV, BLOCK, D, device="cuda", dtype=torch.bfloat16),
               torch.randn(blocks, HKV, BLOCK, D, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
    return caches, table.cuda(), torch.full((batch,), ctx, dtype=torch.int32, device="cuda")


def graph_us(caches: list[tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor, table: torch.Tensor,
             ctx: torch.Tensor, cfg: dict[str, int]) -> float:
    """Microseconds per call of decode_attention with `cfg`, `len(caches)` calls in one graph (median)."""
    def step() -> None:
        for kc, vc in caches:
            tp.decode_attention(q, kc, vc, table, ctx, D**-0.5, **cfg)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = sorted(time_ms(graph.replay, reps=20))
    return times[len(times) // 2] * 1e3 / len(caches)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--ctxs", default="1024,2048,4096")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    ctxs = [int(x) for x in args.ctxs.split(",")]
    if min(batches) < 1 or min(ctxs) < 1 or max(ctxs) > args.max_model_len or args.layers < 1:
        ap.error("--batches, --ctxs and --layers must be positive, every context at most --max-model-len")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_blocks = -(-args.max_model_len // BLOCK)
    rows = []
    for batch, ctx in itertools.product(batches, ctxs):
        gen = torch.Generator().manual_seed(batch * 7 + ctx)
        caches, table, ctxs = layer_caches(batch, ctx, args.layers, max_blocks, gen)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=None)
        want = tp.decode_attention(q, *caches[0], table, ctxs, D**-0.5)
        auto = decode_num_splits(batch, HKV, max_blocks, BLOCK, tp._decode_config(q.dtype, D).block_n, sms)
        default = graph_us(caches, q, table, ctxs, {})
        best = (default, "default")
        for s, n, st in itertools.product(SPLITS, BLOCK_NS, STAGES):
            cfg = {"num_splits": s, "block_n": n, "num_stages": st}
            try:
                got = tp.decode_attention(q, *caches[0], table, ctxs, D**-0.5, **cfg)
                err = (got.float() - want.float()).abs().max().item()
                if not err < 2e-2:
                    raise SystemExit(f"b={batch} ctx={ctx} {cfg}: max abs error {err:.3g} against the default")
                us = graph_us(caches, q, table, ctxs, cfg)
            except OutOfResources as e:  # a configuration may not fit in shared memory
                print(f"b={batch} ctx={ctx} {cfg}: skipped ({type(e).__name__})")
                continue
            rows.append({"batch": batch, "ctx": ctx, **cfg, "us": us})
            if us < best[0]:
                best = (us, f"splits {s}, block_n {n}, stages {st}")
        kv_gb = 2 * batch * ctx * HKV * D * 2 / 1e9
        rows.append({"batch": batch, "ctx": ctx, "default_us": default, "default_splits": auto, "best_us": best[0],
                     "best": best[1], "kv_tb_s_default": kv_gb * 1e3 / default})
        del caches
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(0),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python bench/experiments/2026-11/decode_attn_sweep.py " + " ".join(sys.argv[1:]), "rows": rows}
    with open(os.path.join(args.out, "decode_attn_sweep.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"\n{meta['gpu']}, {args.layers} layers' caches in one graph, us per call\n")
    print("| batch | ctx | default (splits) | best | best config |\n|---|---|---|---|---|")
    for r in rows:
        if "best" in r:
            print(f"| {r['batch']} | {r['ctx']} | {r['default_us']:.1f} ({r['default_splits']}) | {r['best_us']:.1f} "
                  f"| {r['best']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
