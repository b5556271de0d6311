"""Our fp8 GEMMs against maintained ones per projection of a dense preset and row count (is there a better-kept fp8
GEMM to adopt for prefill?): per-channel fp8 weights (`--quantization fp8`: `fp8.quantize_weight`), dynamic
per-token activations, bf16 in and out.

    python bench/fp8_gemm_candidates.py [--models llama-3.1-70b,qwen3-8b] [--rows 1,16,64,256,1024,2048,4096,8192]
        [--vllm-path DIR] [--budget-s S] [--json PATH]
    python bench/fp8_gemm_candidates.py --dry-run [--vllm-path DIR] [--json PATH]   # CPU: the flow, tiny-llama

Shapes (fp8_sweep.shapes_of): qkv [(heads + 2 kv_heads) x head_dim, hidden], o [hidden, heads x head_dim], gate_up
[2 x intermediate, hidden], down [hidden, intermediate]. Each candidate has two calls: "GEMM only" of x8 [M, K] fp8
and per-token scales [M, 1] (the same for all: our quantizer's), "with quant" of bf16 x [M, K]:
- ours: the ops bundle the model runner builds (`fp8_ops(get_ops(device))`): `fp8_linear_rows` of `QuantizedRows`
  (qkv, gate_up and down get them from the fused RMSNorm / SiLU-and-mul) and `fp8_linear` (o_proj at prefill: the
  Triton per-token quantizer, then the GEMM); "ours route": skinny Triton kernel, W8A16 or torch._scaled_mm. Not
  modelled: a decode step's split-K sums folded into the next norm (`fp8_linear_sums`), the step's PDL choice.
- cuBLASLt: torch._scaled_mm, row-wise scales, use_fast_accum=True; with quant, our quantizer first.
- vLLM: 0.26's `vllm._custom_ops.cutlass_scaled_mm(a, b, scale_a, scale_b, out_dtype)` (torch.ops._C.cutlass_scaled_mm,
  the CUTLASS sm90 kernel its CutlassFP8ScaledMMLinearKernel runs on Hopper for channel weights and per-token
  activations; b column-major [K, N] = the [N, K] weight's .t(), scale_b [N, 1] as its layer keeps it, scale_a
  [M, 1]); with quant, its `scaled_fp8_quant(x, use_per_token_if_dynamic=True)` first.
- FlashInfer: `flashinfer.gemm.fp8_linear` (per-token x per-channel, SM100/103/107 only) where it imports and the GPU
  has it, else the row says why (its sm90 fp8 GEMMs take per-tensor or block scales: another scheme).
- cuBLASLt tensor, vLLM tensor: the same two GEMMs with one scale for the rows and one for the weight, the scheme
  vLLM's engine runs for `--quantization fp8` of a bf16 checkpoint (bench/fp8_gemm_kernels.py's docstring): not a
  drop-in for ours (another accuracy); they say how much of an engine-level gap is the scales' granularity (the
  epilogue) rather than the kernel. Their GEMM-only input is the per-token rows re-quantized per tensor (outside the
  timing), checked at QUANT_TOL.
Each call's output is first checked against the float32 GEMM of the dequantized x8 and weight (relative error <
moe_candidates.TOL of max |ref|; with quant 2 x TOL, QUANT_TOL); one that fails or disagrees is not timed, its row
says why. Times: a CUDA-graph
replay of the call (median; where capture fails, calls back to back), us and TFLOP/s (2 M N K); "X/ours": X's time
over ours (below 1: X faster). At decode rows a weight under the 60 MB L2 (Qwen3-8B's o: 16 MiB) may stay there
between replays, for all alike. Summary per model and row count over one decoder layer's four GEMMs: the sum of the
fastest candidate's times / the sum of ours ("best/ours": what switching each GEMM to its fastest leaves), and each
candidate's sum / ours; for GEMM only, with quant, and the prefill mix (o with quant, the others GEMM only). Last,
each GEMM-only call's longest kernel by name (torch's profiler, one call after its timing): which tile cuBLASLt's
heuristic chose here, to set beside the kernels an engine step's profile names (bench/step_vs_vllm.sh).

vLLM and flashinfer are imported as in bench/moe_candidates.py (`moe_candidate_kernels.import_vllm`/`import_probed`:
--vllm-path first on sys.path, a child process first). Rows run per model, row count, projection; none starts after
--budget-s (those left are listed); --json PATH is rewritten after every row, the tables beside it (.md), last.

GPU machine (H200): vLLM 0.26.0's wheels are the peer parts /work/main/.peer/c0 ... c9 (git-ignored: carried).
  1. Ten calls back to back (a call landing on a fresh machine: begin again at c0), K = 0 .. 9:
        run(command="bash bench/vs_vllm.sh --stash", carry=[".peer/cK", ".peer/peer_vllm"], timeout_s=120)
  2. At once, on the same machine, one call (timeout_s=600) whose command is these two lines:
     S=/root/peersite; [ -f $S/vllm/__init__.py ] || bash /root/peerstash/peer_vllm/install.sh 2>&1 | tail -3
     python3 bench/fp8_gemm_candidates.py --vllm-path $S --budget-s $((500-SECONDS)) --json $OUT/fp8_gemm.json
     Without the stash calls (or a failed install) ours and cuBLASLt are still timed, each row says why not vLLM.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # fp8_sweep imports gpu_timing as a top-level module

from bench import moe_gemm, moe_timing  # noqa: E402
from bench.fp8_gemm_kernels import (  # noqa: E402
    GemmCandidate,
    Kernel,
    cublaslt,
    cublaslt_tensor,
    load_flashinfer,
    load_vllm,
    make_layer,
    our_route,
    ours,
    quantizer,
)
from bench.fp8_sweep import shapes_of  # noqa: E402
from bench.moe_candidate_kernels import short  # noqa: E402
from bench.moe_candidates import TOL, Clock, cell, checked, parse_budget, parse_counts, ratio, timed, write_json  # noqa: E402
from rapidserve.loader.preset_table import preset_table  # noqa: E402
from rapidserve.loader.presets import preset_config  # noqa: E402

DEFAULT_MODELS = "llama-3.1-70b,qwen3-8b"
ROWS = (1, 16, 64, 256, 1024, 2048, 4096, 8192)
PROJS = ("qkv", "o", "gate_up", "down")  # fp8_sweep.shapes_of's order
VARIANTS = {"gemm": "GEMM only", "quant": "with quant"}
MIXES = {**VARIANTS, "mix": "prefill mix"}  # the summary's: o with quant, the others GEMM only
QUANT_TOL = 2 * TOL  # with quant (its own x8): an element may round the other way (x / s vs x * (1 / s))
REPS = (50, 20)  # replays per row: at most 64 rows, above
DRY_RUN = {"model": "tiny-llama", "rows": (1, 5, 32), "reps": 1}


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """{projection: (N, K)} of `model`'s decoder layer."""
    return dict(zip(PROJS, shapes_of(preset_config(model)), strict=True))


