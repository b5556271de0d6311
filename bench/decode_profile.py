"""Where a small-batch decode step's time goes, kernel by kernel (issue 16: decode >= 90% of the roofline).

    python bench/decode_profile.py [--model preset:qwen3-8b] [--batches 1,16,64] [--ctx 2048]
                                   [--variants fused,unfused] [--sweep] [--quantization fp8] [--out DIR]
                                   [--write-tables] [--budget-s 240] [--jobs 14] [--no-pdl-ab] [--write-pdl-table]
                                   [--write-w8a16-table]

For each decode batch (2048-token contexts, a CUDA-graph replay as the engine runs it, inputs in place):
  - the replay's wall time (CUDA events, median of 30) and its bytes (weights once + the batch's K/V) over
    the copy ceiling (device-to-device copy of 1 GiB), as bench/model_runner.py counts them;
  - under torch.profiler, every kernel of one step: launches per step, microseconds per step and per launch;
    the wall time no kernel covers is the gaps between kernels;
  - each layer linear alone at that batch, over the 36 layers' own weights in one graph (so no weight is
    re-read from L2): cuBLAS (F.linear; for gate_up, then SiLU-and-mul), the engine's op (`ops.linear`,
    `ops.linear_silu_and_mul` for gate_up: rapidserve/ops/triton_skinny.py up to its MAX_ROWS), and with
    `--sweep` every skinny tile configuration of SWEEP (gate_up: gated, tiles half as wide per weight half),
    to choose `skinny_config`'s table.
Variants (`--variants`): `fused` is the model as the engine runs it; `unfused` is `ops.unfused_ops`:
RoPE and the KV write as two launches, cuBLAS for every linear (the layer before these changes), captured
as another graph set, so the two are measured in one process on the same GPU.
Programmatic dependent launch (rapidserve/ops/pdl.py): each variant's graphs are captured as the engine captures them,
each batch launched as the GPU's table chooses ("engine chooses": `ops.pdl_table.pdl_for_step`, on at small batches
only), and where the GPU has PDL three times more, the same choice forced on every batch whatever the table says: PDL
and the GEMMs' weight prefetch on ("PDL ms"; the prefetch bytes of the GPU's entry, or triton_skinny.PREFETCH_BYTES),
PDL off in every kernel ("no PDL ms") and PDL without the prefetch ("no prefetch ms"); all replays are timed alike
(`--no-pdl-ab`: only the engine's). From the `fused` variant's columns it derives this GPU's entry of the PDL table
(`pdl_table.measured_entry`: on up to the largest batch where "PDL ms" beats "no PDL ms" by more than 1% at it and at
every smaller batch measured; the prefetch kept unless "no prefetch ms" beats "PDL ms" by more than 1% there), writes
the packaged table with it as <out>/pdl_table.json, and `--write-pdl-table` also into rapidserve/ops/pdl_table.json of
this checkout, where later runs (and the engine) load it: commit it from there. Measure with the batches the engine
captures around the threshold (e.g. --batches 1,8,16,24,32,64): a batch not measured between two is not assumed on.
`--quantization fp8`: the same weights quantized at load (`quant_config.ONLINE_FP8`, as bench/fp8_speed.py), the
bytes counted from the model's own tensors; `unfused` is then `ops.unfused_fp8` (each projection quantizes its own
input); the `fused` variant is also captured and timed with the split-K reduces launched rather than folded into the
RMSNorms after them (`ops.no_split_fold`, ops/fold_table.py: column "unfused small kernels ms", with its launches a
step), each batch launched as the engine's PDL table chooses: the A/B that puts a measured threshold into
ops/fold_table.py's entry (the fold is on where the fused column beats it); and the linear-layer section is
bench/fp8_sweep.py's: each fp8 projection through torch._scaled_mm and the engine's op, with `--sweep` every tile
configuration of the skinny fp8 kernel (rows up to 64; its kernels compiled first in --jobs processes, the sweep given
--budget-s seconds) and the fused producers' row slices. The sweep's choices are written as this GPU's table,
<out>/fp8_configs/device_name=<GPU>.json (ops/fp8_tiles.py's format, merged into the packaged table of this GPU if
there is one); `--write-tables` also writes it into rapidserve/ops/fp8_configs/ of this checkout, where later runs
(and the engine) load it: commit it from there.
`--quantization fp8 --variants fused,w8a16`: the `w8a16` variant forces W8A16 (ops/triton_w8a16.py) at every row
count the kernel takes, timed beside `fused` (W8A8), with its entry of ops/w8a16_table.json derived and, with
`--write-w8a16-table`, written (bench/w8a16_ab.py says how).
Writes <out>/decode_profile.json and .md; prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8_sweep  # noqa: E402
import w8a16_ab  # noqa: E402
from fp8_speed import weight_bytes as model_bytes  # noqa: E402
from gpu_timing import time_ms  # noqa: E402
from model_runner import ceilings, engine_config, preset_source  # noqa: E402

from rapidserve.config import EngineConfig, ModelConfig  # noqa: E402
from rapidserve.loader.presets import preset_config  # noqa: E402
from rapidserve.ops import no_split_fold, pdl_table, triton_skinny, with_launch  # noqa: E402
from rapidserve.ops.fp8_tiles import CONFIG_DIR  # noqa: E402
from rapidserve.ops.pdl import use_pdl  # noqa: E402
from rapidserve.ops.pdl_table import OFF, LaunchChoice, PdlRow  # noqa: E402
from rapidserve.runner import DecodeItem, ModelRunner  # noqa: E402

REPS = 30


def kernels(fn: object, steps: int) -> list[dict[str, object]]:
    """Every device kernel of `steps` calls of fn: name, launches and microseconds per step."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()  # type: ignore[operator]
        torch.cuda.synchronize()
    us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us[ev.name[:100]] += ev.device_time / steps
        count[ev.name[:100]] += 1
    return sorted(({"name": k, "launches": count[k] / steps, "us": v, "us_each": v * steps / count[k]}
                   for k, v in us.items()), key=lambda r: -float(r["us"]))  # type: ignore[arg-type]


