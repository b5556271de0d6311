"""Tune the fused MoE grouped GEMMs' tiles (issue 40, rapidserve/ops/triton_moe.py) on this GPU in one run, write them
as tables (rapidserve/ops/moe_tiles.py's format), and re-run bench/moe_gemm.py's table on them.

    python bench/moe_tune.py --out $OUT [--write-repo] [--models mixtral-8x7b,qwen3-30b-a3b] [--tp 1,2]
                             [--budget-s 330] [--jobs 14]
    TRITON_INTERPRET=1 python bench/moe_tune.py --dry-run --out DIR   # CPU: the whole flow on a tiny shape

Per model and TP slice (one layer, random weights), per token count T of 1..8192 (`moe_tune_space.TOKENS`, the
table's rows first), on T random tokens routed uniformly at random: each BLOCK_M candidate's alignment (at prefill
sizes also BLOCK_M 64 / 128 with a TAIL_BLOCK_M of 16 / 32: the alignment at the tail block and its block lists), then
each GEMM alone under each candidate tile (`moe_tune_space`: about 1000-1100 timed configurations a shape, split K
among them at decode sizes, TMA, persistent grids, chunked top-k sums and the tail blocks' two launches at prefill
sizes, 245 kernel launch variants in all (145 before the tail candidates), compiled first by --jobs processes into
Triton's cache), GROUP_M swept on the winners, the best BLOCK_M (and tail), and the
whole layer under it against the untuned rule (the rule is written where it is faster), and the alignment alone (its
share of the layer at decode sizes). The down GEMM's times include the top-k sum it now does in its own launch.
Timing: a CUDA graph of the launches over R routings (R = 8 at decode sizes: other experts each launch, so weights
come from HBM as in a model's step, not from L2), replayed 3-25 times (about 20 ms of each candidate), median. The
sweep stops starting points at --budget-s seconds after the start (default 330: with ~90 s of moe_gemm's table after
it, the run stays under 8 minutes on one H200); points not reached are listed and take their nearest tuned bucket.

Writes $OUT/moe_configs/*.json (one file per device, E, N, K, dtype; with --write-repo also into
rapidserve/ops/moe_configs/ for a commit), $OUT/moe_tune.json (every point: the times of the rule and the tuned
config), and prints the sweep's summary and, last, bench/moe_gemm.py's table on the new tables (at every TP size
tuned). --dry-run's shape is fixed: --models, --tp, --dtype, --jobs and --write-repo are refused with it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from multiprocessing import get_context
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import moe_gemm  # noqa: E402
from bench import moe_tune_space as space  # noqa: E402
from bench.gpu_timing import time_ms  # noqa: E402
from bench.moe_timing import copy_bandwidth, median  # noqa: E402
from rapidserve.loader.preset_table import preset_table  # noqa: E402
from rapidserve.ops.moe import Alignment, TailBlocks, route  # noqa: E402
from rapidserve.ops.moe_tiles import (  # noqa: E402
    CONFIG_DIR,
    GemmTiles,
    MoeKernelConfig,
    MoeTable,
    TableKey,
    config_json,
    file_name,
    load_tables,
    rule_config,
    table_json,
)
from rapidserve.ops.triton_moe import (  # noqa: E402
    align,
    align_tails,
    device_name,
    fused_moe,
    launch_down,
    launch_gate_up,
)
from rapidserve.ops.triton_moe_grid import m_lists  # noqa: E402

MIN_MS = 20.0  # measured GPU time per candidate
DEFAULT_MODELS, DEFAULT_TPS = "mixtral-8x7b,qwen3-30b-a3b", "1,2"  # --models, --tp
Clock = Callable[[Sequence[Callable[[], object]]], float]


@dataclass(frozen=True)
class Point:
    """One (shape, T) of the sweep: the layer's ms per launch under the rule and the tuned config, which was kept."""

    model: str
    tp: int
    tokens: int
    pairs: int
    per_expert: float
    rule_ms: float
    tuned_ms: float
    kept: str
    config: MoeKernelConfig
    align_ms: float  # the alignment alone under the kept BLOCK_M (part of both layer times)


