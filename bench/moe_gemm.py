"""GPU micro-benchmark of the fused MoE experts (issue 40, rapidserve/ops/triton_moe.py) on one layer of a real
MoE preset (random weights; tokens routed uniformly at random, as load-balanced routers aim for).

    python bench/moe_gemm.py [--models mixtral-8x7b,qwen3-30b-a3b] [--tp 1[,2]] [--dtype bfloat16] [--json PATH]
                             [--tables DIR]

Prefill (T tokens, T*k pairs): the grouped GEMMs (alignment, gate|up with SiLU-and-mul, down with the routing
weights, the k-way sum) as TFLOP/s of the experts' work, 6*T*k*h*I flops, against the dense GEMM rate of the same
work on cuBLAS (one [T*k, h] x [h, 2I] and one [T*k, I] x [I, h] GEMM through every pair: the rate a perfectly
balanced grouped GEMM could reach), both timed as CUDA-graph replays: the GPU's time. "eager ms": `fused_moe` called
back to back from Python (`back_to_back_ms`), the rate of the engine's eager prefill, whose host path (five Triton
launches and a few allocations) bounds it where the kernels take less (at 256-1024 tokens, before this column, the
table's times were those of single eager calls from an idle GPU: the host's). "align / gate_up / down us": each
launch alone in a graph (the alignment on the path `fused_moe` takes; gate|up and down on that alignment). "bound
ms": what a grouped GEMM cannot beat, the larger of the dense time (the same flops at the dense rate) and the
compulsory bytes (the weights of every expert the routing reads, x read, out written) over the copy bandwidth;
"bound by" says which; "of bound" = bound / graph ms. At short prefills of many experts the weights' bytes set it
(Qwen3-30B-A3B reads all 128 experts, 1.2 GB at tp 1, from 256 tokens on), so "vs dense" cannot reach 1 there
however good the kernels.

Decode (batch B): the step's experts as a CUDA-graph replay (how the engine
runs them) and as plain launches, against the copy ceiling: the bytes of the experts this batch's routing actually
reads (its unique experts x 3*h*I*dtype) over the device's copy bandwidth (read+write bytes of a 1 GiB copy per
second). "of ceiling" = ceiling time / measured time. Tiles: the
packaged tuned tables (`ops.moe_tiles`), or those in --tables DIR (bench/moe_tune.py's output), else the rule; the
BLOCK_M column names the tiles used, "(rule)" where no table of this shape and device was there (the decode table
marks its tp column). "align us": the alignment alone (ops/triton_moe_align.py) under that BLOCK_M,
per call in a CUDA graph of ALIGN_CALLS calls, on each of its paths: one program / two launches (the one-program
path only up to ONE_PROGRAM_MAX pairs; `*` marks the path `fused_moe` takes, ALIGN_ONE_PROGRAM pairs the switch;
under a TAIL_BLOCK_M the two launches alone, at the tail block and writing the block lists: fused_moe's path there).
"no PDL us" (decode): "graph us" with programmatic dependent launch off (`rapidserve.ops.pdl.use_pdl`: on by default on
Hopper and later, so gate|up and down start before the launch before them ends), the A/B of that overlap.
"layer us" (decode): the whole MoE block as the model runs it, in a CUDA graph: the router's GEMM, then
`routed_moe` (routing + alignment in one launch at decode sizes, gate|up, down with the top-k sum); "graph us" is
`fused_moe` from a given routing (the alignment, gate|up, down), the issue's measure. "route+align us": the routing
and alignment launch alone (`triton_moe_route.route_align`), per call in a graph of ALIGN_CALLS.
Each shape is checked against the torch reference before it is timed. The table comes last. `bench_model` also runs
on the CPU under the Triton interpreter (bench/moe_tune.py --dry-run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe_timing import back_to_back_ms, copy_bandwidth, graph_ms, median, timer  # noqa: E402
from rapidserve.loader.preset_table import preset_table  # noqa: E402
from rapidserve.ops import torch_ops  # noqa: E402
from rapidserve.ops.moe import moe_experts_ref, moe_layer_ref, route  # noqa: E402
from rapidserve.ops.moe_plan import semaphores  # noqa: E402
from rapidserve.ops.moe_tiles import MoeKernelConfig, MoeTables, load_tables  # noqa: E402
from rapidserve.ops.triton_moe import (  # noqa: E402
    ALIGN_ONE_PROGRAM,
    TUNED,
    align,
    align_tails,
    fused_moe,
    launch_down,
    launch_gate_up,
    moe_config,
    routed_moe,
    table_key,
)
from rapidserve.ops.triton_moe_align import empty_tails  # noqa: E402
from rapidserve.ops.triton_moe_route import route_align  # noqa: E402

PREFILL_TOKENS = (256, 1024, 4096, 8192)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
ALIGN_CALLS = 8  # alignments a timed graph holds (the replay's own cost spread over them)
ONE_PROGRAM_MAX = 4096  # pairs above which the one-program alignment is not timed (it is serial over the pairs)


def moe_presets() -> list[str]:
    """The presets with a mixture-of-experts layer: what --models may name."""
    return sorted(name for name, cfg in preset_table().items() if cfg.moe is not None)


def parse_models(text: str, allowed: list[str] | None = None, kind: str = "mixture-of-experts") -> list[str]:
    """--models: comma-separated presets of `allowed` (default the MoE presets; `kind` names them in the message),
    each once; ValueError naming what is allowed otherwise."""
    allowed = moe_presets() if allowed is None else allowed
    models = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in models if m not in allowed]
    if not models or bad or len(set(models)) != len(models):
        why = f"{', '.join(bad)} not a {kind} preset" if bad else "empty or repeated"
        raise ValueError(f"--models {text!r}: {why}; allowed (comma-separated): {', '.join(allowed)}")
    return models


def parse_tps(text: str, models: list[str]) -> list[int]:
    """--tp: comma-separated TP sizes >= 1 that split every model's expert intermediate size evenly."""
    try:
        tps = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--tp {text!r}: comma-separated whole numbers >= 1 (e.g. 1,2)") from None
    if not tps or min(tps) < 1 or len(set(tps)) != len(tps):
        raise ValueError(f"--tp {text!r}: comma-separated whole numbers >= 1, each once (e.g. 1,2)")
    for m in models:
        size = preset_table()[m].moe.intermediate_size  # type: ignore[union-attr]  # parse_models: MoE only
        odd = [t for t in tps if size % t]
        if odd:
            raise ValueError(f"--tp {text!r}: {m}'s expert intermediate size {size} does not split "
                             f"{', '.join(map(str, odd))} ways; use sizes that divide it")
    return tps


