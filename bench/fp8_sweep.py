"""The fp8 model's part of bench/decode_profile.py (`--quantization fp8`): each fp8 projection alone at a decode batch,
and with `--sweep` the skinny fp8 kernel's tiles and the fused producers' row slices, whose best tiles become a table
(rapidserve/ops/fp8_tiles.py's format) for this GPU.

Per batch and projection (qkv, o, gate_up, down of the 36 layers; its rows quantized once, as the fused producers hand
them over): torch._scaled_mm (cuBLASLt), the engine's op (`ops.fp8_linear_rows`: `triton_fp8_skinny.plan`'s choice)
and, swept, every tile configuration of `candidates` (rows in one 16-, 32- or 64-row tile; BLOCK_N x BLOCK_K, warps,
stages; both operand orders; at most SMEM_LIMIT bytes of pipelined tiles; split-K, K cut into 2-8 slices where the grid
is thin), each checked against the reference on the first layer (one that cannot run or is wrong is listed, not timed)
and timed as one CUDA graph of the 36 layers' calls (distinct weights: none is re-read from L2), median replay. The
kernels are compiled first, in --jobs processes (Triton's on-disk cache). The table keeps, per (shape, batch), the
fastest of the candidates, the engine's current choice and torch._scaled_mm, the current choice unless another beats it
by MARGIN. The fused producers (`add_rms_norm_fp8` of the hidden rows, `silu_and_mul_fp8` of the MLP's) at each slice
width of SLICES: printed, for `triton_fp8_fused`'s constants. The sweep stops starting points at its deadline; points
not reached keep the current choice and are listed.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from gpu_timing import time_ms

from rapidserve.config import ModelConfig
from rapidserve.jsonfile import loads_unique
from rapidserve.ops import fp8, fp8_gpu, triton_fp8, triton_fp8_fused, triton_w8a16
from rapidserve.ops import triton_fp8_skinny as fsk
from rapidserve.ops.fp8 import Fp8Linear, QuantizedRows
from rapidserve.ops.fp8_tiles import (
    MAX_ROWS,
    SCALED_MM,
    Entry,
    Fp8Table,
    Fp8Tables,
    Fp8Tiles,
    file_name,
    parse_table,
    table_json,
)

LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
SMEM_LIMIT = 200 * 1024  # of the H100/H200's 227 KiB a block may take, with room for Triton's own
MARGIN = 0.02  # a swept choice replaces the current one only when this much faster
SPLITS = (2, 4, 8)  # K slices of the split-K candidates
MAX_SPLIT_PROGRAMS = 1024  # a split candidate's grid at most (about 8 programs an SM of the H100/H200's 132)
SLICES = (None, 1 << 30, 4096, 2048, 1024, 512)  # None: the rule (slice_cols); 1 << 30: one program a row
Calls = list[Callable[[], object]]


def shapes_of(cfg: ModelConfig) -> list[tuple[int, int]]:
    """[N, K] of LAYERS' weights (one rank: the whole model)."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def block_m(rows: int) -> int:
    """The smallest row tile that holds `rows` rows."""
    return next(b for b in (16, 32, 64) if rows <= b)


def candidates(rows: int, n: int, k: int) -> list[Fp8Tiles]:
    """The tiles swept for `rows` rows of an [n, k] weight: the untuned rule's (`rule_tiles`, first); the swapped
    order (the weight as wgmma's 64-tall operand: BLOCK_N 64 or 128) on the smallest row tile; x8 @ w8^T on a 64-row
    tile (wgmma with BLOCK_N 16-64: more programs); K steps of 128-512; 4 or 8 warps; 3-6 stages; pipelined tiles
    within SMEM_LIMIT and no larger than the weight; then `split_candidates`."""
    bm = block_m(rows)
    rule = fsk.rule_tiles(rows, n, k)
    out = []
    for bn, warps in ((64, 4), (128, 4), (128, 8)):
        out += [Fp8Tiles(bm, bn, bk, warps, st, True) for bk in (128, 256, 512) for st in (3, 4, 6)]
    out += [Fp8Tiles(64, bn, bk, 4, st, False) for bn in (16, 32, 64) for bk in (256, 512) for st in (3, 4)]
    out += split_candidates(rows, n, k)
    return [rule, *(t for t in dict.fromkeys(out) if t != rule and t.smem_bytes() <= SMEM_LIMIT and t.block_n <= n
                    and t.block_k <= max(k, 32))]


