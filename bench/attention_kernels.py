"""GPU micro-benchmark of the paged-attention backends (Llama-3-8B / Qwen3-8B attention shapes).

    python bench/attention_kernels.py [--dtype bfloat16] [--kv-cache-dtype auto|fp8] [--block-size 16] [--sweep]
        [--json PATH]

Backends: rapidserve's Triton kernels and FlashAttention-3 (rapidserve/attention/fa3.py, when a build
is installed), both reading the paged pool; baselines on contiguous K/V: torch SDPA (its flash
kernel) and, for prefill, FA3's own varlen path. Decode: batches 1-256 at 4K, 8K and 16K contexts,
as GB/s of K+V read (one pass over every cached key and value), timed as a CUDA-graph replay (how the
engine runs it) and as a plain launch. Prefill: 4K, 8K and 16K prompts, a 2K chunk after a 14K
cached prefix and 8 x 1K, as TFLOP/s of causal attention,
FLOPs = 4 * sum_seqs(q_len * (q_len + 1) / 2 + q_len * prefix) * head_dim * num_heads.
Every kernel is checked against the torch reference before it is timed. "vs FA3" divides FA3's time
on the same shape by the row's. --sweep also times other Triton tile configurations. --kv-cache-dtype fp8: the paged
pool holds fp8 (the GPU's format, ops.fp8.fp8_dtype) with per-tensor scales, as the engine's with
--kv-cache-dtype fp8 (GB/s counts its one-byte elements; FA3 prefills it through its fp8 forward).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rapidserve.attention import AttentionMetadata  # noqa: E402
from rapidserve.attention import torch_ref as ref  # noqa: E402
from rapidserve.ops.kv_quant import FP8_KV_DTYPES as FP8  # noqa: E402
from rapidserve.ops.kv_quant import quantize  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B, Qwen3-8B
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (4096, 8192, 16384)
PREFILL_CASES = (("1x4096", [4096], [0]), ("1x8192", [8192], [0]), ("1x16384", [16384], [0]),
                 ("2048+14336", [2048], [14336]), ("8x1024", [1024] * 8, [0] * 8))
REF_LIMIT = 2**31 // 4  # the torch reference's score matrix; larger shapes are checked in slices


def make_paged(ctxs: list[int], block_size: int, dtype: torch.dtype, gen: torch.Generator,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A filled cache with shuffled block tables: (k_cache, v_cache, block_tables); an fp8 `dtype` holds unit-variance
    values quantized with the scales of `fp8_scales`."""
    needed = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(needed) + 8
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(ctxs), max(needed), dtype=torch.int32)
    nxt = 0
    for i, n in enumerate(needed):
        table[i, :n] = perm[nxt:nxt + n]
        nxt += n
    shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM)
    if dtype in FP8:
        ks, vs = fp8_scales(dtype)
        return (quantize(torch.randn(shape, device="cuda"), dtype, ks),
                quantize(torch.randn(shape, device="cuda"), dtype, vs), table.cuda())
    k = torch.randn(shape, device="cuda", dtype=dtype)
    v = torch.randn(shape, device="cuda", dtype=dtype)
    return k, v, table.cuda()