def read_tables_dir(folder: Path) -> MoeTables:
    """--tables: a folder holding at least one tuned table (bench/moe_tune.py's moe_configs/), validated; a missing
    or empty folder is refused (it would time the untuned rule under the name of tuned tables)."""
    if not folder.is_dir():
        raise ValueError(f"--tables {folder}: no such folder; give bench/moe_tune.py's --out DIR/moe_configs")
    tables = load_tables(folder)
    if not tables:
        raise ValueError(f"--tables {folder}: holds no table (*.json named E=...,N=...,K=...,device_name=...,"
                         f"dtype=....json); give bench/moe_tune.py's --out DIR/moe_configs")
    return tables


def layer(model: str, tp: int, dtype: torch.dtype, device: str = "cuda",
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(router [E, h], w13 [E, 2I', h], w2 [E, h, I'], top_k, hidden) of one layer of `model` at tp's share."""
    cfg = preset_table()[model]
    moe = cfg.moe
    if moe is None:
        raise SystemExit(f"{model} is not a mixture-of-experts preset")
    e, h, i = moe.num_experts, cfg.hidden_size, moe.intermediate_size // tp
    g = torch.Generator(device=device).manual_seed(0)
    router = (torch.randn(e, h, device=device, generator=g) / h**0.5).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, device=device, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=device, generator=g) / i**0.5).to(dtype)
    return router, w13, w2, moe.top_k, h


def check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
          config: MoeKernelConfig | None = None, tables: MoeTables | None = None) -> None:
    got = fused_moe(x, w13, w2, weights, ids, config, tables).float()
    want = moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    err = float((got - want).abs().max() / want.abs().max())
    if not err < 3e-2:
        raise SystemExit(f"fused_moe disagrees with the reference: relative error {err:.3g} at {tuple(x.shape)} "
                         f"({config or 'tables'})")


def check_layer(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                tables: MoeTables | None = None) -> None:
    """`routed_moe` (the routing in the kernels) against the torch routing and reference experts."""
    logits = F.linear(x, router)
    got = routed_moe(x, logits, w13, w2, top_k, True, None, tables).float()
    want = moe_layer_ref(x.float(), logits, w13.float(), w2.float(), top_k, True)
    err = float((got - want).abs().max() / want.abs().max())
    if not err < 3e-2:
        raise SystemExit(f"routed_moe disagrees with the reference: relative error {err:.3g} at {tuple(x.shape)}")