def measure(kernels: dict[str, tuple[str, Kernel | None, str]], x: torch.Tensor, x8: torch.Tensor, sx: torch.Tensor,
            want: torch.Tensor, reps: int, device: str, graph_ms: Clock = moe_timing.graph_ms,
            eager_ms: Clock = moe_timing.back_to_back_ms,
            kernel_names: Callable[[Callable[[], object], str], list[str]] = moe_timing.kernel_names,
            ) -> dict[str, object]:
    """Each candidate's two calls ({name: (label, kernel or None, why)}): checked against `want`, then timed (graph
    replay; back to back where that fails) and its longest kernels named (`kernel_names`: [] on the CPU). Keys per
    NAME_VARIANT: _us, _err, _timing, _why ("" when timed), _kernels."""
    row: dict[str, object] = {}
    for n, (label, kern, why) in kernels.items():
        for v in VARIANTS:
            p = f"{n}_{v}"
            row.update({f"{p}_us": None, f"{p}_err": None, f"{p}_timing": None, f"{p}_why": why, f"{p}_kernels": []})
            if kern is None:
                continue
            a, s = kern[2](x8, sx) if v == "gemm" and len(kern) > 2 else (x8, sx)  # type: ignore[misc]
            lab = f"{label} ({v})"
            call = (lambda k=kern, a=a, s=s: k[0](a, s)) if v == "gemm" else (lambda k=kern: k[1](x))
            tol = TOL if v == "gemm" and len(kern) == 2 else QUANT_TOL
            got, row[f"{p}_err"], row[f"{p}_why"] = checked(lab, call, want, device, tol)
            if got is None:
                continue
            del got
            for what, clock in (("graph", graph_ms), ("eager", eager_ms)):
                ms, failed = timed(lab, call, {what: clock}, reps, device)
                row[f"{p}_why"] = "; ".join(filter(None, (row[f"{p}_why"], failed)))
                if ms[what] is not None:
                    row[f"{p}_us"], row[f"{p}_timing"] = ms[what] * 1e3, what  # type: ignore[operator]
                    row[f"{p}_kernels"] = kernel_names(call, device)
                    break
    return row