def shape_of(model: str, tp: int) -> space.Shape:
    cfg = preset_table()[model]
    if cfg.moe is None or cfg.moe.intermediate_size % tp:
        raise SystemExit(f"{model} has no mixture-of-experts layer that splits {tp} ways")
    return space.Shape(model, tp, cfg.moe.num_experts, cfg.moe.intermediate_size // tp, cfg.hidden_size,
                       cfg.moe.top_k)


def gpu_clock(launches: Sequence[Callable[[], object]]) -> float:
    """ms per launch of a CUDA graph of `launches` (module docstring), after one eager pass (compiles, and raises
    here what cannot launch)."""
    for f in launches:
        f()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for f in launches:
            f()
    est = median(time_ms(graph.replay, 1, warmup=1))
    reps = max(3, min(25, int(MIN_MS / max(est, 1e-3))))
    ms = median(time_ms(graph.replay, reps, warmup=0))
    del graph
    return ms / len(launches)


def cpu_clock(launches: Sequence[Callable[[], object]]) -> float:
    t0 = time.perf_counter()
    for f in launches:
        f()
    return (time.perf_counter() - t0) * 1e3 / len(launches)


def timed(clock: Clock, launches: Sequence[Callable[[], object]], failed: list[str], what: str) -> float:
    """`clock(launches)`, or inf (and `what` in `failed`) when the candidate cannot compile or launch (a tile past
    the shared memory or registers of this GPU)."""
    try:
        return clock(launches)
    except Exception as e:  # noqa: BLE001 - a candidate that cannot run is a result of the sweep, listed by name
        if "CUDA" in str(e) or "HIP" in str(e):  # a device fault: the context is gone, nothing after it would run
            raise
        failed.append(f"{what}: {type(e).__name__}")
        return float("inf")


def aligned(ids: torch.Tensor, num_experts: int, block_m: int, tail: int) -> tuple[Alignment, TailBlocks | None]:
    """The alignment (and with a tail block its lists) a launch at (BLOCK_M, TAIL_BLOCK_M; 0: none) takes."""
    return align_tails(ids, num_experts, block_m, tail) if tail else (align(ids, num_experts, block_m), None)


def warm(jobs: list[tuple[str, int, int, GemmTiles, bool, int]], dtype: str) -> int:
    """Compile `jobs` (`moe_tune_space.compile_set`) in this process by launching each on tiny tensors of the same
    specialisation as the real ones (dims and strides multiples of 16, K = N = 512: at least two steps of every
    BLOCK_K, so a split tile splits here too): the kernels land in Triton's on-disk cache, where the sweep's first
    launch finds them. Returns how many compiled."""
    dt, dev = getattr(torch, dtype), torch.device("cuda")
    ok = 0
    for kernel, top_k, bm, tiles, even_k, tail in jobs:
        x = torch.randn(4, 512, dtype=dt, device=dev)
        weights, ids = route(torch.randn(4, 8, device=dev), top_k, True)
        al, tails = aligned(ids, 8, bm, tail)
        act = torch.randn(4 * top_k, 512, dtype=dt, device=dev)
        try:
            if kernel == "gate_up":
                launch_gate_up(x, torch.randn(8, 1024, 512, dtype=dt, device=dev) / 16, act, al, top_k, bm, tiles,
                               even_k, tails=tails)
            else:
                launch_down(act, torch.randn(8, 512, 512, dtype=dt, device=dev) / 16, torch.empty_like(x),
                            weights.reshape(-1).contiguous(), al, top_k, bm, tiles, even_k, tails=tails)
            ok += 1
        except Exception:  # noqa: BLE001 - the sweep lists what cannot compile when it meets it
            continue
    torch.cuda.synchronize()
    return ok


