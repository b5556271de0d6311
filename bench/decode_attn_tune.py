"""Tune the Triton decode attention's launch table (rapidserve/attention/decode_config.py, DECODE_TABLE) on one GPU.

    python bench/decode_attn_tune.py --out $OUT [--kv auto,fp8] [--shapes 1x2048,16x2048,64x2048,16x8192]
                                     [--max-model-len 8192] [--block-size 16] [--quick]
    TRITON_INTERPRET=1 python bench/decode_attn_tune.py --dry-run --out DIR   # CPU: the whole flow, tiny shapes

Qwen3-8B's attention (32 q heads, 8 kv heads, head_dim 128), bf16 queries, pages of --block-size tokens handed out
shuffled, a block table as wide as --max-model-len (the decode graphs' width), every sequence at the shape's
context; for each KV cache (auto: bf16; fp8: the GPU's format, per-tensor scales) and each batch x context:

1. every tile candidate (`tile_candidates`: block_n x num_warps x num_stages x the block-table prefetch,
   `DecodeConfig.prefetch`; over an fp8 cache each with fp16 dots and a few with bf16 dots, `DecodeConfig.fp16_dots`)
   at the table's waves, every output checked against the torch reference before it is timed;
2. the TOP tiles (`rank`: the geometric mean over the shapes of each one's time over that shape's best) at each of
   WAVES (the split rule's programs per SM);
3. the engine's own launch (no override) as the row "default".

Timing: one CUDA graph of L launches over L layers' caches, L x a layer's K/V >= 2 GiB (no layer finds its K/V in
L2, as in a model's step), replayed 15 times after 3, median over L: microseconds a layer, split kernel and reduce.
Rates: a layer's K/V bytes over that time, against the copy ceiling (a 1 GiB device copy, read + write bytes, as
bench/model_runner.py) and the read ceiling (torch.sum of 1 GiB), measured in the same process.

Writes $OUT/decode_attn_tune.json (every row) and .md (again after each cache, so a run cut short keeps the caches
it finished), and prints last, per cache: each shape's default and best,
every tile at the table's waves, the top tiles at each waves, and the DECODE_TABLE entry best over all the shapes
(`pick_entry`: one entry serves every batch) to paste into rapidserve/attention/decode_config.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import time_ms  # noqa: E402

from rapidserve.attention import torch_ref as ref  # noqa: E402
from rapidserve.attention.decode_config import DecodeConfig, decode_config, launch_splits, table_key  # noqa: E402
from rapidserve.ops.kv_quant import FP8_KV_DTYPES, quantize  # noqa: E402

GiB = 1 << 30
WAVES = (1, 2, 3, 4, 6, 8)
TOP = 4
Row = dict[str, object]


def tile_candidates(size: str = "full") -> list[tuple[int, int, int, bool]]:
    """(block_n, num_warps, num_stages, prefetch) to time ("full": 42, "quick": 6, "dry": 2 for the interpreter): 32-128
    keys a tile, 2-8 warps (sm_90 compiles: 32 keys x 8 warps and 128 x 2 waste threads or registers); without the
    block-table prefetch 2, 3 and 5 stages (Triton 3.6 on sm_90: 2 loads the table in the tile's iteration, 3 and 4
    compile alike to one K/V buffer, 5 to two), with it 2-4 (s - 1 buffers; bench/results/decode_attn_compile/)."""
    if size == "dry":
        return [(16, 4, 2, False), (32, 4, 3, True)]
    if size == "quick":
        return [(32, 4, 2, False), (64, 4, 3, False), (64, 4, 5, False), (64, 4, 3, True), (64, 2, 3, True),
                (128, 4, 2, True)]
    pairs = ((32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8))
    stages = ((2, False), (3, False), (5, False), (2, True), (3, True), (4, True))
    return [(n, w, s, pf) for n, w in pairs for s, pf in stages]


def candidates(table: DecodeConfig, fp8: bool, size: str) -> list[DecodeConfig]:
    """Step 1's configurations: every tile at the table's waves; over an fp8 cache with fp16 dots, and with bf16
    dots for the table's tile and (but in a dry run) three others: the conversions' cost, `DecodeConfig.fp16_dots`."""
    out = [DecodeConfig(n, w, s, table.waves, fp8, pf) for n, w, s, pf in tile_candidates(size)]
    if fp8:
        slow = [(table.block_n, table.num_warps, table.num_stages, table.prefetch)]
        slow += [] if size == "dry" else [(64, 8, 3, False), (128, 4, 3, False), (64, 4, 3, True)]
        out += [DecodeConfig(n, w, s, table.waves, False, pf) for n, w, s, pf in dict.fromkeys(slow)]
    return out


def _key(cfg: DecodeConfig) -> str:
    return (f"n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} waves{cfg.waves}" + (" pf" if cfg.prefetch else "")
            + (" f16" if cfg.fp16_dots else ""))


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _ratios(rows: Sequence[Row]) -> dict[str, list[float]]:
    """Per configuration key: its time over the best time of each shape it was timed on."""
    best: dict[str, float] = {}
    for r in rows:
        best[str(r["shape"])] = min(best.get(str(r["shape"]), math.inf), float(r["us"]))  # type: ignore[arg-type]
    out: dict[str, list[float]] = {}
    for r in rows:
        out.setdefault(str(r["key"]), []).append(float(r["us"]) / best[str(r["shape"])])  # type: ignore[arg-type]
    return out


def rank(rows: Sequence[Row], shapes: int) -> list[tuple[float, str]]:
    """(geometric mean of time / the shape's best, key) of the configurations timed on all `shapes` shapes, best
    first (a configuration that failed on a shape is left out)."""
    return sorted((geomean(r), k) for k, r in _ratios(rows).items() if len(r) == shapes)


def pick_entry(rows: Sequence[Row], shapes: int) -> tuple[DecodeConfig, float, float] | None:
    """The configuration best over all the shapes (rank's first but "default", the engine's own launch), its
    geometric-mean slowdown against each shape's best and the default's (nan if it was not timed everywhere); None
    if no configuration was timed on every shape."""
    ranked = rank(rows, shapes)
    ours = [(x, k) for x, k in ranked if k != "default"]
    if not ours:
        return None
    ratio, key = ours[0]
    cfg = next(r["config"] for r in rows if r["key"] == key)
    return DecodeConfig(**cfg), ratio, next((x for x, k in ranked if k == "default"), math.nan)  # type: ignore[arg-type]


def layer_caches(batch: int, ctx: int, width: int, layers: int, block_size: int, dims: tuple[int, int, int],
                 cache: torch.dtype, scales: tuple[torch.Tensor, ...], device: str, gen: torch.Generator,
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """`layers` K/V caches of random values (an fp8 `cache` quantized with `scales`), one shuffled block table
    [batch, width] (spare entries point at block 0) and the context lengths."""
    _, hkv, d = dims
    need = -(-ctx // block_size)
    blocks = batch * need + 1
    perm = torch.randperm(blocks, generator=gen).to(torch.int32)
    table = torch.zeros(batch, width, dtype=torch.int32)
    for b in range(batch):
        table[b, :need] = perm[b * need:(b + 1) * need]
    shape = (blocks, hkv, block_size, d)

    def one(scale: torch.Tensor | None) -> torch.Tensor:
        x = torch.randn(shape, device=device)
        return quantize(x, cache, scale) if scale is not None else x.to(cache)

    caches = [(one(scales[0] if scales else None), one(scales[1] if scales else None)) for _ in range(layers)]
    return caches, table.to(device), torch.full((batch,), ctx, dtype=torch.int32, device=device)


def us_per_layer(call: Callable[[torch.Tensor, torch.Tensor], object],
                 caches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Microseconds of one call a layer: a CUDA graph of a call per layer (a dry run times its checking call
    instead: `bench_cache`)."""
    def step() -> None:
        for kc, vc in caches:
            call(kc, vc)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = statistics.median(time_ms(graph.replay, reps=15))
    del graph
    return ms * 1e3 / len(caches)


def ceilings(dry: bool) -> dict[str, float]:
    """Copy (read + write bytes of a 1 GiB device copy) and read (torch.sum of 1 GiB) rates, TB/s."""
    if dry:
        return {"copy_tbps": math.nan, "read_tbps": math.nan}
    src = torch.empty(GiB // 2, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    acc = torch.empty((), device="cuda", dtype=torch.float32)
    copy = statistics.median(time_ms(lambda: dst.copy_(src), reps=20))
    read = statistics.median(time_ms(lambda: torch.sum(src, 0, dtype=torch.float32, out=acc), reps=20))
    return {"copy_tbps": 2 * GiB / (copy * 1e-3) / 1e12, "read_tbps": GiB / (read * 1e-3) / 1e12}


def bench_cache(cache: torch.dtype, dtype: torch.dtype, shapes: list[tuple[int, int]], args: argparse.Namespace,
                dims: tuple[int, int, int], device: str, sms: int) -> list[Row]:
    """Steps 1-3 for one KV cache dtype: the rows of every timed configuration (or failure)."""
    from rapidserve.attention import triton_paged_decode as tp

    hq, hkv, d = dims
    fp8 = cache in FP8_KV_DTYPES
    hip = bool(torch.version.hip)
    table = decode_config(hip, dtype, fp8, d)
    sc = () if not fp8 else tuple(torch.tensor([6.0 / torch.finfo(cache).max], device=device) for _ in range(2))
    elem = torch.finfo(cache).bits // 8
    setups = {}
    for batch, ctx in shapes:
        layer_bytes = 2 * batch * ctx * hkv * d * elem
        layers = 1 if args.dry_run else max(2, min(64, -(-2 * GiB // layer_bytes)))
        width = -(-max(ctx, args.max_model_len) // args.block_size)
        gen = torch.Generator().manual_seed(batch * 131 + ctx)
        caches, bt, ctxs = layer_caches(batch, ctx, width, layers, args.block_size, dims, cache, sc, device, gen)
        q = torch.randn(batch, hq, d, device=device, generator=None).to(dtype)
        few = slice(0, min(batch, 4))
        want = ref.decode_attention(q[few], *caches[0], bt[few], ctxs[few], d**-0.5, *sc).float()
        setups[(batch, ctx)] = (caches, bt, ctxs, q, few, want, layer_bytes)
    rows: list[Row] = []

    def run(cfg: DecodeConfig | None, stage: str) -> None:
        kw = {} if cfg is None else {"config": cfg}
        for (batch, ctx), (caches, bt, ctxs, q, few, want, layer_bytes) in setups.items():
            used = cfg or table
            splits = launch_splits(batch, hkv, bt.shape[1], args.block_size, d, used, sms, hip)
            row: Row = {"cache": str(cache).removeprefix("torch."), "shape": f"{batch}x{ctx}", "stage": stage,
                        "config": used._asdict(), "key": "default" if cfg is None else _key(cfg), "splits": splits}

            def call(kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
                return tp.decode_attention(q, kc, vc, bt, ctxs, d**-0.5, *sc, **kw)  # noqa: B023 (called at once)
            try:
                t0 = time.perf_counter()
                got = call(*caches[0])
                eager_us = (time.perf_counter() - t0) * 1e6
                err = (got[few].float() - want).abs().max().item()
                if not err < 3e-2:
                    raise SystemExit(f"{row}: max abs error {err:.3g} against the torch reference; not timing it")
                # a dry run's time is that one eager call's (wall time under the interpreter: the flow, not a
                # measurement), not a second interpreted call
                us = eager_us if args.dry_run else us_per_layer(call, caches)
            except SystemExit:
                raise
            except Exception as e:  # noqa: BLE001 - a candidate may not fit (shared memory): say so, go on
                print(f"{row['cache']} {row['shape']} {row['key']}: skipped ({type(e).__name__}: {str(e)[:80]})")
                continue
            rows.append({**row, "us": us, "tbps": layer_bytes / (us * 1e-6) / 1e12})

    size = "dry" if args.dry_run else "quick" if args.quick else "full"
    run(None, "default")
    for cfg in candidates(table, fp8, size):
        run(cfg, "tile")
    tiles = [r for r in rows if r["stage"] == "tile"]
    top = [k for _, k in rank(tiles, len(shapes))[:1 if args.dry_run else TOP]]
    waves = (1, 2) if args.dry_run else WAVES
    for key in top:
        base = DecodeConfig(**next(r["config"] for r in tiles if r["key"] == key))  # type: ignore[arg-type]
        for w in waves:
            if w != base.waves:
                run(base._replace(waves=w), "waves")
    return rows


def report(rows: list[Row], ceil: dict[str, float], shapes: list[str], meta: dict[str, object]) -> str:
    """The markdown page: per cache, each shape's default and best, every tile, the top tiles' waves, the entry."""
    copy = ceil["copy_tbps"]
    lines = [f"# Decode attention launch tuning: {meta['gpu']} ({meta['date']})", "",
             f"Command: `{meta['command']}`. {meta['what']}. Copy ceiling {copy:.2f} TB/s, read ceiling "
             f"{ceil['read_tbps']:.2f} TB/s. Microseconds a layer (split kernel + reduce); TB/s of K/V read.", ""]
    for cache in dict.fromkeys(str(r["cache"]) for r in rows):
        mine = [r for r in rows if r["cache"] == cache]
        lines += [f"## KV cache {cache}", "", "| shape | default: us (splits) | TB/s | of copy | best: us | config "
                  "(splits) | of copy | best / default |", "|---|---|---|---|---|---|---|---|"]
        for shape in shapes:
            here = [r for r in mine if r["shape"] == shape]
            d = next((r for r in here if r["key"] == "default"), None)
            b = min(here, key=lambda r: float(r["us"]), default=None)  # type: ignore[arg-type]
            if d is None or b is None:
                continue
            lines.append(f"| {shape} | {d['us']:.1f} ({d['splits']}) | {d['tbps']:.2f} | {d['tbps'] / copy:.0%} | "
                         f"{b['us']:.1f} | {b['key']} ({b['splits']}) | {b['tbps'] / copy:.0%} | "
                         f"{float(b['us']) / float(d['us']):.2f} |")  # type: ignore[arg-type]
        for stage, title in (("tile", "every tile at the table's waves"), ("waves", "the top tiles at each waves")):
            keys = list(dict.fromkeys(str(r["key"]) for r in mine if r["stage"] == stage))
            lines += ["", f"{title} (us a layer):", "", "| config | " + " | ".join(shapes) + " |",
                      "|---|" + "---|" * len(shapes)]
            for k in keys:
                us = {r["shape"]: f"{r['us']:.1f}" for r in mine if r["key"] == k}
                lines.append(f"| {k} | " + " | ".join(us.get(s, "-") for s in shapes) + " |")
        picked = pick_entry(mine, len(shapes))
        if picked is not None:
            cfg, ratio, d_ratio = picked
            key = table_key(bool(torch.version.hip), torch.bfloat16, "float8" in cache, 128)
            lines += ["", f"Entry best over the shapes ({ratio:.3f}x each shape's best, geometric mean; the default "
                      f"{d_ratio:.3f}x):", "", "```", f"    {key}: {cfg!r},", "```"]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="auto,fp8", help="KV caches: auto (bf16) and/or fp8 (the GPU's format)")
    ap.add_argument("--shapes", default="1x2048,16x2048,64x2048,16x8192", help="batch x context, comma-separated")
    ap.add_argument("--max-model-len", type=int, default=8192, help="the block table's width in tokens")
    ap.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128])
    ap.add_argument("--quick", action="store_true", help="six tiles instead of 42")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter: tiny shapes, fp16 queries")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = ap.parse_args()
    kvs = args.kv.split(",")
    if not set(kvs) <= {"auto", "fp8"}:
        ap.error(f"--kv {args.kv!r}: use auto and/or fp8")
    try:
        shapes = [(int(b), int(c)) for b, c in (s.split("x") for s in args.shapes.split(","))]
    except ValueError:
        ap.error(f"--shapes {args.shapes!r}: use BATCHxCONTEXT,... (e.g. 16x2048)")
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--dry-run runs the kernels on the CPU: set TRITON_INTERPRET=1")
        device, dtype, dims, sms = "cpu", torch.float16, (8, 2, 32), 4  # the interpreter's bf16 dots are wrong
        shapes, args.max_model_len = [(1, 40), (3, 70)], 128
        fp8_format, gpu = torch.float8_e4m3fn, "CPU (Triton interpreter)"
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA or ROCm GPU (or --dry-run under TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        from rapidserve.ops.fp8 import fp8_dtype

        device, dtype, dims = "cuda", torch.bfloat16, (32, 8, 128)
        sms, fp8_format = torch.cuda.get_device_properties(0).multi_processor_count, fp8_dtype(torch.device("cuda"))
        gpu = torch.cuda.get_device_name(0)
    ceil = ceilings(args.dry_run)
    names = [f"{b}x{c}" for b, c in shapes]
    meta = {"gpu": gpu, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
            "command": "python bench/decode_attn_tune.py " + " ".join(sys.argv[1:]),
            "what": f"q heads {dims[0]}, kv heads {dims[1]}, head_dim {dims[2]}, {str(dtype).removeprefix('torch.')} "
                    f"q, block {args.block_size}, table {args.max_model_len} tokens wide, {sms} SMs"}
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for kv in kvs:
        rows += bench_cache(fp8_format if kv == "fp8" else dtype, dtype, shapes, args, dims, device, sms)
        (args.out / "decode_attn_tune.json").write_text(json.dumps({**meta, "ceilings": ceil, "rows": rows},
                                                                   indent=1))
        text = report(rows, ceil, names, meta)
        (args.out / "decode_attn_tune.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