def split_candidates(rows: int, n: int, k: int) -> list[Fp8Tiles]:
    """The split-K tiles swept (ops/triton_fp8_skinny.py: K cut into slices, a second kernel adds them): SPLITS of
    each family on tiles with fewer stages and shorter K steps than the one-pass ones (a few programs an SM, each a
    slice of K): the swapped order (BLOCK_N 64 or 128, on the smallest row tile), x8 @ w8^T on a 16-row tile (1-16
    rows: mma.sync) or a 64-row one (17-64 rows: wgmma). Only where the grid stays within MAX_SPLIT_PROGRAMS and each
    slice takes at least two K steps (a thin grid over a long K: q|k|v, o and down of Qwen3-8B, and gate|up at 2)."""
    bm = block_m(rows)
    bases = [Fp8Tiles(bm, 64, 128, 4, 4, True), Fp8Tiles(bm, 64, 256, 4, 3, True), Fp8Tiles(bm, 128, 128, 4, 3, True)]
    bases += [Fp8Tiles(16, 32, 256, 4, 3), Fp8Tiles(16, 64, 256, 4, 3)] if rows <= 16 else [Fp8Tiles(64, 32, 256, 4, 3)]
    return [t._replace(split_k=s) for t in bases for s in SPLITS
            if -(-n // t.block_n) * s <= MAX_SPLIT_PROGRAMS and k >= 2 * s * t.block_k]


def graph_us(calls: Calls) -> float:
    """Microseconds per call of `calls` captured as one CUDA graph (after one eager pass, which compiles and raises
    here what cannot launch), median of 20 replays."""
    for f in calls[:2]:
        f()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    ms = statistics.median(time_ms(graph.replay, reps=20))
    del graph
    return ms * 1e3 / len(calls)


Clock = Callable[[Calls], float]


def _timed(calls: Calls, nbytes: int, clock: Clock) -> dict[str, Any]:
    try:
        us = clock(calls)
    except Exception as e:  # noqa: BLE001 - a candidate that cannot run (registers, shared memory) is a result
        if "CUDA" in str(e) and "out of resources" not in str(e):  # a device fault: nothing after it would run
            raise
        return {"error": f"{type(e).__name__}: {str(e)[:80]}"}
    return {"us_each": us, "tbps": nbytes / max(us * 1e-6, 1e-12) / 1e12}


def _rows(batch: int, k: int, fp8: torch.dtype, device: torch.device | str = "cuda",
          dtype: torch.dtype = torch.bfloat16) -> QuantizedRows:
    x = torch.randn(batch, k, device=device, dtype=dtype)
    return QuantizedRows(*triton_fp8.quantize_tokens(x, fp8), x.dtype)


def fp8_linears(model: Any, batch: int, sweep: bool, deadline: float, clock: Clock = graph_us,
                dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Each fp8 projection at `batch` rows of `dtype` over the model's layers (module docstring); with `sweep` every
    candidate until `deadline` (time.monotonic()); a point not reached says so. `clock`: microseconds per call of a
    list of calls (the CPU test's stands in for `graph_us`)."""
    out: dict[str, Any] = {}
    for name in LAYERS:
        layers: list[Fp8Linear] = [getattr(layer, name) for layer in model.layers]
        n, k = layers[0].weight.shape
        nbytes = sum(w.weight.numel() for w in layers) // len(layers)  # a call's fp8 weight bytes (TB/s per call)
        rows = _rows(batch, k, layers[0].weight.dtype, layers[0].weight.device, dtype)
        current = fsk.plan(batch, n, k, fsk.device_name(rows.q.device), fsk.TUNED)
        row: dict[str, Any] = {
            "shape": [n, k], "current": current.label() if current else SCALED_MM,
            "current_tiles": list(current) if current else None,
            "scaled_mm": _timed([lambda w=w, q=rows: fp8_gpu._scaled_mm(q.q, q.scale, w, q.dtype, None)
                                 for w in layers], nbytes, clock),
            "engine": _timed([lambda w=w, q=rows: model.ops.fp8_linear_rows(q, w, None) for w in layers], nbytes,
                             clock), **_w8a16(layers, batch, dtype, nbytes, clock)}
        if sweep and batch <= MAX_ROWS:
            if time.monotonic() > deadline:
                row["sweep"] = "not reached (--budget-s)"
            else:
                want = fp8.reference_linear_rows(rows._replace(dtype=torch.float32), layers[0])
                row["sweep"] = {t.label(): {"tiles": list(t), **(_wrong(rows, layers[0], t, want) or _timed(
                    [lambda w=w, t=t, q=rows: fsk.skinny_fp8_linear_rows(q, w.weight, w.weight_scale, None, config=t)
                     for w in layers], nbytes, clock))} for t in candidates(batch, n, k)}
        out[name] = row
    return out


def _w8a16(layers: list[Fp8Linear], batch: int, dtype: torch.dtype, nbytes: int, clock: Clock) -> dict[str, Any]:
    """W8A16's GEMM of `batch` float rows (ops/triton_w8a16.py) on the tiles its plan gives with it forced on this
    device (as if an NVIDIA GPU: the CPU test interprets it): {"w8a16": timing, "w8a16_tiles": label}; "-" where the
    plan keeps W8A8 (torch._scaled_mm, an unswapped 64-row tile)."""
    from rapidserve.ops.w8a16_table import W8a16Device, forced

    w = layers[0].weight
    n, k = w.shape
    dev = fsk.device_name(w.device)
    tiles = triton_w8a16.plan(batch, n, k, W8a16Device(dev, True), fsk.TUNED, forced(dev))
    if tiles is None:
        return {"w8a16": {"error": "-"}, "w8a16_tiles": None}
    x = torch.randn(batch, k, device=w.device, dtype=dtype)
    return {"w8a16_tiles": tiles.label(), "w8a16": _timed(
        [lambda lay=lay: triton_w8a16.w8a16_linear(x, lay.weight, lay.weight_scale, config=tiles) for lay in layers],
        nbytes, clock)}


def _wrong(rows: QuantizedRows, layer: Fp8Linear, tiles: Fp8Tiles, want: torch.Tensor) -> dict[str, str] | None:
    """{"error": ...} when `tiles` cannot run or give the reference's numbers (float32 products of the same fp8 rows;
    the bf16 output's rounding allowed), else None: a candidate is timed only once it is right."""
    try:
        got = fsk.skinny_fp8_linear_rows(rows, layer.weight, layer.weight_scale, None, config=tiles).float()
    except Exception as e:  # noqa: BLE001 - a candidate that cannot compile or launch is a result of the sweep
        if "CUDA" in str(e) and "out of resources" not in str(e):  # a device fault: nothing after it would run
            raise
        return {"error": f"{type(e).__name__}: {str(e)[:80]}"}
    err = float((got - want).abs().max())
    if err > 1e-2 * float(want.abs().max()) + 1e-3:
        return {"error": f"wrong result: max |error| {err:.3g}"}
    return None


def producers(model: Any, batch: int, clock: Clock = graph_us,
              dtype: torch.dtype = torch.bfloat16) -> dict[str, dict[str, Any]]:
    """The fused producers at `batch` rows of `dtype` at each slice width of SLICES (as many calls a graph as the
    model has layers: their inputs stay in L2, as the step's do, written just before)."""
    layer = model.layers[0]
    fp8, dev = layer.gate_up_proj.weight.dtype, layer.input_layernorm.device
    h = torch.randn(batch, layer.input_layernorm.shape[0], device=dev, dtype=dtype)
    r = torch.randn_like(h)
    g = torch.randn(batch, layer.gate_up_proj.weight.shape[0], device=dev, dtype=dtype)
    norm = layer.input_layernorm
    out: dict[str, dict[str, Any]] = {"add_rms_norm_fp8": {}, "silu_and_mul_fp8": {}}
    for width in SLICES:
        label = "rule" if width is None else "whole row" if width >= 1 << 30 else str(width)
        out["add_rms_norm_fp8"][label] = _timed([lambda w=width: triton_fp8_fused.add_rms_norm_fp8(
            h, r, norm, 1e-6, fp8, slice_width=w)] * len(model.layers), 0, clock)
        out["silu_and_mul_fp8"][label] = _timed([lambda w=width: triton_fp8_fused.silu_and_mul_fp8(
            g, fp8, slice_width=w)] * len(model.layers), 0, clock)
    return out


def _warm(jobs: list[tuple[int, int, Fp8Tiles]]) -> int:
    """Compile `jobs` (rows, K slices, tiles) in this process by launching each on small tensors of the same
    specialisation as the sweep's (the same rows; N, K and strides multiples of 16 that each tile divides, as
    Qwen3-8B's do; split-K: a K cut into as many slices as the sweep's, which the reduce kernel is specialised on):
    the kernels land in Triton's on-disk cache. Returns how many compiled."""
    ok = 0
    for rows, splits, t in jobs:
        n, k = 256, (splits * t.block_k if t.split_k > 1 else 1024)
        w = torch.zeros(n, k, device="cuda").to(torch.float8_e4m3fn)
        try:
            fsk.skinny_fp8_linear_rows(_rows(rows, k, w.dtype), w, torch.ones(n, device="cuda"), None, config=t)
            ok += 1
        except Exception:  # noqa: BLE001 - the sweep lists what cannot compile when it meets it
            continue
    torch.cuda.synchronize()
    return ok


def precompile(points: Iterable[tuple[int, int, int]], jobs: int) -> str:
    """Every candidate kernel of `points` (rows, n, k) compiled in `jobs` spawned processes; what happened."""
    todo = sorted({(rows, fsk.split_slices(k, t)[1], t) for rows, n, k in points for t in candidates(rows, n, k)},
                  key=str)
    t0 = time.perf_counter()
    chunks = [todo[i::jobs] for i in range(jobs)]
    try:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            done = sum(pool.map(_warm, chunks))
    except Exception as e:  # noqa: BLE001 - then the sweep compiles as it goes, only slower
        return f"parallel compile failed ({type(e).__name__}: {e}); compiling as the sweep goes"
    return f"compiled {done} of {len(todo)} kernels in {jobs} processes, {time.perf_counter() - t0:.0f} s"


def choose(row: dict[str, Any]) -> tuple[Entry, str] | None:
    """The table entry of one swept (shape, batch) and why: the fastest of the candidates, the engine's current
    choice and torch._scaled_mm, the current one unless beaten by MARGIN; None when no candidate ran."""
    swept = row.get("sweep")
    if not isinstance(swept, dict) or "us_each" not in row["engine"]:
        return None
    cur_us = row["engine"]["us_each"]
    options: list[tuple[float, Entry, str]] = [(v["us_each"], Fp8Tiles(*v["tiles"]), k)
                                               for k, v in swept.items() if "us_each" in v]
    if not options:  # no candidate ran
        return None
    if "us_each" in row["scaled_mm"]:
        options.append((row["scaled_mm"]["us_each"], SCALED_MM, SCALED_MM))
    us, entry, label = min(options, key=lambda o: o[0])
    if us >= cur_us * (1 - MARGIN):  # not clearly faster: keep what runs today
        cur = row["current_tiles"]
        keep: Entry = SCALED_MM if cur is None else Fp8Tiles(*cur)
        return keep, f"current {row['current']} kept ({cur_us:.1f} us; best {label} {us:.1f})"
    return entry, f"{label}: {us:.1f} us vs current {row['current']} {cur_us:.1f}"


def table_of(lin_by_batch: dict[int, dict[str, Any]], device: str, source: str) -> tuple[Fp8Table | None, list[str]]:
    """The tuned table of this sweep (None if nothing was swept) and one line per swept (shape, batch)."""
    shapes: dict[tuple[int, int], list[tuple[int, Entry]]] = {}
    notes = []
    for batch, lin in sorted(lin_by_batch.items()):
        for name, row in lin.items():
            picked = choose(row)
            if picked is None:
                notes.append(f"{name} {row['shape']} batch {batch}: not swept ({row.get('sweep', 'no --sweep')})")
                continue
            shapes.setdefault(tuple(row["shape"]), []).append((batch, picked[0]))
            notes.append(f"{name} {row['shape']} batch {batch}: {picked[1]}")
    if not shapes:
        return None, notes
    return Fp8Table(device, source, {s: tuple(e) for s, e in shapes.items()}), notes


def write_table(lin_by_batch: dict[int, dict[str, Any]], device: str, source: str, out: str | Path,
                repo_dir: Path | None, packaged: Fp8Tables | None = None) -> list[str]:
    """The table of `device` from the sweep (its swept shapes replacing theirs in the packaged table of the device,
    `packaged`: default the engine's), checked by parsing it back, written to <out>/fp8_configs/ and, given
    `repo_dir` (rapidserve/ops/fp8_configs/), there too; returns what was chosen and where it went."""
    table, notes = table_of(lin_by_batch, device, source)
    if table is None:
        return [*notes, "no fp8 table written: nothing was swept"]
    old = (fsk.TUNED if packaged is None else packaged).get(device)
    if old is not None:
        table = Fp8Table(device, table.source, {**old.shapes, **table.shapes})
    text = json.dumps(table_json(table), indent=1) + "\n"
    dirs = [Path(out) / "fp8_configs", *([repo_dir] if repo_dir is not None else [])]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / file_name(device)).write_text(text)
        path = str(d / file_name(device))
        parse_table(loads_unique(text, path), path)  # what the engine will load, or raise here
    return [*notes, "fp8 table written: " + ", ".join(str(d / file_name(device)) for d in dirs)]


def markdown(lin_by_batch: dict[int, dict[str, Any]], prod_by_batch: dict[int, dict[str, Any]]) -> list[str]:
    """The fp8 sections of decode_profile.md."""
    def cell(r: dict[str, Any]) -> str:
        return f"{r['us_each']:.1f} ({r['tbps']:.2f})" if "us_each" in r else r.get("error", "-")

    lines = []
    for b, lin in lin_by_batch.items():
        lines += [f"\n## fp8 projections alone at batch {b} (36 layers' weights in one graph; us per call, TB/s of "
                  "fp8 weights)\n", "| layer | [N, K] | torch._scaled_mm | engine (its choice) | best swept | "
                  "W8A16 (its tiles) |", "|---|---|---|---|---|---|"]
        for name, row in lin.items():
            best = "-"
            if isinstance(row.get("sweep"), dict):
                ok = {c: r for c, r in row["sweep"].items() if "us_each" in r}
                if ok:
                    c = min(ok, key=lambda c: ok[c]["us_each"])
                    best = f"{cell(ok[c])} {c}"
            elif "sweep" in row:
                best = row["sweep"]
            half = f"{cell(row['w8a16'])} {row.get('w8a16_tiles') or ''}" if "w8a16" in row else "-"
            lines.append(f"| {name} | {row['shape']} | {cell(row['scaled_mm'])} | {cell(row['engine'])} "
                         f"{row['current']} | {best} | {half.strip()} |")
    for b, prod in prod_by_batch.items():
        lines += [f"\n## fused producers at batch {b} (us per call by slice width)\n",
                  "| op | " + " | ".join(next(iter(prod.values()))) + " |", "|---|" + "---|" * len(SLICES)]
        for op, by in prod.items():
            lines.append(f"| {op} | " + " | ".join(f"{r['us_each']:.2f}" if "us_each" in r else "error"
                                                   for r in by.values()) + " |")
    return lines
