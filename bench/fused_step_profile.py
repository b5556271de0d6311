"""What a fused step costs beyond its tokens, and in which kernels (issue 37: where the 50-ms SLO's time goes).

    python bench/fused_step_profile.py [--model preset:qwen3-8b] [--backend auto] [--steps 8] [--idle-ms 0]
        [--quantization none|fp8] [--no-ladder] [--out DIR]

A fused step is the decode worker's mixed forward (engine/step_launch.py `launch_step`): the running requests' decode
rows as one-token prompt items first, then the prompt chunks, replaying the piecewise prefill graphs up to their largest
bucket (2048 tokens) and eager above. The step traces of 2026-11-30 (bench/results/h200x2_1130f/) fitted duet's fused
steps on 4096:64 to ~7.8 ms a step + 18.2 us a prompt token + the chunks' attention: this script says where that fixed
part lies. (Its first run, h200x2_1130g/fused_step_profile.md: 2.31 ms a step + 21.9 us a token over a ladder of
256-8192 tokens; the 7.8 ms was an intercept the 1-2K-token serving steps do not determine.) On a bare GPU machine
`--backend auto` finds no FA3 and runs the Triton kernels; serving beside vLLM prefills with vLLM's FA3 build. To
profile that: after the `bash bench/vs_vllm.sh --stash` calls (one per part `bash bench/vs_vllm.sh --split` cut),
install the stash as bench/fa3_check.sh does and put it on PYTHONPATH (bench/peer_env.sh `expose_fa3`), then
`--backend fa3`. For each shape of `SHAPES` (decode rows at a context, one prompt chunk after a cached prefix) it builds
the step's items the way `launch_step` does, times the forward (CUDA events, median of --steps after a warm-up, each
right behind an untimed one as the engine launches its steps one ahead, so the host's work on it is not counted:
gpu_timing.back_to_back_ms; `--idle-ms M`: each step after M ms with the GPU idle, timed alone, its profiled steps
too, so a power-limited GPU runs them at the clocks of one request at a time, as bench/vllm_step_profile.py times
vLLM's: bench/gemm_duty_cycle.py found that worth 5-15% on the same GEMMs) and, under torch.profiler, sums its
kernels' device time by category (bench/step_profile.py's) and the time no kernel ran (the gaps: launches between the
graph pieces and the eager attention).

Then a least-squares line through the shapes without decode rows, ms = fixed + per_token x T (+ the chunks' causal
attention pairs), the fixed part of a step on this GPU, and per shape its tokens/s against the largest chunk's.
Writes <out>/fused_step_profile.json and .md; prints the table last. Needs a GPU (the CPU tests cover `fit`,
`step_items` and `table`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Shape:
    rows: int  # decode rows
    context: int  # each decode row's context (tokens in the cache after its step)
    chunk: int  # prompt tokens of the step's one chunk
    prefix: int  # tokens of that prompt already in the cache

    @property
    def tokens(self) -> int:
        return self.rows + self.chunk

    @property
    def label(self) -> str:
        rows = f"{self.rows} x {self.context}" if self.rows else "0"
        return f"rows {rows}, chunk {self.chunk}" + (f" after {self.prefix}" if self.prefix else "")


# The shapes of the 1130f traces (4096:64: 1-17 rows at ~4K beside 1-2K chunks; 1024:256: ~100-300 rows at ~1.1K
# beside ~1.1K) and a ladder of chunks alone for the fit.
SHAPES: tuple[Shape, ...] = (
    Shape(0, 0, 512, 0), Shape(0, 0, 1024, 0), Shape(0, 0, 1616, 0), Shape(0, 0, 2048, 0), Shape(0, 0, 4096, 0),
    Shape(0, 0, 8192, 0), Shape(1, 4097, 1616, 0), Shape(17, 4100, 1296, 1616), Shape(104, 1150, 1136, 0),
    Shape(300, 1150, 1136, 0),
)


def pairs(s: Shape) -> float:
    """The chunk's causal attention: query-key pairs (each of its tokens attends to the prefix and the chunk so far)."""
    return s.chunk * (s.prefix + (s.chunk + 1) / 2)