def fp8_scales(cache: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Per-tensor k/v scales of an fp8 cache (unit-variance data: its largest value at the format's largest), else
    ()."""
    if cache not in FP8:
        return ()
    s = torch.tensor([6.0 / torch.finfo(cache).max], device="cuda")
    return s, s.clone()


def check(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 3e-2) -> None:
    err = (got.float() - want.float()).abs().max().item()
    if not err < tol:
        raise SystemExit(f"{what}: max abs error {err:.3g} vs the torch reference; not timing a wrong kernel")


def time_ms(fn: Callable[[], object], graph: bool = False) -> float:
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, return_mode="median"))
    return float(triton.testing.do_bench(fn, return_mode="median"))


Row = dict[str, object]


def backends() -> dict[str, object]:
    """name -> object with prefill_attention / decode_attention (the paged backends measured)."""
    from rapidserve.attention import AttentionBackend, fa3, triton_paged_decode, triton_paged_prefill
    from rapidserve.ops import triton_kv

    found: dict[str, object] = {"triton": AttentionBackend("triton", triton_kv.write_kv,
                                                           triton_paged_prefill.prefill_attention,
                                                           triton_paged_decode.decode_attention)}
    try:
        kernel = fa3.find_fa3(torch.device("cuda"))
        found["fa3"] = fa3.Fa3Attention(kernel)
        print(f"FA3: {kernel.source}")
    except ImportError as e:
        print(f"FA3 not measured: {e}")
    return found


def _row(kind: str, backend: str, shape: str, config: str, ms: float | None, ms_graph: float | None,
         amount: float, unit: str) -> Row:
    best = ms_graph if ms_graph is not None else ms
    assert best is not None
    rate = amount / best / (1e6 if unit == "GB/s" else 1e9)
    return {"kind": kind, "backend": backend, "shape": shape, "config": config, "us": ms and ms * 1e3,
            "us_graph": ms_graph and ms_graph * 1e3, "rate": rate, "unit": unit}


def bench_decode(impls: dict[str, object], dtype: torch.dtype, block_size: int, sweep: bool,
                 cache: torch.dtype) -> list[Row]:
    from rapidserve.attention import triton_paged_decode as tp

    rows: list[Row] = []
    elem = torch.finfo(cache).bits // 8
    sc = fp8_scales(cache)
    scale = HEAD_DIM**-0.5
    for context, batch in itertools.product(DECODE_CONTEXTS, DECODE_BATCHES):
        gen = torch.Generator().manual_seed(batch)
        ctxs = [context] * batch
        kc, vc, table = make_paged(ctxs, block_size, cache, gen)
        ctx = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        few = slice(0, min(batch, 4))  # the reference is slow: check the first rows
        want = ref.decode_attention(q[few], kc, vc, table[few], ctx[few], scale, *sc)
        nbytes = 2 * sum(ctxs) * NUM_KV_HEADS * HEAD_DIM * elem
        shape = f"{batch}x{context}"
        for name, impl in impls.items():
            fn = functools.partial(impl.decode_attention, q, kc, vc, table, ctx, scale, *sc)  # type: ignore[attr-defined]

            check(fn()[few], want, f"{name} decode {shape}")
            rows.append(_row("decode", name, shape, "default", time_ms(fn), time_ms(fn, graph=True), nbytes, "GB/s"))
        if sweep:
            best: tuple[float, str] | None = None
            for n, w, st in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
                cfg = {"block_n": n, "num_warps": w, "num_stages": st}
                try:
                    out = tp.decode_attention(q, kc, vc, table, ctx, scale, *sc, **cfg)
                    check(out[few], want, f"decode {shape} {cfg}")
                    run = functools.partial(tp.decode_attention, q, kc, vc, table, ctx, scale, *sc, **cfg)
                    ms = time_ms(run, graph=True)
                except SystemExit:
                    raise
                except Exception as e:  # a sweep config may not fit in shared memory
                    print(f"decode {shape} {cfg}: skipped ({type(e).__name__})")
                    continue
                if best is None or ms < best[0]:
                    best = (ms, str(cfg))
            if best is not None:
                rows.append(_row("decode", "triton best", shape, best[1], None, best[0], nbytes, "GB/s"))
    return rows


def _checked_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata,
                       q_lens: list[int], scale: float, *sc: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """The torch reference on the last rows of the last sequence (small enough for its score matrix)."""
    n = min(q_lens[-1], 512)
    start = sum(q_lens) - n
    last = AttentionMetadata(True, meta.slot_mapping, meta.block_tables[-1:], meta.context_lens[-1:],
                             torch.tensor([0, n], dtype=torch.int32, device="cuda"), n, meta.max_context_len)
    return ref.prefill_attention(q[start:], kc, vc, last, scale, *sc), slice(start, None)


def bench_prefill(impls: dict[str, object], dtype: torch.dtype, block_size: int, sweep: bool,
                  cache: torch.dtype) -> list[Row]:
    from rapidserve.attention import triton_paged_prefill as tp

    rows: list[Row] = []
    scale = HEAD_DIM**-0.5
    sc = fp8_scales(cache)
    for name, q_lens, prefixes in PREFILL_CASES:
        gen = torch.Generator().manual_seed(len(name))
        ctxs = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
        kc, vc, table = make_paged(ctxs, block_size, cache, gen)
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
        meta = AttentionMetadata(True, torch.empty(0, dtype=torch.int64, device="cuda"), table,
                                 torch.tensor(ctxs, dtype=torch.int32, device="cuda"), cu,
                                 max(q_lens), max(ctxs))
        q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        want, rows_checked = _checked_reference(q, kc, vc, meta, q_lens, scale, *sc)
        flops = tp.prefill_flops(q_lens, prefixes, NUM_HEADS, HEAD_DIM)
        for backend, impl in impls.items():
            fn = functools.partial(impl.prefill_attention, q, kc, vc, meta, scale, *sc)  # type: ignore[attr-defined]

            # FA3's fp8 forward quantizes the query too (rapidserve/attention/fa3.py): its own rounding on top
            check(fn()[rows_checked], want, f"{backend} prefill {name}", 0.15 if sc and backend == "fa3" else 3e-2)
            rows.append(_row("prefill", backend, name, "paged", time_ms(fn), None, flops, "TFLOP/s"))
        if sweep:
            best: tuple[float, str] | None = None
            for m, n, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
                cfg = {"block_m": m, "block_n": n, "num_warps": w, "num_stages": st}
                try:
                    out = tp.prefill_attention(q, kc, vc, meta, scale, *sc, **cfg)
                    check(out[rows_checked], want, f"{name} {cfg}")
                    ms = time_ms(functools.partial(tp.prefill_attention, q, kc, vc, meta, scale, *sc, **cfg))
                except SystemExit:
                    raise
                except Exception as e:
                    print(f"prefill {name} {cfg}: skipped ({type(e).__name__})")
                    continue
                if best is None or ms < best[0]:
                    best = (ms, str(cfg))
            if best is not None:
                rows.append(_row("prefill", "triton best", name, best[1], best[0], None, flops, "TFLOP/s"))
        if all(p == 0 for p in prefixes) and len(set(q_lens)) == 1:  # torch SDPA on contiguous K/V
            qs = q.view(len(q_lens), q_lens[0], NUM_HEADS, HEAD_DIM).transpose(1, 2)
            ks = torch.randn(len(q_lens), NUM_KV_HEADS, q_lens[0], HEAD_DIM, device="cuda", dtype=dtype)
            ms = time_ms(lambda qs=qs, ks=ks: torch.nn.functional.scaled_dot_product_attention(
                qs, ks, ks, is_causal=True, enable_gqa=True))
            rows.append(_row("prefill", "torch sdpa", name, "contiguous", ms, None, flops, "TFLOP/s"))
    return rows


def with_ratios(rows: list[Row]) -> list[Row]:
    """Add "vs_fa3": FA3's time on the same kind and shape over the row's (above 1: faster than FA3)."""
    def t(r: Row) -> float:
        return float(r["us_graph"] if r["us_graph"] is not None else r["us"])  # type: ignore[arg-type]

    fa3_time = {(r["kind"], r["shape"]): t(r) for r in rows if r["backend"] == "fa3"}
    for r in rows:
        ref_t = fa3_time.get((r["kind"], r["shape"]))
        r["vs_fa3"] = None if ref_t is None else ref_t / t(r)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the paged pool's dtype: auto (--dtype) or fp8 (the GPU's format, per-tensor scales)")
    parser.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128])
    parser.add_argument("--sweep", action="store_true", help="also time other Triton tile configurations")
    parser.add_argument("--only", choices=["decode", "prefill"], default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA or ROCm GPU")
    dtype = getattr(torch, args.dtype)
    from rapidserve.ops.fp8 import fp8_dtype

    cache = fp8_dtype(torch.device("cuda")) if args.kv_cache_dtype == "fp8" else dtype
    impls = backends()
    fa3 = impls.get("fa3")
    if cache in FP8 and fa3 is not None and not fa3.takes_fp8(cache):  # type: ignore[attr-defined]
        print(f"FA3 not measured: {fa3.describe_kv(cache)}")  # type: ignore[attr-defined]
        del impls["fa3"]
    rows: list[Row] = []
    if args.only in (None, "decode"):
        rows += bench_decode(impls, dtype, args.block_size, args.sweep, cache)
    if args.only in (None, "prefill"):
        rows += bench_prefill(impls, dtype, args.block_size, args.sweep, cache)
    rows = with_ratios(rows)
    gpu = torch.cuda.get_device_name()
    if args.json:
        args.json.write_text(json.dumps({"gpu": gpu, "dtype": args.dtype, "kv_cache_dtype": str(cache),
                                         "block_size": args.block_size, "rows": rows}, indent=1))
    header = ("kernel", "backend", "shape", "config", "us (launch)", "us (graph)", "throughput", "vs FA3")
    table = [header] + [(
        str(r["kind"]), str(r["backend"]), str(r["shape"]), str(r["config"]),
        "" if r["us"] is None else f"{r['us']:.1f}", "" if r["us_graph"] is None else f"{r['us_graph']:.1f}",
        f"{r['rate']:.0f} {r['unit']}", "" if r["vs_fa3"] is None else f"{r['vs_fa3']:.2f}x") for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print(f"\n{gpu}  {args.dtype}  KV {cache}  block_size={args.block_size}  Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} "
          f"D={HEAD_DIM}")
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