def experts_read(ids: torch.Tensor, w13: torch.Tensor) -> tuple[int, int]:
    """(unique experts, bytes of their weights) that the routing `ids` makes the experts read: each chosen expert's
    gate|up and down, 3*h*I elements of w13's dtype."""
    unique = int(torch.unique(ids).numel())
    h, i = w13.shape[2], w13.shape[1] // 2
    return unique, unique * 3 * h * i * w13.element_size()


def decode_ceiling_ms(read: int, copy_bw: float) -> float:
    """The copy ceiling of a decode step (module docstring): `read` bytes of expert weights at the copy bandwidth."""
    return read / copy_bw * 1e3


def prefill_bound(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, copy_bw: float,
                  reps: int, device: str, g: torch.Generator) -> dict[str, object]:
    """The bound of a prefill (module docstring): "dense_ms" (the same flops as one dense gate|up and down GEMM pair
    on cuBLAS through all T*k pairs, a CUDA-graph replay; its input drawn from `g`), "bytes_read" (the chosen
    experts' weights), "bound_ms" = max(dense_ms, (bytes_read + x read + out written) at the copy bandwidth) and
    "bound_by" ("flops" or "bytes")."""
    t, h = x.shape
    xs = torch.randn(t * ids.shape[1], h, device=device, dtype=x.dtype, generator=g)
    dense_ms = graph_ms(lambda: F.linear(torch_ops.silu_and_mul(F.linear(xs, w13[0])), w2[0]), reps, device)
    _, read = experts_read(ids, w13)
    bytes_ms = (read + 2 * x.numel() * x.element_size()) / copy_bw * 1e3
    return {"dense_ms": dense_ms, "bytes_read": read, "bound_ms": max(dense_ms, bytes_ms),
            "bound_by": "bytes" if bytes_ms > dense_ms else "flops"}


def gemm_parts_ms(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  cfg: MoeKernelConfig, reps: int, device: str) -> tuple[float, float]:
    """(gate|up, down) ms, each GEMM alone in a graph on one alignment of `ids` under cfg (`graph_ms`; with
    TAIL_BLOCK_M its two launches, on the alignment at the tail block and its lists)."""
    t, h = x.shape
    e, inter, k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    al, tails = align_tails(ids, e, cfg.block_m, cfg.tail_m) if cfg.tail_m else (align(ids, e, cfg.block_m), None)
    gate_up, down = semaphores(cfg, t, k, e, inter, h)
    sems = torch.zeros(gate_up + down + 1, dtype=torch.int32, device=device)  # left zero by every launch
    act = torch.empty(t * k, inter, dtype=x.dtype, device=device)
    out = torch.empty_like(x)
    flat = weights.reshape(-1).contiguous()
    gu_ms = graph_ms(lambda: launch_gate_up(x, w13, act, al, k, cfg.block_m, cfg.gate_up, sems=sems[:gate_up + 1],
                                            tails=tails), reps, device)
    dn_ms = graph_ms(lambda: launch_down(act, w2, out, flat, al, k, cfg.block_m, cfg.down, sems=sems[gate_up:],
                                         tails=tails), reps, device)
    return gu_ms, dn_ms


def align_us(ids: torch.Tensor, num_experts: int, cfg: MoeKernelConfig, reps: int, device: str) -> dict[str, object]:
    """The alignment alone under cfg, microseconds per call on each path (module docstring), and the path fused_moe
    takes. With a TAIL_BLOCK_M only the two launches, at the tail block and writing the block lists
    (`align_tails`): fused_moe takes them whatever the pairs (the one program has no lists)."""
    if cfg.tail_m:
        calls = lambda: [align_tails(ids, num_experts, cfg.block_m, cfg.tail_m) for _ in range(ALIGN_CALLS)]
        return {"align_path": "two", "align_one_us": None,
                "align_two_us": graph_ms(calls, reps, device) * 1e3 / ALIGN_CALLS}
    out: dict[str, object] = {"align_path": "one" if ids.numel() <= ALIGN_ONE_PROGRAM else "two"}
    for name, one in (("one", True), ("two", False)):
        if one and ids.numel() > ONE_PROGRAM_MAX:
            out[f"align_{name}_us"] = None
            continue
        calls = lambda one=one: [align(ids, num_experts, cfg.block_m, one) for _ in range(ALIGN_CALLS)]
        out[f"align_{name}_us"] = graph_ms(calls, reps, device) * 1e3 / ALIGN_CALLS
    return out