def step_items(s: Shape, block_size: int, num_blocks: int, vocab: int, seed: int = 0) -> list[Any]:
    """The step's items as `launch_step` makes them: the decode rows (one token at position context - 1), then the
    chunk (its tokens after its prefix, logits for its last); block tables over a pool of `num_blocks` (ValueError
    when the shape needs more)."""
    from rapidserve.runner import PrefillItem

    rng = np.random.default_rng(seed)
    need = s.rows * -(-s.context // block_size) + -(-(s.prefix + s.chunk) // block_size)
    if need > num_blocks:
        raise ValueError(f"{s.label} needs {need} KV blocks; the pool has {num_blocks}")
    items, nxt = [], 0
    for _ in range(s.rows):
        n = -(-s.context // block_size)
        items.append(PrefillItem([int(rng.integers(vocab))], s.context - 1, list(range(nxt, nxt + n))))
        nxt += n
    n = -(-(s.prefix + s.chunk) // block_size)
    items.append(PrefillItem(rng.integers(0, vocab, s.chunk).tolist(), s.prefix, list(range(nxt, nxt + n))))
    return items


def fit(points: Sequence[tuple[Shape, float]]) -> dict[str, float]:
    """ms = fixed + per_token x tokens + per_mpair x (attention pairs / 1e6), least squares over `points` (the
    shapes without decode rows); ValueError with fewer than three."""
    if len(points) < 3:
        raise ValueError("the fit needs at least three shapes")
    x = np.array([[1.0, s.tokens, pairs(s) / 1e6] for s, _ in points])
    y = np.array([ms for _, ms in points])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    err = np.abs(x @ coef - y) / y
    return {"fixed_ms": float(coef[0]), "per_token_us": float(coef[1] * 1e3), "per_mpair_ms": float(coef[2]),
            "median_abs_err": float(np.median(err))}


def table(rows: Sequence[dict[str, Any]], cats: Sequence[str], f: dict[str, float] | None) -> str:
    """The report's table: per shape its step time, prompt tokens/s (and of the best chunk alone), the kernel
    categories and the gaps; then the fit."""
    from table_out import md_table

    best = max((r["chunk_tokens_per_s"] for r in rows if r["rows"] == 0), default=0.0)
    out = [md_table(["shape", "ms (min-max)", "prompt tok/s", "of best", *cats, "gaps"],
                    ([r["label"], f"{r['ms']:.2f} ({r['min_ms']:.2f}-{r['max_ms']:.2f})",
                      f"{r['chunk_tokens_per_s']:,.0f}", f"{r['chunk_tokens_per_s'] / best if best else 0:.2f}",
                      *(f"{r['categories_ms'].get(k, 0.0):.2f}" for k in cats), f"{r['gaps_ms']:.2f}"] for r in rows))]
    if f is not None:
        out += ["", f"Fit over the shapes without decode rows: **{f['fixed_ms']:.2f} ms a step** + "
                    f"{f['per_token_us']:.2f} us a token + {f['per_mpair_ms']:.3f} ms per million query-key pairs "
                    f"(median abs error {f['median_abs_err']:.1%})."]
    return "\n".join(out)


# The ladder: a chunk alone every 128 tokens from 256 to 4096 (past the largest graph bucket, 2048), timed only. The
# fused step pads to its bucket (128 tokens apart above 1024) and its GEMMs run in waves of output tiles over the SMs,
# so its time need not grow smoothly with the chunk: where tokens/s dips between two chunk sizes, a policy choosing
# the chunk could prefer the better (bench/results/h200x2_1130f/README.md).
LADDER = tuple(range(256, 4096 + 1, 128))


def ladder_table(rungs: Sequence[dict[str, Any]]) -> str:
    """The ladder: per chunk its ms, tokens/s and tokens/s over the best rung at or below it (a dip below 1 is a
    chunk size that buys fewer tokens a second than a smaller one)."""
    out = ["| chunk tokens | ms | tokens/s | of the best below |", "|---|---|---|---|"]
    best = 0.0
    for r in rungs:
        best = max(best, r["tokens_per_s"])
        out.append(f"| {r['tokens']} | {r['ms']:.2f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / best:.2f} |")
    return "\n".join(out)


def measure(model: str, backend: str, steps: int, shapes: Sequence[Shape], ladder: Sequence[int] = (),
            fp8: bool = False, idle_s: float = 0.0,
            ) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """`idle_s` > 0: each timed and profiled step after that long idle, timed alone (its host's lead-in counted)
    instead of back to back (--idle-ms, module docstring)."""
    import torch
    from gpu_timing import back_to_back_ms, time_ms
    from model_runner import engine_config, preset_source
    from step_profile import timed_and_profiled

    from rapidserve.loader.presets import preset_config
    from rapidserve.runner import ModelRunner

    name = model.removeprefix("preset:")
    mcfg = preset_config(name)
    ecfg = engine_config(name, mcfg, "bfloat16", (512,), 16384, 0.9, fp8=fp8)  # 512 seqs: SHAPES' 301 sequences
    ecfg = dataclasses.replace(ecfg, runner=dataclasses.replace(ecfg.runner, attention_backend=backend))
    runner = ModelRunner(ecfg, preset_source(name, mcfg, "cuda", torch.bfloat16), show_progress=False)
    pool = runner.kv_pool
    for layer in range(pool.tensor.shape[0]):
        pool.tensor[layer].normal_()
    runner.capture_prefill_graphs(key="default", show_progress=False)  # the decode worker's fused-step graphs
    out, left_out = [], []
    for s in shapes:
        try:
            items = step_items(s, runner.block_size, pool.num_blocks, mcfg.vocab_size)
        except ValueError as e:  # a large model's pool holds fewer blocks: that shape is left out, and said so
            left_out.append(str(e))
            print(f"{s.label}: left out ({e})", flush=True)
            continue

        def fn(items: list[Any] = items) -> Any:
            return runner.prefill(items)

        wall, cats, top = timed_and_profiled(fn, steps, time_ms if idle_s > 0 else back_to_back_ms, idle_s=idle_s)
        ms = statistics.median(wall)
        out.append({"label": s.label, **dataclasses.asdict(s), "ms": ms, "min_ms": min(wall), "max_ms": max(wall),
                    "chunk_tokens_per_s": 1e3 * s.chunk / ms, "categories_ms": cats, "top_kernels_ms": top,
                    "gaps_ms": max(0.0, ms - sum(cats.values()))})
        print(f"{s.label}: {ms:.2f} ms", flush=True)
    rungs = []
    for t in ladder:
        items = step_items(Shape(0, 0, t, 0), runner.block_size, pool.num_blocks, mcfg.vocab_size)
        ms = statistics.median(back_to_back_ms(lambda items=items: runner.prefill(items), reps=steps))
        rungs.append({"tokens": t, "ms": ms, "tokens_per_s": 1e3 * t / ms})
    return runner.attn.name, out, rungs, left_out


def timing_note(idle_ms: float) -> str:
    """How the steps were timed, for the table's heading."""
    if idle_ms > 0:
        return f"Each step after {idle_ms:g} ms idle, timed alone (its host's lead-in in `gaps`)"
    return "Steps back to back (the device's work only)"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:qwen3-8b")
    ap.add_argument("--backend", default="auto", help="attention backend (RunnerConfig.attention_backend)")
    ap.add_argument("--steps", type=int, default=8, help="timed forwards a shape (median), and profiled")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "fused_step_profile"))
    ap.add_argument("--no-ladder", action="store_true", help="skip the ladder of chunk sizes (LADDER)")
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none",
                    help="fp8: the weights quantized at load, as `serve --quantization fp8`")
    ap.add_argument("--idle-ms", type=float, default=0.0,
                    help="leave the GPU idle this long before each timed and profiled step (default 0: back to back)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    if not a.idle_ms >= 0:
        ap.error("--idle-ms must be >= 0")
    import torch

    if not torch.cuda.is_available():
        print("fused_step_profile needs a GPU", file=sys.stderr)
        return 2
    from step_profile import CATEGORIES

    fp8 = a.quantization == "fp8"
    backend, rows, rungs, left_out = measure(a.model, a.backend, a.steps, SHAPES, () if a.no_ladder else LADDER, fp8,
                                             a.idle_ms / 1000)
    by_label = {r["label"]: r for r in rows}  # shapes that did not fit the KV pool are absent
    alone = [(s, by_label[s.label]["ms"]) for s in SHAPES if s.rows == 0 and s.label in by_label]
    f = fit(alone) if len(alone) >= 3 else None
    cats = [c for c, _ in CATEGORIES] + ["other"]
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "backend": backend,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"), "model": a.model,
           "weights": "fp8" if fp8 else "bf16", "idle_ms": a.idle_ms,
           "command": "python bench/fused_step_profile.py " + " ".join(sys.argv[1:]), "fit": f, "shapes": rows,
           "ladder": rungs, "left_out": left_out}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fused_step_profile.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    text = (f"# A fused step's time by kernel category: {a.model} {res['weights']} on {res['gpu']} "
            f"({res['date']}, {backend})\n\n"
            f"Command: `{res['command']}`. Milliseconds per step (median of {a.steps}); `gaps`: step time no "
            "kernel ran. " + timing_note(a.idle_ms) + ".\n\n" + table(rows, cats, f) + "\n"
            + "".join(f"\nLeft out: {why}.\n" for why in left_out))
    if rungs:
        text += ("\nThe ladder: one chunk alone at each size (no profiler; median of the timed forwards):\n\n"
                 + ladder_table(rungs) + "\n")
    for r in rows:
        text += f"\nLongest kernels, {r['label']} (ms per step):\n\n"
        text += "\n".join(f"- {v:.3f} `{k}`" for k, v in r["top_kernels_ms"].items()) + "\n"
    with open(os.path.join(a.out, "fused_step_profile.md"), "w") as fh:
        fh.write(text)
    print(text[text.index("| shape"):text.index("\nLongest") if "\nLongest" in text else len(text)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