def finish_row(row: dict[str, object], names: list[str]) -> dict[str, object]:
    """TFLOP/s of each timed call, X/ours time ratios and the fastest candidate, per variant."""
    for v in VARIANTS:
        times = {n: row.get(f"{n}_{v}_us") for n in names}
        for n, us in times.items():
            row[f"{n}_{v}_tflops"] = ratio(float(row["flops"]) / 1e6, us)  # type: ignore[arg-type]
            if n != "ours":
                row[f"{n}_{v}_over_ours"] = ratio(us, times.get("ours"))
        timed_ = {n: us for n, us in times.items() if isinstance(us, float)}
        row[f"best_{v}"] = min(timed_, key=timed_.__getitem__) if timed_ else None
    return row


def total(times: list[object]) -> float | None:
    """The sum of `times`, None unless every one is a float (a time)."""
    return sum(times) if all(isinstance(t, float) for t in times) else None  # type: ignore[arg-type]


def summarize(rows: list[dict[str, object]], names: list[str]) -> list[dict[str, object]]:
    """Per (model, rows) whose four projections all ran, per mix: ours' summed us, the fastest candidates' sum and
    its share of ours, each candidate's sum over ours (None where it lacks a projection), the fastest per proj."""
    out: list[dict[str, object]] = []
    keys = list(dict.fromkeys((r["model"], r["rows"]) for r in rows))
    for model, m in keys:
        layer = {r["proj"]: r for r in rows if r["model"] == model and r["rows"] == m}
        if set(layer) != set(PROJS):
            continue
        for mix in MIXES:
            var = {p: (("quant" if p == "o" else "gemm") if mix == "mix" else mix) for p in PROJS}
            sums = {n: total([layer[p].get(f"{n}_{var[p]}_us") for p in PROJS]) for n in names}
            best = {p: layer[p].get(f"best_{var[p]}") for p in PROJS}
            best_us = total([layer[p].get(f"{best[p]}_{var[p]}_us") for p in PROJS])
            s: dict[str, object] = {"model": model, "rows": m, "mix": mix, "ours_us": sums["ours"], "best_us": best_us,
                                    "best_over_ours": ratio(best_us, sums["ours"]), "best": best}
            s.update({f"{n}_over_ours": ratio(sums[n], sums["ours"]) for n in names if n != "ours"})
            out.append(s)
    return out


def note(r: dict[str, object], names: list[str], v: str, whys: dict[str, str]) -> str:
    """The row's failures under variant v (candidate-wide reasons are in the header, not repeated)."""
    parts = [str(r.get("error") or "")] + [str(r.get(f"{n}_{v}_why") or "") for n in names
                                           if r.get(f"{n}_{v}_why") != whys.get(n)]
    return "; ".join(p for p in parts if p).replace("|", "/") or "-"


