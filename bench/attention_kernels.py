"""GPU micro-benchmark of the Triton paged-attention kernels (Llama-3-8B attention shapes).

    python bench/attention_kernels.py [--dtype bfloat16] [--block-size 16] [--sweep]

Decode: batch 1/16/64/256 x 2048-token contexts, reported as GB/s of K+V read (one pass over every
cached key and value). Prefill: 8 x 1024 and 2 x 4096 new tokens (no prefix) and 4 x 512 new after a
1536-token cached prefix, reported as TFLOP/s of causal attention,
FLOPs = 4 * sum_seqs(q_len * (q_len + 1) / 2 + q_len * prefix) * head_dim * num_heads.
Every configuration is checked against the torch reference before it is timed. Times are medians of
triton.testing.do_bench; decode is also timed as a CUDA-graph replay (how the engine runs it), since
for small batches a plain launch is bound by host overhead. --sweep also times other tile
configurations and prints the best one per shape.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rapidserve.attention import AttentionMetadata  # noqa: E402
from rapidserve.attention import torch_ref as ref  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXT = 2048
PREFILL_CASES = (("8x1024", [1024] * 8, [0] * 8), ("2x4096", [4096] * 2, [0] * 2),
                 ("4x512+1536", [512] * 4, [1536] * 4))


def make_paged(ctxs: list[int], block_size: int, dtype: torch.dtype, gen: torch.Generator,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A filled cache with shuffled block tables: (k_cache, v_cache, block_tables)."""
    needed = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(needed) + 8
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(ctxs), max(needed), dtype=torch.int32)
    nxt = 0
    for i, n in enumerate(needed):
        table[i, :n] = perm[nxt:nxt + n]
        nxt += n
    shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM)
    k = torch.randn(shape, device="cuda", dtype=dtype)
    v = torch.randn(shape, device="cuda", dtype=dtype)
    return k, v, table.cuda()


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got.float() - want.float()).abs().max().item()
    if not err < 3e-2:
        raise SystemExit(f"{what}: max abs error {err:.3g} vs the torch reference; not timing a wrong kernel")


def time_ms(fn: Callable[[], object], graph: bool = False) -> float:
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, return_mode="median"))
    return float(triton.testing.do_bench(fn, return_mode="median"))


def bench_decode(dtype: torch.dtype, block_size: int, sweep: bool) -> list[tuple[str, ...]]:
    from rapidserve.attention import triton_paged as tp

    rows: list[tuple[str, ...]] = []
    elem = torch.finfo(dtype).bits // 8
    scale = HEAD_DIM**-0.5
    for batch in DECODE_BATCHES:
        gen = torch.Generator().manual_seed(batch)
        ctxs = [DECODE_CONTEXT] * batch
        kc, vc, table = make_paged(ctxs, block_size, dtype, gen)
        ctx = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        want = ref.decode_attention(q, kc, vc, table, ctx, scale)
        nbytes = 2 * sum(ctxs) * NUM_KV_HEADS * HEAD_DIM * elem
        configs: list[dict[str, int | None]] = [{}]
        if sweep:
            configs += [{"block_n": n, "num_warps": w, "num_stages": s}
                        for n, w, s in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))]
        best: tuple[float, str] | None = None
        for cfg in configs:
            def fn(cfg: dict[str, int | None] = cfg, q: torch.Tensor = q, kc: torch.Tensor = kc,
                   vc: torch.Tensor = vc, table: torch.Tensor = table, ctx: torch.Tensor = ctx,
                   ) -> torch.Tensor:
                return tp.decode_attention(q, kc, vc, table, ctx, scale, **cfg)

            try:
                check(fn(), want, f"decode batch {batch} {cfg}")
                ms_graph = time_ms(fn, graph=True)
            except SystemExit:
                raise
            except Exception as e:  # a sweep config may not fit in shared memory
                print(f"decode batch {batch} {cfg}: skipped ({type(e).__name__})")
                continue
            if not cfg:
                ms = time_ms(fn)
                splits = tp.decode_num_splits(batch, NUM_KV_HEADS, table.shape[1], block_size, 64,
                                              torch.cuda.get_device_properties(0).multi_processor_count)
                rows.append(("decode", f"{batch}x{DECODE_CONTEXT}", f"splits={splits}",
                             f"{ms * 1e3:.1f}", f"{ms_graph * 1e3:.1f}",
                             f"{nbytes / ms_graph / 1e6:.0f} GB/s"))
            if best is None or ms_graph < best[0]:
                best = (ms_graph, str(cfg or "default"))
        if sweep and best is not None:
            rows.append(("decode best", f"{batch}x{DECODE_CONTEXT}", best[1], "", f"{best[0] * 1e3:.1f}",
                         f"{nbytes / best[0] / 1e6:.0f} GB/s"))
    return rows