def linear_graph(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weights: list[torch.Tensor],
                 x: torch.Tensor) -> dict[str, float]:
    """fn(x, w) for every layer's weight w (distinct weights, as in a step: no L2 reuse), in one graph:
    microseconds per call and the weights' read rate."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in weights[:2]:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    ms = statistics.median(time_ms(graph.replay, reps=20))
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return {"us_each": ms * 1e3 / len(weights), "tbps": nbytes / (ms * 1e-3) / 1e12}


def linears(runner: ModelRunner, batch: int, sweep: bool) -> dict[str, object]:
    """Each layer linear at this batch over the 36 layers' weights: cuBLAS (F.linear), the engine's op
    (ops.linear), and with `sweep` every skinny tile configuration in SWEEP."""
    from rapidserve.ops.triton_skinny import MAX_ROWS, SkinnyConfig, gated_config, skinny_config, skinny_linear

    layers = runner.model.layers
    ops = runner.model.ops
    out: dict[str, object] = {}
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        ws = [getattr(layer, name).data for layer in layers]
        n, k = ws[0].shape
        x = torch.randn(batch, k, device="cuda", dtype=ws[0].dtype)
        gated = name == "gate_up_proj"  # the engine runs it with SiLU-and-mul (ops.linear_silu_and_mul)
        row: dict[str, object] = {
            "shape": [n, k], "gated": gated,
            "cublas": linear_graph((lambda x, w: ops.silu_and_mul(F.linear(x, w))) if gated else F.linear, ws, x),
            "engine": linear_graph(ops.linear_silu_and_mul if gated else ops.linear, ws, x),
            "config": gated_config(n, k) if gated else skinny_config(n, k)}
        if sweep and batch <= MAX_ROWS:
            tried = {}
            for bn, bk, warps, stages in SWEEP:
                cfg = SkinnyConfig(bn // 2 if gated else bn, bk, warps, stages)
                try:
                    r = linear_graph(lambda x, w, cfg=cfg, gated=gated: skinny_linear(x, w, config=cfg, gated=gated),
                                     ws, x)
                except Exception as e:  # e.g. out of shared memory: say so, try the rest
                    r = {"error": f"{type(e).__name__}: {str(e)[:80]}"}
                tried[f"{cfg.block_n}x{bk} w{warps} s{stages}"] = r
            row["sweep"] = tried
        out[name] = row
    return out


SWEEP = tuple((bn, bk, w, st)
              for bn, bk in ((16, 256), (16, 512), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256))
              for w in (4, 8) for st in (3, 4))
AB = ("pdl", "nopdl", "noprefetch")  # the PDL A/B's graph keys (after the variant's) and row fields (with _ms)
NOFOLD = "nofold"  # fp8's fused variant with the split-K reduces launched (`ops.no_split_fold`): key, row fields


def forced_launches(gpu: str, table: pdl_table.PdlTable = pdl_table.PDL_TABLE) -> dict[str, LaunchChoice]:
    """The A/B's choices, forced on every batch: PDL with the prefetch (the GPU's entry's bytes, or
    triton_skinny.PREFETCH_BYTES where the entry has none), PDL off, PDL without the prefetch."""
    prefetch = pdl_table.entry_for(table, gpu).prefetch_bytes or triton_skinny.PREFETCH_BYTES
    return {"pdl": LaunchChoice(True, prefetch), "nopdl": OFF, "noprefetch": LaunchChoice(True, 0)}


def graph_launch(runner: ModelRunner, key: str, batch: int) -> LaunchChoice:
    """How the graph `decode()` replays for `batch` sequences under `key` launched (the runner's record)."""
    launches = runner.decode_launches(key)
    return launches[min(b for b in launches if b >= batch)]


def write_pdl_table(rows: list[dict[str, Any]], gpu: str, prefetch: int, source: str, out: str | Path,
                    repo_path: Path | None, packaged: pdl_table.PdlTable = pdl_table.PDL_TABLE) -> list[str]:
    """This GPU's PDL table entry from the `fused` rows' A/B (`pdl_table.measured_entry`, the forced PDL column's
    `prefetch` bytes), written with the `packaged` table's other entries to <out>/pdl_table.json and, given
    `repo_path` (rapidserve/ops/pdl_table.json), there too; returns each batch's A/B, the entry and where it went."""
    measured = [PdlRow(r["batch"], r["pdl_ms"], r["nopdl_ms"], r["noprefetch_ms"]) for r in rows
                if r["variant"] == "fused" and all(f"{k}_ms" in r for k in AB)]
    if not measured:
        return ["no PDL table written: no `fused` variant measured with the PDL A/B"]
    notes = [f"batch {m.batch}: PDL {m.pdl_ms / m.no_pdl_ms - 1:+.1%} against none, the prefetch "
             f"{m.pdl_ms / m.no_prefetch_ms - 1:+.1%} against none" for m in sorted(measured)]
    entry = pdl_table.measured_entry(measured, prefetch, source)
    table = pdl_table.with_entry(packaged, gpu, entry)
    paths = [Path(out) / "pdl_table.json", *([repo_path] if repo_path is not None else [])]
    for path in paths:
        pdl_table.write_table(path, table)
    notes.append(f"{gpu}: PDL on up to {entry.max_rows} rows, prefetch {entry.prefetch_bytes} bytes "
                 f"(the engine's until now: {pdl_table.entry_for(packaged, gpu)[:2]})")
    return [*notes, "PDL table written: " + ", ".join(map(str, paths))]


def profile_config(name: str, mcfg: ModelConfig, batches: tuple[int, ...], quantization: str) -> EngineConfig:
    """The profiled engine's config: bf16, 8192 positions, 90% of the GPU, a decode graph per batch; `quantization`
    fp8: the weights quantized at load (model_runner.engine_config(fp8=True): quant_config.ONLINE_FP8, as
    bench/fp8_speed.py), the KV cache the model's dtype either way."""
    return engine_config(name, mcfg, "bfloat16", batches, 8192, 0.9, fp8=quantization == "fp8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:qwen3-8b")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--variants", default="fused,unfused")
    ap.add_argument("--sweep", action="store_true",
                    help="time every skinny tile configuration too (fp8: the fp8 kernel's, written as a table)")
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none",
                    help="fp8: weights quantized at load (per-channel, dynamic per-token activations)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--write-tables", action="store_true",
                    help="fp8 --sweep: also write the tuned table into rapidserve/ops/fp8_configs/ of this checkout")
    ap.add_argument("--budget-s", type=float, default=240.0, help="fp8 --sweep: seconds to start sweep points in")
    ap.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                    help="fp8 --sweep: processes compiling the candidate kernels first")
    ap.add_argument("--no-pdl-ab", action="store_true",
                    help="capture and time only the engine's graphs (no 'PDL' / 'no PDL' / 'no prefetch' replays)")
    ap.add_argument("--write-pdl-table", action="store_true",
                    help="also write this GPU's measured PDL entry into rapidserve/ops/pdl_table.json of this checkout")
    ap.add_argument("--write-w8a16-table", action="store_true",
                    help="fp8, variants fused and w8a16: also write this GPU's measured W8A16 entry into "
                         "rapidserve/ops/w8a16_table.json of this checkout")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode_profile needs a GPU", file=sys.stderr)
        return 2
    batches = tuple(int(b) for b in a.batches.split(","))
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in ("fused", "unfused", w8a16_ab.VARIANT)]
    if bad or (w8a16_ab.VARIANT in variants and a.quantization != "fp8"):
        print(f"--variants: unknown {bad}; use fused, unfused and (with --quantization fp8) w8a16", file=sys.stderr)
        return 2
    if a.write_w8a16_table and not {"fused", w8a16_ab.VARIANT} <= set(variants):
        print("--write-w8a16-table needs --quantization fp8 --variants fused,w8a16", file=sys.stderr)
        return 2
    pdl_ab = not a.no_pdl_ab and use_pdl(None, torch.device("cuda"))
    if a.write_pdl_table and not (pdl_ab and "fused" in variants):
        print("--write-pdl-table needs the PDL A/B of the fused variant: keep `fused` in --variants, leave out "
              "--no-pdl-ab, on a GPU that launches with PDL (NVIDIA sm_90+)", file=sys.stderr)
        return 2
    ceil = ceilings()
    copy_tbps = float(ceil["copy_tbps"])  # type: ignore[arg-type]
    name = a.model.removeprefix("preset:")
    mcfg = preset_config(name)
    fp8 = a.quantization == "fp8"
    ecfg = profile_config(name, mcfg, batches, a.quantization)
    if fp8 and a.sweep:  # before this process takes the GPU's memory: the compiling processes need a little
        shapes = fp8_sweep.shapes_of(mcfg)
        print(fp8_sweep.precompile([(b, n, k) for b in batches if b <= fp8_sweep.MAX_ROWS for n, k in shapes],
                                   a.jobs), flush=True)
    runner = ModelRunner(ecfg, preset_source(name, mcfg, "cuda", torch.bfloat16), show_progress=False)
    pool = runner.kv_pool
    for layer in range(pool.tensor.shape[0]):
        pool.tensor[layer].normal_()
    fused = runner.model.ops
    gpu = torch.cuda.get_device_name()
    forced = forced_launches(gpu) if pdl_ab else {}
    for v in variants:
        if v == "unfused":
            from rapidserve.ops import unfused_fp8, unfused_ops  # the A/B's other side: see the module docstring
            ops = unfused_fp8(fused) if fp8 else unfused_ops(fused)
        elif v == w8a16_ab.VARIANT:  # W8A16 forced at every row count it takes (bench/w8a16_ab.py)
            ops = w8a16_ab.variant_ops(fused, gpu)
        else:
            ops = fused
        runner.model.ops = ops
        runner.capture_decode_graphs(key=v, show_progress=False)  # each batch as the engine's table chooses
        if fp8 and v == "fused":  # the same graphs with the split-K reduces launched, not folded into the norms
            runner.model.ops = no_split_fold(ops)
            runner.capture_decode_graphs(key=f"{v}-{NOFOLD}", show_progress=False)
            runner.model.ops = ops
        for other, launch in forced.items():  # the same choice at every batch, whatever the table says
            runner.capture_decode_graphs(key=f"{v}-{other}", show_progress=False, launch=launch)
    runner.model.ops = fused
    per = a.ctx // runner.block_size
    n_params = mcfg.num_params()
    emb = mcfg.vocab_size * mcfg.hidden_size
    weight_bytes = (n_params - (0 if mcfg.tie_word_embeddings else emb)) * 2  # embedding read b rows only
    if fp8:  # the model's own tensors (fp8 weights, their scales, the bf16 rest), less the embedding's rows
        weight_bytes = model_bytes(runner) - (0 if mcfg.tie_word_embeddings else emb * 2)
    rows: list[dict[str, object]] = []
    lin_by_batch, prod_by_batch = {}, {}
    deadline = time.monotonic() + a.budget_s
    for b in batches:
        items = [DecodeItem(1, a.ctx - 1, [(i * per + j) % pool.num_blocks for j in range(per)]) for i in range(b)]
        nbytes = weight_bytes + b * mcfg.hidden_size * 2 + b * a.ctx * mcfg.kv_bytes_per_token(2)
        runner.model.ops = with_launch(fused, runner.decode_launch(b))  # the engine's op launched as its step would
        if not fp8:
            lin_by_batch[b] = linears(runner, b, a.sweep)
        else:
            lin_by_batch[b] = fp8_sweep.fp8_linears(runner.model, b, a.sweep, deadline)
            if a.sweep:
                prod_by_batch[b] = fp8_sweep.producers(runner.model, b)
        runner.model.ops = fused
        for v in variants:
            runner.decode(items, graph_key=v)  # puts this batch's inputs in place
            graph = runner.decode_graph(b, v)
            assert graph is not None, f"no decode graph for batch {b}"
            ms = time_ms(graph.replay, reps=REPS)
            ks = kernels(graph.replay, steps=5)
            busy = sum(float(k["us"]) for k in ks)  # type: ignore[arg-type]
            med = statistics.median(ms)
            ab: dict[str, object] = {"engine_launch": graph_launch(runner, v, b).label()}
            if fp8 and v == "fused":
                runner.decode(items, graph_key=f"{v}-{NOFOLD}")
                g = runner.decode_graph(b, f"{v}-{NOFOLD}")
                assert g is not None, f"no decode graph for batch {b} ({NOFOLD})"
                ab[f"{NOFOLD}_ms"] = statistics.median(time_ms(g.replay, reps=REPS))
                ab[f"{NOFOLD}_launches"] = sum(float(k["launches"]) for k in kernels(g.replay, steps=5))  # type: ignore[arg-type]
            for other in forced:
                runner.decode(items, graph_key=f"{v}-{other}")
                g = runner.decode_graph(b, f"{v}-{other}")
                assert g is not None, f"no decode graph for batch {b} ({other})"
                ab[f"{other}_ms"] = statistics.median(time_ms(g.replay, reps=REPS))
            rows.append({"batch": b, "variant": v, "replay_ms": med, "replay_min_ms": min(ms),
                         "replay_max_ms": max(ms), "bytes": nbytes,
                         "frac_of_copy": nbytes / (med * 1e-3) / 1e12 / copy_tbps,
                         "kernel_us": busy, "gap_us": med * 1e3 - busy,
                         "launches": sum(float(k["launches"]) for k in ks),  # type: ignore[arg-type]
                         "kernels": ks[:16], **ab})
    res = {"gpu": gpu, "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"), "model": a.model,
           "ctx": a.ctx, "quantization": a.quantization, "attention": runner.attn.name, "ceilings": ceil,
           "command": "python bench/decode_profile.py " + " ".join(sys.argv[1:]), "rows": rows,
           "linears": lin_by_batch, "producers": prod_by_batch}
    os.makedirs(a.out, exist_ok=True)
    if fp8 and a.sweep:
        res["fp8_table"] = fp8_sweep.write_table(lin_by_batch, str(res["gpu"]), f"{res['command']} ({res['date']})",
                                                 a.out, CONFIG_DIR if a.write_tables else None)
    if w8a16_ab.VARIANT in variants:
        res["w8a16_table"] = w8a16_ab.write_table(rows, gpu, f"{res['command']} ({res['date']})", a.out,
                                                  w8a16_ab.wt.TABLE_PATH if a.write_w8a16_table else None)
    if forced:
        res["pdl_table"] = write_pdl_table(rows, gpu, forced["pdl"].prefetch_bytes,
                                           f"{res['command']} ({res['date']})", a.out,
                                           pdl_table.TABLE_PATH if a.write_pdl_table else None)
    with open(os.path.join(a.out, "decode_profile.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    kind = "fp8 weights" if fp8 else "bf16"
    lines = [f"# Decode step by kernel: {a.model} {kind} on {res['gpu']} ({res['date']})", "",
             f"Command: `{res['command']}`. Context {a.ctx}, attention {runner.attn.name}, copy ceiling "
             f"{copy_tbps:.2f} TB/s. Graph replays with their inputs in place.", ""]
    for r in rows:
        lines.append(f"\n## batch {r['batch']}, {r['variant']}: kernels of one step\n")
        lines.append("| kernel | launches/step | us/step | us each |")
        lines.append("|---|---|---|---|")
        for k in r["kernels"]:  # type: ignore[union-attr]
            lines.append(f"| `{k['name'][:70]}` | {k['launches']:.0f} | {k['us']:.0f} | {k['us_each']:.1f} |")
    if fp8:
        lines += fp8_sweep.markdown(lin_by_batch, prod_by_batch)
        if "fp8_table" in res:
            lines += ["\n## the sweep's choices (bench/fp8_sweep.py)\n", *(f"- {x}" for x in res["fp8_table"])]
    for b, lin in ({} if fp8 else lin_by_batch).items():
        lines.append(f"\n## linear layers alone at batch {b} (36 layers' weights in one graph; us per call, TB/s)\n")
        lines.append("| layer | [N, K] | cuBLAS | engine (config) | best swept (config) |")
        lines.append("|---|---|---|---|---|")
        for name, row in lin.items():
            best = "-"
            if "sweep" in row:
                ok = {c: r for c, r in row["sweep"].items() if "tbps" in r}
                if ok:
                    c = max(ok, key=lambda c: ok[c]["tbps"])
                    best = f"{ok[c]['us_each']:.1f} ({ok[c]['tbps']:.2f}) {c}"
            cb, en = row["cublas"], row["engine"]
            label = name + (" + SiLU-and-mul" if row["gated"] else "")
            cfg = "x".join(str(c) for c in row["config"][:2]) + f" w{row['config'][2]} s{row['config'][3]}"
            lines.append(f"| {label} | {row['shape']} | {cb['us_each']:.1f} ({cb['tbps']:.2f}) | "
                         f"{en['us_each']:.1f} ({en['tbps']:.2f}) {cfg} | {best} |")
    if "w8a16_table" in res:
        lines += [*w8a16_ab.summary(rows), *(f"- {x}" for x in res["w8a16_table"])]
    if "pdl_table" in res:
        lines += ["\n## the PDL table's entry from this run (rapidserve/ops/pdl_table.py)\n",
                  *(f"- {x}" for x in res["pdl_table"])]
    lines += ["", "| batch | variant | replay ms (min-max) | engine chooses | PDL ms | no PDL ms | no prefetch ms | "
              "unfused small kernels ms (launches) | of copy ceiling | launches | kernels us | gaps us |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pdl_ms, no_pdl_ms, no_pf_ms = (f"{r[f'{k}_ms']:.3f}" if f"{k}_ms" in r else "-" for k in AB)
        nofold = (f"{r[f'{NOFOLD}_ms']:.3f} ({r[f'{NOFOLD}_launches']:.0f})" if f"{NOFOLD}_ms" in r else "-")
        lines.append(f"| {r['batch']} | {r['variant']} | {r['replay_ms']:.3f} ({r['replay_min_ms']:.3f}-"
                     f"{r['replay_max_ms']:.3f}) | {r['engine_launch']} | {pdl_ms} | {no_pdl_ms} | {no_pf_ms} | "
                     f"{nofold} | {float(r['frac_of_copy']):.1%} | {r['launches']:.0f} | {r['kernel_us']:.0f} | "
                     f"{r['gap_us']:.0f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "decode_profile.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