def table(rows: list[dict[str, object]], summary: list[dict[str, object]], cands: list[GemmCandidate]) -> str:
    names, labels = [c.name for c in cands], {c.name: c.label for c in cands}
    whys = {c.name: c.why for c in cands}
    out = ["; ".join(f"{c.label}: {c.version if c.bind else 'not measured: ' + c.why}" for c in cands), ""]
    others = [n for n in names if n != "ours"]
    titles = {"gemm": "pre-quantized x8 and per-token scales (our quantizer's; tensor-wise: re-quantized per tensor)",
              "quant": "bf16 x, each candidate's own quantizer (ours for cuBLASLt, FlashInfer; tensor-wise: "
                       "per tensor)"}
    for v in VARIANTS:
        out += [f"{VARIANTS[v]}: {titles[v]}", "", "| model | proj | N x K | rows | ours route | " + " | ".join(
            f"{labels[n]} us" for n in names) + " | " + " | ".join(f"{labels[n]} TFLOP/s" for n in names) + " | "
            + " | ".join(f"{labels[n]}/ours" for n in others) + " | fastest | max rel err | note |",
            "|" + "---|" * (8 + 3 * len(names) - 1)]
        for r in rows:
            errs = [e for n in names if isinstance(e := r.get(f"{n}_{v}_err"), float)]
            best = r.get(f"best_{v}")
            out.append(f"| {r['model']} | {r['proj']} | {r['n']} x {r['k']} | {r['rows']} | {r.get('ours_route', '-')}"
                       f" | " + " | ".join(cell(r.get(f"{n}_{v}_us"), ".1f") for n in names) + " | "
                       + " | ".join(cell(r.get(f"{n}_{v}_tflops"), ".0f") for n in names) + " | "
                       + " | ".join(cell(r.get(f"{n}_{v}_over_ours"), ".2f") for n in others)
                       + f" | {labels.get(str(best), '-')} | {cell(max(errs) if errs else None, '.1e')} | "
                       f"{note(r, names, v, whys)} |")
        out.append("")
    out += ["One decoder layer's four GEMMs (sum of us; X/ours = X's sum over ours, below 1: X faster):", "",
            "| model | rows | calls | ours us | best us | best/ours | fastest (qkv o gate_up down) | "
            + " | ".join(f"{labels[n]}/ours" for n in others) + " |", "|" + "---|" * (7 + len(others))]
    for s in summary:
        best = " ".join(labels.get(str(w), "-") for w in s["best"].values())  # type: ignore[attr-defined]
        out.append(f"| {s['model']} | {s['rows']} | {MIXES[str(s['mix'])]} | {cell(s['ours_us'], '.1f')} | "
                   f"{cell(s['best_us'], '.1f')} | {cell(s['best_over_ours'], '.3f')} | {best} | "
                   + " | ".join(cell(s.get(f"{n}_over_ours"), ".3f") for n in others) + " |")
    named = [r for r in rows if any(r.get(f"{n}_gemm_kernels") for n in names)]
    if named:  # which kernel each library chose: an engine's step profile names its kernels the same way
        out += ["", "The longest kernel of each GEMM-only call (its first 60 characters):", "",
                "| model | rows | proj | " + " | ".join(labels[n] for n in names) + " |",
                "|" + "---|" * (3 + len(names))]
        out += [f"| {r['model']} | {r['rows']} | {r['proj']} | " + " | ".join(
            "`" + str(ks[0])[:60].replace("|", "/") + "`" if (ks := r.get(f"{n}_gemm_kernels")) else "-"
            for n in names) + " |" for r in named]
    return "\n".join(out).rstrip("\n")