def route_align_us(logits: torch.Tensor, top_k: int, cfg: MoeKernelConfig, reps: int, device: str) -> float:
    """The routing + alignment launch(es) `routed_moe` takes under cfg (with a TAIL_BLOCK_M: `route` then the two
    launches at the tail block, writing the block lists), microseconds per call in a graph of ALIGN_CALLS."""
    t, e = logits.shape

    def one() -> object:
        if not cfg.tail_m:
            return route_align(logits, top_k, True, cfg.block_m)
        tails = empty_tails(t * top_k, e, cfg.block_m, cfg.tail_m, logits.device)
        return route_align(logits, top_k, True, cfg.tail_m, tails=tails)

    calls = lambda: [one() for _ in range(ALIGN_CALLS)]
    return graph_ms(calls, reps, device) * 1e3 / ALIGN_CALLS


def align_cell(r: dict[str, object]) -> str:
    def one(name: str) -> str:
        v = r[f"align_{name}_us"]
        return "-" if v is None else f"{float(v):.1f}{'*' if r['align_path'] == name else ''}"
    return f"{one('one')} / {one('two')}"


def tiles_source(tables: MoeTables | None, num_experts: int, n: int, k: int, dtype: torch.dtype,
                 device: torch.device) -> str:
    """"tuned" where `tables` (None: the packaged ones) hold this shape's table for this device, else "rule": a row
    says which tiles it timed (a --tables folder of other shapes or devices times the rule, and says so)."""
    return "tuned" if table_key(num_experts, n, k, dtype, device) in (TUNED if tables is None else tables) else "rule"


def bench_model(model: str, tp: int, dtype: torch.dtype, copy_bw: float, tables: MoeTables | None = None,
                device: str = "cuda", prefill_tokens: tuple[int, ...] = PREFILL_TOKENS,
                decode_batches: tuple[int, ...] = DECODE_BATCHES, reps: tuple[int, int] = (10, 50),
                ) -> list[dict[str, object]]:
    """The rows of `model`'s layer at tp: prefill (`reps[0]` timings each) and decode (`reps[1]`), on `tables`."""
    router, w13, w2, k, h = layer(model, tp, dtype, device)
    e, i = w13.shape[0], w13.shape[1] // 2
    dev = torch.device(device)
    source = tiles_source(tables, e, i, h, dtype, dev)
    rows: list[dict[str, object]] = []
    g = torch.Generator(device=device).manual_seed(1)
    clock = timer(device)
    for t in prefill_tokens:
        x = torch.randn(t, h, device=device, dtype=dtype, generator=g)
        weights, ids = route(F.linear(x, router), k, True)
        cfg = moe_config(t * k, e, i, h, dtype, dev, tables)
        check(x[:64], w13, w2, weights[:64], ids[:64], cfg)
        flops = 6 * t * k * h * i
        call = lambda x=x, w=weights, d=ids: fused_moe(x, w13, w2, w, d, None, tables)
        ms = graph_ms(call, reps[0], device)
        gate_up_ms, down_ms = gemm_parts_ms(x, w13, w2, weights, ids, cfg, reps[0], device)
        bound = prefill_bound(x, ids, w13, w2, copy_bw, reps[0], device, g)
        dense_ms, bound_ms = bound["dense_ms"], bound["bound_ms"]
        rows.append({"model": model, "tp": tp, "phase": "prefill", "tokens": t, "pairs": t * k,
                     "block_m": cfg.block_m, "tiles": source, "ms": ms,
                     "eager_ms": back_to_back_ms(call, reps[0], device),
                     "gate_up_ms": gate_up_ms, "down_ms": down_ms,
                     "tflops": flops / ms / 1e9, "dense_ms": dense_ms, "dense_tflops": flops / dense_ms / 1e9,
                     "vs_dense": dense_ms / ms, "bytes_read": bound["bytes_read"], "bound_ms": bound_ms,
                     "bound_by": bound["bound_by"], "of_bound": bound_ms / ms,
                     "tail_m": cfg.tail_m, **align_us(ids, e, cfg, reps[0], device)})
    for b in decode_batches:
        x = torch.randn(b, h, device=device, dtype=dtype, generator=g)
        logits = F.linear(x, router)
        weights, ids = route(logits, k, True)
        check(x, w13, w2, weights, ids, None, tables)
        check_layer(x, router, w13, w2, k, tables)
        unique, read = experts_read(ids, w13)
        step = lambda x=x, w=weights, d=ids: fused_moe(x, w13, w2, w, d, None, tables)
        eager_ms = median(clock(step, reps[1]))
        replay_ms = graph_ms(step, reps[1], device)
        layer_ms = graph_ms(lambda x=x: routed_moe(x, F.linear(x, router), w13, w2, k, True, None, tables), reps[1],
                            device)
        no_pdl_ms = graph_ms(lambda x=x, w=weights, d=ids: fused_moe(x, w13, w2, w, d, None, tables, pdl=False),
                             reps[1], device)
        ceiling_ms = decode_ceiling_ms(read, copy_bw)
        cfg = moe_config(b * k, e, i, h, dtype, dev, tables)
        rows.append({"model": model, "tp": tp, "phase": "decode", "tokens": b, "pairs": b * k,
                     "block_m": cfg.block_m, "tail_m": cfg.tail_m, "tiles": source, "unique_experts": unique,
                     "bytes_read": read, "ms": replay_ms, "eager_ms": eager_ms, "gbps": read / replay_ms / 1e6,
                     "ceiling_ms": ceiling_ms, "of_ceiling": ceiling_ms / replay_ms, "layer_ms": layer_ms,
                     "no_pdl_ms": no_pdl_ms,
                     "route_align_us": route_align_us(logits, k, cfg, reps[1], device),
                     **align_us(ids, e, cfg, reps[1], device)})
    return rows