def precompile(shapes: list[space.Shape], dtype: str, jobs: int) -> None:
    todo = sorted(space.compile_set(shapes), key=str)
    t0 = time.perf_counter()
    chunks = [todo[i::jobs] for i in range(jobs)]
    try:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            done = sum(pool.map(warm, chunks, [dtype] * jobs))
        print(f"compiled {done} of {len(todo)} kernels in {jobs} processes, {time.perf_counter() - t0:.0f} s",
              flush=True)
    except Exception as e:  # noqa: BLE001 - then the sweep compiles on first use, only slower
        print(f"parallel compile failed ({type(e).__name__}: {e}); compiling as the sweep goes", flush=True)


def routings(tokens: int, shape: space.Shape, count: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(tokens)
    return [route(torch.randn(tokens, shape.num_experts, device=device, generator=g), shape.top_k, True)
            for _ in range(count)]


def tune_point(shape: space.Shape, tokens: int, w13: torch.Tensor, w2: torch.Tensor, clock: Clock, quick: bool,
               failed: list[str]) -> Point:
    """The sweep at one (shape, T) (module docstring); the chosen config and the times."""
    dev, dt, k = w13.device, w13.dtype, shape.top_k
    pairs = tokens * k
    count = 1 if quick else 8 if pairs <= 512 else 2 if pairs <= 4096 else 1
    routes = routings(tokens, shape, count, str(dev))
    x = torch.randn(tokens, shape.k, dtype=dt, device=dev)
    act = torch.randn(pairs, shape.n, dtype=dt, device=dev)
    out = torch.empty(tokens, shape.k, dtype=dt, device=dev)
    flat = [w.reshape(-1).contiguous() for w, _ in routes]
    groups = space.QUICK_GROUPS if quick else space.GROUPS
    best: dict[tuple[int, int], tuple[GemmTiles, float, GemmTiles, float]] = {}
    for bm, tail in space.m_candidates(space.per_expert(shape, tokens), quick):
        als = [aligned(ids, shape.num_experts, bm, tail) for _, ids in routes]
        m_blocks = max(experts.numel() for _, experts, *_ in m_lists(*als[0][:1], bm, als[0][1]))  # the larger launch
        # semaphores for any candidate (at most one a 16-wide n block of a tile or a token), zero; every launch
        # leaves them zero, so the launches of a graph and its replays share them
        sems = torch.zeros(max(m_blocks * -(-shape.n // 16), tokens * -(-shape.k // 16)), dtype=torch.int32,
                           device=dev)

        def gu(t: GemmTiles, als: list[tuple[Alignment, TailBlocks | None]] = als, bm: int = bm,
               sems: torch.Tensor = sems) -> list[Callable[[], object]]:
            return [partial(launch_gate_up, x, w13, act, al, k, bm, t, sems=sems, tails=tails) for al, tails in als]

        def dn(t: GemmTiles, als: list[tuple[Alignment, TailBlocks | None]] = als, bm: int = bm,
               sems: torch.Tensor = sems) -> list[Callable[[], object]]:
            return [partial(launch_down, act, w2, out, f, al, k, bm, t, sems=sems, tails=tails)
                    for f, (al, tails) in zip(flat, als, strict=True)]

        winners = []
        for cands, launches, name in ((space.gate_up_candidates(bm, quick), gu, "gate_up"),
                                      (space.down_candidates(bm, quick), dn, "down")):
            m_name = f"bm{bm}" + (f"+tail{tail}" if tail else "")
            times = {t: timed(clock, launches(t), failed, f"{shape.model} tp{shape.tp} T={tokens} {name} {m_name} {t}")
                     for t in cands}
            win = space.fastest(times)
            seen = {min(win.group_m, m_blocks)}  # GROUP_M past the m-block count is the same order
            for g in space.other_groups(groups):
                if min(g, m_blocks) not in seen:
                    seen.add(min(g, m_blocks))
                    t = space.with_group(win, g)
                    times[t] = timed(clock, launches(t), failed, f"{name} {m_name} {t}")
            win = space.fastest(times)
            winners.append((win, times[win]))
        best[bm, tail] = (winners[0][0], winners[0][1], winners[1][0], winners[1][1])
    rule = rule_config(pairs, shape.num_experts, torch.version.hip is not None)
    tuned = space.choose(best) or rule
    try:
        if not quick:  # (the dry run's final table checks the same config at the same T)
            moe_gemm.check(x[:64], w13, w2, routes[0][0][:64], routes[0][1][:64], tuned)
    except SystemExit as e:  # wrong results under these tiles: listed, and the rule kept
        failed.append(f"{shape.model} tp{shape.tp} T={tokens} {describe(tuned)}: {e}")
        tuned = rule
    layer = {name: timed(clock, [partial(fused_moe, x, w13, w2, w, ids, cfg) for w, ids in routes], failed,
                         f"{shape.model} tp{shape.tp} T={tokens} layer {name} {describe(cfg)}")
             for name, cfg in (("tuned", tuned), ("rule", rule))}
    keep = tuned if layer["tuned"] <= layer["rule"] else rule
    align_ms = timed(clock, [partial(aligned, ids, shape.num_experts, keep.block_m, keep.tail_m) for _, ids in routes],
                     failed, f"{shape.model} tp{shape.tp} T={tokens} align")
    return Point(shape.model, shape.tp, tokens, pairs, space.per_expert(shape, tokens), layer["rule"],
                 layer["tuned"], "tuned" if keep is tuned else "rule", keep, align_ms)


def describe(c: MoeKernelConfig) -> str:
    def t(g: GemmTiles) -> str:
        return (f"{g.block_n}x{g.block_k} g{g.group_m} w{g.num_warps} s{g.num_stages}"
                + (f" k{g.split_k}" if g.split_k > 1 else "") + (" tma" if g.tma else "")
                + (f" p{g.persistent}" if g.persistent else "") + (f" r{g.reduce_n}" if g.reduce_n else ""))
    return f"M{c.block_m}{f' tail{c.tail_m}' if c.tail_m else ''} gate_up {t(c.gate_up)} / down {t(c.down)}"


def summary(points: list[Point]) -> str:
    out = ["| model | tp | tokens | pairs/expert | rule us | tuned us | speedup | align us | kept | config |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (p.model, p.tp, p.tokens)):
        out.append(f"| {p.model} | {p.tp} | {p.tokens} | {p.per_expert:g} | {p.rule_ms * 1e3:.1f} | "
                   f"{p.tuned_ms * 1e3:.1f} | {p.rule_ms / min(p.rule_ms, p.tuned_ms):.2f} | {p.align_ms * 1e3:.1f} | "
                   f"{p.kept} | {describe(p.config)} |")
    return "\n".join(out)


def tables_of(points: list[Point], shapes: list[space.Shape], dev: str, dtype: str, source: str) -> list[MoeTable]:
    out = []
    for s in shapes:
        mine = sorted((p.per_expert, p.config) for p in points if (p.model, p.tp) == (s.model, s.tp))
        if mine:
            out.append(MoeTable(TableKey(dev, s.num_experts, s.n, s.k, dtype), source, tuple(mine)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help="folder for moe_configs/ and moe_tune.json (default $OUT)")
    ap.add_argument("--models", default=None, help=f"comma-separated MoE presets (default {DEFAULT_MODELS})")
    ap.add_argument("--tp", default=None, help=f"comma-separated TP sizes whose slices to tune (default {DEFAULT_TPS})")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float16"), help="default bfloat16")
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no sweep point after this many seconds")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes compiling the kernels before the sweep (0: compile as the sweep goes; default "
                    "min(14, the CPUs))")
    ap.add_argument("--write-repo", action="store_true", help=f"also write the tables into {CONFIG_DIR}")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter: tiny-qwen3-moe, float16, "
                    "two tiles a GEMM, one token count, and a one-row table: checks the flow, measures nothing")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    if args.out is None:
        ap.error("--out is required (or set $OUT)")
    quick = args.dry_run
    if quick:
        # the dry run's shape is fixed: a flag that would choose another is refused, not silently ignored
        fixed = [flag for flag, v in (("--models", args.models), ("--tp", args.tp), ("--dtype", args.dtype),
                                      ("--jobs", args.jobs), ("--write-repo", args.write_repo or None))
                 if v is not None]
        if fixed:
            ap.error(f"--dry-run tunes tiny-qwen3-moe at TP 1 in float16 on the CPU, writing only --out: drop "
                     f"{', '.join(fixed)}")
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--dry-run runs the kernels on the CPU: set TRITON_INTERPRET=1")
        device, dtype_name, models, tps, clock = "cpu", "float16", ["tiny-qwen3-moe"], [1], cpu_clock
    else:
        try:  # the flags first: a bad one is refused by name on any machine
            models = moe_gemm.parse_models(args.models or DEFAULT_MODELS)
            tps = moe_gemm.parse_tps(args.tp or DEFAULT_TPS, models)
        except ValueError as e:
            ap.error(str(e))
        if not torch.cuda.is_available():
            print("needs a CUDA or ROCm GPU (or --dry-run under TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        device, dtype_name, clock = "cuda", args.dtype or "bfloat16", gpu_clock
    dtype = getattr(torch, dtype_name)
    shapes = [shape_of(m, tp) for m in models for tp in tps]
    dev_name = device_name(torch.device(device))
    print(f"{dev_name}: {len(shapes)} shapes, timed configs per shape "
          f"{[space.space_size(s, quick) for s in shapes]}, {len(space.compile_set(shapes, quick))} compiles",
          flush=True)
    jobs = min(14, os.cpu_count() or 1) if args.jobs is None else args.jobs
    if device == "cuda" and jobs > 0:
        precompile(shapes, dtype_name, jobs)
    points: list[Point] = []
    failed: list[str] = []
    skipped: list[str] = []
    tokens = space.QUICK_TOKENS if quick else space.TOKENS
    for s in shapes:
        _, w13, w2, _, _ = moe_gemm.layer(s.model, s.tp, dtype, device)
        for t in tokens:
            if time.perf_counter() - start > args.budget_s:
                skipped.append(f"{s.model} tp{s.tp} T={t}")
                continue
            points.append(tune_point(s, t, w13, w2, clock, quick, failed))
            print(f"{s.model} tp{s.tp} T={t}: {describe(points[-1].config)} ({points[-1].kept}), "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
        del w13, w2
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"bench/moe_tune.py on {dev_name}, {stamp}, torch {torch.__version__}, triton {triton.__version__}"
              f"{', dry run' if quick else ''}")
    folders = [args.out / "moe_configs"] + ([CONFIG_DIR] if args.write_repo else [])  # never with --dry-run
    written = tables_of(points, shapes, dev_name, dtype_name, source)
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        for t in written:
            (folder / file_name(t.key)).write_text(json.dumps(table_json(t), indent=1) + "\n")
    loaded = load_tables(args.out / "moe_configs")  # the files as the engine reads them: validated
    assert {t.key for t in written} <= set(loaded), "a written table did not load back"
    (args.out / "moe_tune.json").write_text(json.dumps(
        {"device": dev_name, "source": source, "skipped": skipped, "failed": failed,
         "points": [{**asdict(p), "config": config_json(p.config)} for p in points]}, indent=1))
    print(f"\nsweep: {len(points)} points in {time.perf_counter() - start:.0f} s; not reached (budget): "
          f"{skipped or 'none'}; candidates that could not run: {len(failed)}")
    print(summary(points) + "\n")
    copy_bw = copy_bandwidth(device, 1 << 20 if quick else 1 << 29)
    sizes = {"prefill_tokens": (4,), "decode_batches": (1,), "reps": (1, 1)} if quick else {}
    # at every TP size tuned: the check's rows are those of the tables this run wrote (before 2026-11-30 it timed
    # tp 1 only, so a --tp 2 run printed tp 1 rows on the untuned rule: the folder held no tp 1 table)
    rows = [r for m in models for tp in tps
            for r in moe_gemm.bench_model(m, tp, dtype, copy_bw, loaded, device, **sizes)]
    (args.out / "moe_gemm.json").write_text(json.dumps({"device": dev_name, "copy_bw": copy_bw, "rows": rows},
                                                       indent=1))
    print(f"bench/moe_gemm.py on the tuned tables ({time.perf_counter() - start:.0f} s in all)\n")
    print(moe_gemm.table(rows, copy_bw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