def bench_prefill(dtype: torch.dtype, block_size: int, sweep: bool) -> list[tuple[str, ...]]:
    from rapidserve.attention import triton_paged as tp

    rows: list[tuple[str, ...]] = []
    scale = HEAD_DIM**-0.5
    for name, q_lens, prefixes in PREFILL_CASES:
        gen = torch.Generator().manual_seed(len(name))
        ctxs = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
        kc, vc, table = make_paged(ctxs, block_size, dtype, gen)
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
        meta = AttentionMetadata(True, torch.empty(0, dtype=torch.int64, device="cuda"), table,
                                 torch.tensor(ctxs, dtype=torch.int32, device="cuda"), cu,
                                 max(q_lens), max(ctxs))
        q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        want = ref.prefill_attention(q, kc, vc, meta, scale)
        flops = tp.prefill_flops(q_lens, prefixes, NUM_HEADS, HEAD_DIM)
        configs: list[dict[str, int | None]] = [{}]
        if sweep:
            configs += [{"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}
                        for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
        best: tuple[float, str] | None = None
        for cfg in configs:
            def fn(cfg: dict[str, int | None] = cfg, q: torch.Tensor = q, kc: torch.Tensor = kc,
                   vc: torch.Tensor = vc, meta: AttentionMetadata = meta) -> torch.Tensor:
                return tp.prefill_attention(q, kc, vc, meta, scale, **cfg)

            try:
                check(fn(), want, f"prefill {name} {cfg}")
                ms = time_ms(fn)
            except SystemExit:
                raise
            except Exception as e:
                print(f"prefill {name} {cfg}: skipped ({type(e).__name__})")
                continue
            if not cfg:
                rows.append(("prefill", name, "default", f"{ms * 1e3:.1f}", "",
                             f"{flops / ms / 1e9:.0f} TFLOP/s"))
            if best is None or ms < best[0]:
                best = (ms, str(cfg or "default"))
        if sweep and best is not None:
            rows.append(("prefill best", name, best[1], f"{best[0] * 1e3:.1f}", "",
                         f"{flops / best[0] / 1e9:.0f} TFLOP/s"))
        if all(p == 0 for p in prefixes) and len(set(q_lens)) == 1:  # torch SDPA on contiguous K/V
            qs = q.view(len(q_lens), q_lens[0], NUM_HEADS, HEAD_DIM).transpose(1, 2)
            ks = torch.randn(len(q_lens), NUM_KV_HEADS, q_lens[0], HEAD_DIM, device="cuda", dtype=dtype)
            ms = time_ms(lambda qs=qs, ks=ks: torch.nn.functional.scaled_dot_product_attention(
                qs, ks, ks, is_causal=True, enable_gqa=True))
            rows.append(("torch sdpa (contiguous)", name, "baseline", f"{ms * 1e3:.1f}", "",
                         f"{flops / ms / 1e9:.0f} TFLOP/s"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128])
    parser.add_argument("--sweep", action="store_true", help="also time other tile configurations")
    parser.add_argument("--only", choices=["decode", "prefill"], default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA or ROCm GPU")
    dtype = getattr(torch, args.dtype)
    rows: list[tuple[str, ...]] = []
    if args.only in (None, "decode"):
        rows += bench_decode(dtype, args.block_size, args.sweep)
    if args.only in (None, "prefill"):
        rows += bench_prefill(dtype, args.block_size, args.sweep)
    header = ("kernel", "shape", "config", "us (launch)", "us (graph)", "throughput")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{torch.cuda.get_device_name()}  {args.dtype}  block_size={args.block_size}  "
          f"Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM}")
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
