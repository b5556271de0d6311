"""FP8 weights against bf16 on one GPU, same model shape and weights (issue 39's "must show", first rows).

    python bench/fp8_speed.py [--model preset:qwen3-8b] [--out bench/results] [--reps 10] [--num-layers N]

--num-layers N keeps the preset's layer shapes and takes its first N layers: for a shape whose bf16 weights do not fit
one GPU beside the fp8 copy (Llama-3.1-70B: 141 GB in bf16), its per-layer speed and an N-layer model's logits error.

For the bf16 model and the same weights quantized at load (`--quantization fp8`: per-channel weight scales,
dynamic per-token activation scales, the `quant_config.ONLINE_FP8` scheme), it measures:
  prefill   forward of 8x1024 and 2x4096 prompt tokens (ms; target fp8 >= 1.5x bf16 at 2x4096)
  decode    one decode step at batch 1, 16, 64 with 2048-token contexts, the CUDA graph replayed alone
            (ms; target: step time falls with the bytes, >= 1.6x fewer bytes read per step)
  logits    the last token's logits of three prompts, fp8 against bf16 (relative error of the norm) and
            whether the argmax agrees
  fusion    the fp8 decode step again with the fusion of activation quantization into the norms and SiLU-and-mul
            off (`ops.unfused_fp8`: each fp8 projection quantizes its own input, a launch and a pass more), its
            graphs captured in the same process: the columns "fp8 unfused ms" and "fusion gain" (unfused / fused)
  fp8 KV    the fp8 model again with `--kv-cache-dtype fp8` (uncalibrated scales, 1.0): at batch 64 x 2048 the bf16
            KV cache is about as many bytes a step as the fp8 weights, so the weights alone cannot make a step 1.6x
            faster there; the columns "fp8+KV fp8 ms" and its speedup over bf16
Medians over repeats with min/max. Writes <out>/fp8_speed.json and .md; prints the table last.
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

from gpu_timing import run_record, time_ms, write_json  # noqa: E402
from model_runner import engine_config, preset_source, stats  # noqa: E402

from rapidserve.config import EngineConfig, ModelConfig  # noqa: E402
from rapidserve.loader.presets import preset_config  # noqa: E402
from rapidserve.ops import unfused_fp8  # noqa: E402
from rapidserve.runner import DecodeItem, ModelRunner, PrefillItem  # noqa: E402

BATCHES = (1, 16, 64)
CTX = 2048


def build(name: str, mcfg: ModelConfig, fp8: bool, kv_fp8: bool = False) -> ModelRunner:
    cfg: EngineConfig = engine_config(name, mcfg, "bfloat16", BATCHES, 8192, 0.45, fp8=fp8,
                                      kv_cache_dtype="fp8" if kv_fp8 else "auto")
    return ModelRunner(cfg, preset_source(name, mcfg, "cuda", torch.bfloat16), show_progress=False)


def weight_bytes(runner: ModelRunner) -> int:
    return sum(p.numel() * p.element_size() for p in runner.model.parameters()) + sum(
        b.numel() * b.element_size() for b in runner.model.buffers() if b.dtype != torch.float32 or b.numel() > 1)


def measure(runner: ModelRunner, mcfg: ModelConfig, reps: int, fusion_ab: bool = False) -> dict[str, object]:
    """Prefill and decode times and the logits of three prompts; with `fusion_ab` also each decode step with the
    fp8 fusion off (graphs captured under the key "unfused")."""
    pool = runner.kv_pool
    for layer in range(pool.tensor.shape[0]):
        pool.tensor[layer].copy_(torch.randn(pool.tensor[layer].shape, device=pool.tensor.device))  # fp8 has no normal_
    runner.capture_decode_graphs(key="full")
    if fusion_ab:
        fused_ops = runner.model.ops
        runner.model.ops = unfused_fp8(fused_ops)
        try:
            runner.capture_decode_graphs(key="unfused")
        finally:
            runner.model.ops = fused_ops
    bs, nblocks = runner.block_size, pool.num_blocks
    g = torch.Generator().manual_seed(1)
    out: dict[str, object] = {"weight_bytes": weight_bytes(runner)}
    pre = []
    for nseq, qlen in ((8, 1024), (2, 4096)):
        per = -(-qlen // bs)
        items = [PrefillItem(torch.randint(0, mcfg.vocab_size, (qlen,), generator=g).tolist(), 0,
                             list(range(i * per, (i + 1) * per))) for i in range(nseq)]
        pre.append({"shape": f"{nseq}x{qlen}", "ms": stats(time_ms(lambda items=items: runner.prefill(items),
                                                                     reps=reps))})
    out["prefill"] = pre
    dec = []
    per = CTX // bs
    for b in BATCHES:
        items = [DecodeItem(1, CTX - 1, [(i * per + j) % nblocks for j in range(per)]) for i in range(b)]
        runner.decode(items, graph_key="full")
        graph = runner.decode_graph(b, "full")
        step = graph.replay if graph is not None else (lambda items=items: runner.decode(items, graph_key="full"))
        ms = time_ms(step, reps=3 * reps)
        row: dict[str, object] = {"batch": b, "ctx": CTX, "replay_ms": stats(ms)}
        if fusion_ab:
            runner.decode(items, graph_key="unfused")
            graph = runner.decode_graph(b, "unfused")
            step = graph.replay if graph is not None else (
                lambda items=items: runner.decode(items, graph_key="unfused"))
            row["unfused_replay_ms"] = stats(time_ms(step, reps=3 * reps))
        dec.append(row)
    out["decode"] = dec
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, mcfg.vocab_size, (n,), generator=g).tolist() for n in (100, 37, 300)]
    tables, nb = [], 0
    for p in prompts:
        k = -(-len(p) // bs)
        tables.append(list(range(nb, nb + k)))
        nb += k
    logits = runner.prefill([PrefillItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    out["logits"] = [row.float().cpu() for row in logits]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:qwen3-8b")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--num-layers", type=int, default=None,
                    help="the preset's first N layers (its shapes kept): a model too large in bf16 for one GPU")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp8_speed needs a GPU", file=sys.stderr)
        return 2
    name = a.model.removeprefix("preset:")
    mcfg = preset_config(name)
    if a.num_layers is not None:
        if not 1 <= a.num_layers <= mcfg.num_layers:
            ap.error(f"--num-layers must be 1..{mcfg.num_layers} for {a.model}, got {a.num_layers}")
        mcfg = dataclasses.replace(mcfg, num_layers=a.num_layers)
    res = run_record("fp8_speed.py", model=a.model, num_layers=mcfg.num_layers)
    runs: dict[str, dict[str, object]] = {}
    for kind in ("bf16", "fp8", "fp8_kv"):
        runner = build(name, mcfg, kind != "bf16", kv_fp8=kind == "fp8_kv")
        runs[kind] = measure(runner, mcfg, a.reps, fusion_ab=kind == "fp8")
        del runner
        torch.cuda.empty_cache()
        print(kind, "done", flush=True)
    ref = runs["bf16"]["logits"]
    errs, agree = {}, {}
    for kind in ("fp8", "fp8_kv"):
        q = runs[kind]["logits"]
        errs[kind] = [float((y - x).norm() / x.norm()) for x, y in zip(ref, q, strict=True)]  # type: ignore[arg-type]
        agree[kind] = [int(x.argmax()) == int(y.argmax()) for x, y in zip(ref, q, strict=True)]  # type: ignore[arg-type]
    for kind in runs:
        runs[kind].pop("logits")
    res["runs"] = runs
    res["logits_rel_err"] = errs
    res["argmax_agrees"] = agree
    rows = []
    for i, p in enumerate(runs["bf16"]["prefill"]):  # type: ignore[arg-type]
        b, f = p["ms"]["median"], runs["fp8"]["prefill"][i]["ms"]["median"]  # type: ignore[index]
        kv = runs["fp8_kv"]["prefill"][i]["ms"]["median"]  # type: ignore[index]
        rows.append((f"prefill {p['shape']}", b, f, runs["fp8"]["prefill"][i]["ms"], None, kv))  # type: ignore[index]
    for i, d in enumerate(runs["bf16"]["decode"]):  # type: ignore[arg-type]
        q = runs["fp8"]["decode"][i]  # type: ignore[index]
        b, f = d["replay_ms"]["median"], q["replay_ms"]["median"]
        kv = runs["fp8_kv"]["decode"][i]["replay_ms"]["median"]  # type: ignore[index]
        rows.append((f"decode b={d['batch']} ctx={d['ctx']}", b, f, q["replay_ms"], q["unfused_replay_ms"]["median"],
                     kv))
    res["table"] = [{"row": r, "bf16_ms": b, "fp8_ms": f, "speedup": b / f, "fp8_spread": s, "fp8_unfused_ms": u,
                     "fusion_gain": None if u is None else u / f, "fp8_kv_ms": kv, "fp8_kv_speedup": b / kv}
                    for r, b, f, s, u, kv in rows]
    wb, wf = runs["bf16"]["weight_bytes"], runs["fp8"]["weight_bytes"]
    res["weight_bytes_ratio"] = wb / wf  # type: ignore[operator]
    write_json(a.out, "fp8_speed", res)
    depth = "" if a.num_layers is None else f" (its first {a.num_layers} layers)"
    lines = [f"# FP8 weights vs bf16: {a.model}{depth} on {res['gpu']} ({res['date']})", "",
             f"Command: `{res['command']}`. Medians of {a.reps} (prefill) / {3 * a.reps} (decode replay) runs.", "",
             f"Weight bytes bf16 / fp8: {res['weight_bytes_ratio']:.2f}x. Logits rel. err fp8 vs bf16: "
             + ", ".join(f"{e:.4f}" for e in errs["fp8"]) + f"; argmax agrees: {agree['fp8']}; with the fp8 KV "
             "cache too: " + ", ".join(f"{e:.4f}" for e in errs["fp8_kv"]) + f"; argmax agrees: {agree['fp8_kv']}",
             "",
             "fp8 unfused: the same fp8 model with each projection quantizing its own input (`ops.unfused_fp8`); "
             "fusion gain = fp8 unfused / fp8.", "",
             "| row | bf16 ms | fp8 ms (min-max) | fp8 speedup | fp8 unfused ms | fusion gain | fp8+KV fp8 ms | "
             "speedup |", "|---|---|---|---|---|---|---|---|"]
    for t in res["table"]:  # type: ignore[union-attr]
        s = t["fp8_spread"]
        u = "-" if t["fp8_unfused_ms"] is None else f"{t['fp8_unfused_ms']:.3f}"
        gain = "-" if t["fusion_gain"] is None else f"{t['fusion_gain']:.3f}x"
        lines.append(f"| {t['row']} | {t['bf16_ms']:.2f} | {t['fp8_ms']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | "
                     f"{t['speedup']:.2f}x | {u} | {gain} | {t['fp8_kv_ms']:.2f} | {t['fp8_kv_speedup']:.2f}x |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "fp8_speed.md"), "w") as fh:
        fh.write(md)
    print(md)
    print("median of medians speedup:", statistics.median(t["speedup"] for t in res["table"]))  # type: ignore[union-attr]
    return 0


if __name__ == "__main__":
    sys.exit(main())
