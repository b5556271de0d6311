"""The MLP by row slices (models/projections.py `MLP_ROW_CHUNK`) against the whole step's MLP, on one GPU: what it
saves of a prefill step's activation peak (which the KV pool's budget keeps once per step-running process,
runner/kv_budget.py) and what it costs in prefill time.

    python bench/mlp_slices_ab.py [--models preset:qwen3-8b,preset:qwen3-8b:fp8,preset:llama-3.1-70b:fp8:20]
                                  [--chunk 2048] [--reps 7] [--rounds 2] [--out bench/results]

A model is `preset:NAME[:fp8][:LAYERS]` (fp8: `--quantization fp8` at load; LAYERS: the preset's first N layers,
for a shape whose weights do not fit otherwise). For each, one runner (random weights, 256 KV blocks), then for the
prefill shapes 1x8192 and 2x4096 tokens, in `--rounds` alternating rounds of sliced (slices of `--chunk` rows) and whole
(the chunk set above the step's rows):
  peak    the step's tensors' peak above what was allocated before it (torch.cuda.max_memory_allocated), GiB
  ms      the step's time (CUDA events), median of the rounds' medians, with min / max of every rep
  logits  the last token's logits sliced against whole: relative error of the norm, argmax agreement
Writes <out>/mlp_slices_ab.json and .md; prints the table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_timing import run_record, time_ms, write_json, write_md  # noqa: E402
from model_runner import engine_config, preset_source  # noqa: E402

from rapidserve.config import ModelConfig  # noqa: E402
from rapidserve.loader.presets import preset_config  # noqa: E402
from rapidserve.models import projections  # noqa: E402
from rapidserve.runner import ModelRunner, PrefillItem  # noqa: E402

SHAPES = ((1, 8192), (2, 4096))
GIB = float(1 << 30)
WHOLE = 1 << 30  # a chunk above any step's rows: the MLP whole


def parse_model(text: str) -> tuple[str, bool, int | None]:
    """`preset:NAME[:fp8][:LAYERS]` as (NAME, fp8, LAYERS or None); ValueError naming what is wrong."""
    parts = text.split(":")
    if len(parts) < 2 or parts[0] != "preset" or not parts[1]:
        raise ValueError(f"--models item {text!r}: give preset:NAME[:fp8][:LAYERS]")
    fp8, layers = False, None
    for p in parts[2:]:
        if p == "fp8":
            fp8 = True
        elif p.isdigit() and int(p) > 0:
            layers = int(p)
        else:
            raise ValueError(f"--models item {text!r}: {p!r} is neither fp8 nor a positive layer count")
    return parts[1], fp8, layers


def items_for(mcfg: ModelConfig, nseq: int, qlen: int, block: int) -> list[PrefillItem]:
    g = torch.Generator().manual_seed(qlen + nseq)
    per = -(-qlen // block)
    return [PrefillItem(torch.randint(0, mcfg.vocab_size, (qlen,), generator=g).tolist(), 0,
                        list(range(i * per, (i + 1) * per))) for i in range(nseq)]


def one(runner: ModelRunner, items: list[PrefillItem], chunk: int,
        reps: int) -> tuple[float, list[float], torch.Tensor]:
    """(peak GiB, times ms, last logits) of the prefill of `items` with the MLP chunk `chunk`."""
    projections.MLP_ROW_CHUNK = chunk
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logits = runner.prefill(items)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    ms = time_ms(lambda: runner.prefill(items), reps=reps)
    return peak, ms, logits[-1].float().cpu()


def measure(spec: str, chunk: int, reps: int, rounds: int) -> list[dict[str, object]]:
    name, fp8, layers = parse_model(spec)
    mcfg = preset_config(name)
    if layers is not None:
        mcfg = dataclasses.replace(mcfg, num_layers=min(layers, mcfg.num_layers))
    cfg = engine_config(name, mcfg, "bfloat16", (1,), 8192, 0.9, num_blocks=1100, fp8=fp8)
    runner = ModelRunner(cfg, preset_source(name, mcfg, "cuda", torch.bfloat16), show_progress=False)
    default = projections.MLP_ROW_CHUNK
    rows = []
    try:
        for nseq, qlen in SHAPES:
            items = items_for(mcfg, nseq, qlen, runner.block_size)
            got: dict[str, dict[str, list]] = {k: {"peak": [], "ms": [], "med": []} for k in ("sliced", "whole")}
            logits: dict[str, torch.Tensor] = {}
            for r in range(rounds):
                for kind in (("sliced", "whole") if r % 2 == 0 else ("whole", "sliced")):
                    peak, ms, last = one(runner, items, chunk if kind == "sliced" else WHOLE, reps)
                    got[kind]["peak"].append(peak)
                    got[kind]["ms"] += ms
                    got[kind]["med"].append(statistics.median(ms))
                    logits[kind] = last
            s, w = logits["sliced"], logits["whole"]
            row: dict[str, object] = {"model": spec, "shape": f"{nseq}x{qlen}", "chunk": chunk,
                                      "logits_rel_err": float((s - w).norm() / w.norm()),
                                      "argmax_agrees": int(s.argmax()) == int(w.argmax())}
            for kind, v in got.items():
                row[kind] = {"peak_gib": max(v["peak"]), "ms": statistics.median(v["med"]), "ms_min": min(v["ms"]),
                             "ms_max": max(v["ms"]), "n": len(v["ms"])}
            rows.append(row)
            print(f"{spec} {nseq}x{qlen} done", flush=True)
    finally:
        projections.MLP_ROW_CHUNK = default
        del runner
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict[str, object]]) -> list[str]:
    out = ["| model | prefill | peak whole (GiB) | peak sliced (GiB) | saved (GiB) | ms whole [min, max] | "
           "ms sliced [min, max] | sliced / whole time | logits rel err | argmax |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w, s = r["whole"], r["sliced"]
        assert isinstance(w, dict) and isinstance(s, dict)
        out.append(f"| {r['model']} | {r['shape']} | {w['peak_gib']:.3f} | {s['peak_gib']:.3f} | "
                   f"{w['peak_gib'] - s['peak_gib']:.3f} | {w['ms']:.2f} [{w['ms_min']:.2f}, {w['ms_max']:.2f}] | "
                   f"{s['ms']:.2f} [{s['ms_min']:.2f}, {s['ms_max']:.2f}] | {s['ms'] / w['ms']:.3f} | "
                   f"{r['logits_rel_err']:.2e} | {'same' if r['argmax_agrees'] else 'DIFFERS'} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="preset:qwen3-8b,preset:qwen3-8b:fp8,preset:llama-3.1-70b:fp8:20")
    ap.add_argument("--chunk", type=int, default=2048, help="rows per slice in the sliced rounds (measured at "
                    "2048 on 2026-12-02: the engine's MLP_ROW_CHUNK is 8192 since)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    specs = [m.strip() for m in a.models.split(",")]
    for m in specs:
        try:
            parse_model(m)
        except ValueError as e:
            ap.error(str(e))
    if a.reps < 1 or a.rounds < 1 or a.chunk < 1:
        ap.error("--chunk, --reps and --rounds must be at least 1")
    if not torch.cuda.is_available():
        print("mlp_slices_ab needs a GPU", file=sys.stderr)
        return 2
    rows = [r for spec in specs for r in measure(spec, a.chunk, a.reps, a.rounds)]
    res = run_record("mlp_slices_ab.py", rows=rows)
    write_json(a.out, "mlp_slices_ab", res)
    write_md(a.out, "mlp_slices_ab", "The MLP by row slices against whole", res, table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