def rule_mark(r: dict[str, object]) -> str:
    """' (rule)' on a row timed on the untuned rule (no table for its shape here), '' on tuned tiles."""
    return " (rule)" if r.get("tiles") == "rule" else ""


def table(rows: list[dict[str, object]], copy_bw: float) -> str:
    out = [f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write)", "",
           "| model | tp | prefill tokens | pairs | BLOCK_M | graph ms | eager ms | align / gate_up / down us "
           "| TFLOP/s | dense TFLOP/s | vs dense | bound ms | bound by | of bound | align us (one / two) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["phase"] == "prefill":
            path = float(r[f"align_{r['align_path']}_us"])
            parts = f"{path:.1f} / {float(r['gate_up_ms']) * 1e3:.1f} / {float(r['down_ms']) * 1e3:.1f}"
            out.append(f"| {r['model']} | {r['tp']} | {r['tokens']} | {r['pairs']} | {r['block_m']}"
                       f"{' + tail ' + str(r['tail_m']) if r.get('tail_m') else ''}{rule_mark(r)} | {r['ms']:.3f} | "
                       f"{r['eager_ms']:.3f} | {parts} | {r['tflops']:.0f} | {r['dense_tflops']:.0f} | "
                       f"{r['vs_dense']:.2f} | {r['bound_ms']:.3f} | {r['bound_by']} | {r['of_bound']:.2f} | "
                       f"{align_cell(r)} |")
    out += ["", "| model | tp | decode batch | unique experts | MB read | graph us | eager us | GB/s | of ceiling "
            "| no PDL us | layer us | align us (one / two) | route+align us |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["phase"] == "decode":
            out.append(f"| {r['model']} | {r['tp']}{rule_mark(r)} | {r['tokens']} | {r['unique_experts']} | "
                       f"{int(r['bytes_read']) / 1e6:.1f} | {float(r['ms']) * 1e3:.1f} | "
                       f"{float(r['eager_ms']) * 1e3:.1f} | {r['gbps']:.0f} | {r['of_ceiling']:.2f} | "
                       f"{float(r['no_pdl_ms']) * 1e3:.1f} | {float(r['layer_ms']) * 1e3:.1f} | {align_cell(r)} | "
                       f"{float(r['route_align_us']):.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b")
    ap.add_argument("--tp", default="1", help="time one rank's slice of every expert at these TP sizes "
                    "(comma-separated)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--json", type=Path, help="write the rows here too")
    ap.add_argument("--tables", type=Path, help="tuned tables from this folder (bench/moe_tune.py's moe_configs/) "
                    "instead of the packaged ones")
    args = ap.parse_args(argv)
    try:
        models = parse_models(args.models)
        tps = parse_tps(args.tp, models)
        tables = read_tables_dir(args.tables) if args.tables else None
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        print("needs a CUDA or ROCm GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    copy_bw = copy_bandwidth()
    rows = [r for m in models for tp in tps for r in bench_model(m, tp, dtype, copy_bw, tables)]
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bw": copy_bw, "rows": rows},
                                        indent=1))
    print(table(rows, copy_bw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