def bench_model(model: str, cands: list[GemmCandidate], device: str, rows: tuple[int, ...], reps: int | None,
                deadline: float, emit: Callable[[dict[str, object]], None], skipped: list[str]) -> None:
    """`model`'s four projections at each row count (rows outer: a budget cut leaves whole layers), each row to
    `emit`; one that would start after `deadline` (time.perf_counter) is appended to `skipped` instead."""
    g = torch.Generator(device=device).manual_seed(0)
    shapes = layer_shapes(model)
    layers = {p: make_layer(n, k, device, g) for p, (n, k) in shapes.items()}
    kernels = {p: {c.name: (c.label, c.bind(layer) if c.bind else None, c.why) for c in cands}
               for p, layer in layers.items()}
    quantize = quantizer(device)
    for m in rows:
        for p, layer in layers.items():
            if time.perf_counter() > deadline:
                skipped.append(f"{model} {p} {m}")
                continue
            n, k = shapes[p]
            row: dict[str, object] = {"model": model, "proj": p, "n": n, "k": k, "rows": m, "flops": 2 * m * n * k}
            try:
                x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
                x8, sx = quantize(x)
                want = (x8.float() * sx) @ layer.dequantized().t()
                row["ours_route"] = our_route(x, layer)
                row.update(measure(kernels[p], x, x8, sx, want, reps or REPS[m > 64], device))
                finish_row(row, [c.name for c in cands])
            except Exception as e:  # noqa: BLE001 - the row says so and the next one runs
                row["error"] = f"row failed: {short(e)}"
            emit(row)
            x = x8 = sx = want = None  # type: ignore[assignment]  # freed before the next row's
    del layers, kernels
    if device == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=None, help=f"comma-separated dense presets (default {DEFAULT_MODELS})")
    ap.add_argument("--rows", default=None, help=f"comma-separated (default {','.join(map(str, ROWS))})")
    ap.add_argument("--vllm-path", type=Path, default=None, help="a folder holding the vllm package (pip --target; "
                    "/root/peersite on the GPU machine), put first on sys.path; without it, `import vllm` as installed")
    ap.add_argument("--budget-s", default="480", help="start no row after this many seconds (default 480)")
    ap.add_argument("--json", type=Path, help="write the rows here (after every row), the tables beside it (.md)")
    ap.add_argument("--dry-run", action="store_true", help=f"CPU: {DRY_RUN['model']}, rows "
                    f"{','.join(map(str, DRY_RUN['rows']))}, one timing each: checks the flow, measures nothing")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    try:  # every flag first: a bad one is refused by name on any machine
        budget = parse_budget(args.budget_s)
        if args.dry_run:
            fixed = [f for f, v in (("--models", args.models), ("--rows", args.rows)) if v is not None]
            if fixed:
                raise ValueError(f"--dry-run times {DRY_RUN['model']} on the CPU: drop {', '.join(fixed)}")
            models, rows = [str(DRY_RUN["model"])], DRY_RUN["rows"]
        else:
            dense = sorted(name for name, cfg in preset_table().items() if cfg.moe is None)
            models = moe_gemm.parse_models(DEFAULT_MODELS if args.models is None else args.models, dense, "dense")
            rows = parse_counts("--rows", ",".join(map(str, ROWS)) if args.rows is None else args.rows)
        if args.json is not None and not args.json.parent.is_dir():
            raise ValueError(f"--json {args.json}: no folder {args.json.parent}")
    except ValueError as e:
        ap.error(str(e))
    if not args.dry_run and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    vllm, vllm_t = load_vllm(args.vllm_path)
    cands = [ours(device), cublaslt(device), vllm, load_flashinfer(args.vllm_path, device), cublaslt_tensor(device),
             vllm_t]
    for c in cands:
        print(f"{c.label}: {c.version if c.bind else c.why}", flush=True)
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    done: list[dict[str, object]] = []
    skipped: list[str] = []
    names = [c.name for c in cands]

    def report(finished: bool) -> dict[str, object]:
        return {"device": dev_name, "torch": torch.__version__, "budget_s": budget, "done": finished,
                "candidates": {c.name: {"label": c.label, "version": c.version or None, "why": c.why or None}
                               for c in cands}, "vllm_path": str(args.vllm_path) if args.vllm_path else None,
                "skipped": skipped, "rows": done, "summary": summarize(done, names)}

    def emit(row: dict[str, object]) -> None:
        done.append(row)
        times = ", ".join(f"{c.label} {cell(row.get(f'{c.name}_gemm_us'), '.1f')}/"
                          f"{cell(row.get(f'{c.name}_quant_us'), '.1f')}" for c in cands)
        print(f"[{time.perf_counter() - start:.0f} s] {row['model']} {row['proj']} {row['rows']} (us, GEMM/with "
              f"quant): {times}{' (' + str(row['error']) + ')' if row.get('error') else ''}", flush=True)
        write_json(args.json, report(False))

    for model in models:
        try:
            bench_model(model, cands, device, rows, DRY_RUN["reps"] if args.dry_run else None,  # type: ignore[arg-type]
                        start + budget, emit, skipped)
        except Exception as e:  # noqa: BLE001 - e.g. the weights not fitting: the next model still runs
            skipped.append(f"{model} (failed: {short(e)})")
    final = report(True)
    text = table(done, final["summary"], cands)  # type: ignore[arg-type]
    if skipped:
        text += f"\n\nnot run (past --budget-s {budget:g}, or failed): {', '.join(skipped)}"
    write_json(args.json, final, text)
    print(f"\n{dev_name}, {time.perf_counter() - start:.0f} s, tolerance {TOL:g}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
