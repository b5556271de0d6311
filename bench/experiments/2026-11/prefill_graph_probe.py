"""What CUDA graphs would save a prefill forward, by chunk size (issue 16 item 3: "CUDA graphs wherever shapes
allow: prefill chunks by bucket or piecewise"). A probe to decide whether to build them.

    python bench/experiments/2026-11/prefill_graph_probe.py [--model preset:qwen3-8b]
        [--tokens 16,32,64,128,256,512,1024,2048] [--seqs 1] [--context 0] [--host-profile N] [--out DIR]

For each chunk of T prompt tokens (split over --seqs sequences, each after --context cached tokens), with the
engine's runner (bf16, random weights, attention backend auto) it times, as medians of 20 (CUDA events):
  - eager: `runner.prefill(items)` as the prefill worker calls it: host inputs built and copied, every kernel
    launched from Python;
  - piecewise: the same call replaying the engine's piecewise prefill graphs (rapidserve/runner/prefill_graphs.py, one
    bucket per size, attention launched between the pieces), as the engine runs it by default;
  - busy: the GPU time of its kernels (torch.profiler): what no launch overhead could shorten;
  - graph: the same forward captured once as a CUDA graph with its inputs in place and replayed: the most a
    prefill graph per chunk-size bucket could give (no padding to a bucket, no input copies).
The gap eager - graph is what launching from Python costs at that size; where it is a small share of eager,
prefill graphs are not worth their capture time and memory. Writes <out>/prefill_graph_probe.json; prints the
table last.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))  # bench/experiments/2026-11
BENCH = os.path.dirname(os.path.dirname(HERE))  # bench/: the shared helpers (gpu_timing, model_runner)
sys.path[:0] = [HERE, BENCH, os.path.dirname(BENCH)]  # and the repository root, for rapidserve

from gpu_timing import time_ms  # noqa: E402
from model_runner import engine_config, preset_source  # noqa: E402

from rapidserve.loader.presets import preset_config  # noqa: E402
from rapidserve.runner import ModelRunner, PrefillItem  # noqa: E402
from rapidserve.runner.prefill_graphs import PrefillGraphs  # noqa: E402

REPS = 20


def items_for(tokens: int, seqs: int, context: int, block_size: int, vocab: int, gen: torch.Generator,
              ) -> list[PrefillItem]:
    """`seqs` prompts sharing `tokens` new tokens, each after `context` cached ones, on separate blocks."""
    lens = [tokens // seqs + (1 if i < tokens % seqs else 0) for i in range(seqs)]
    out, nxt = [], 0
    for n in lens:
        blocks = -(-(context + n) // block_size)
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        out.append(PrefillItem(ids, context, list(range(nxt, nxt + blocks))))
        nxt += blocks
    return out


def busy_ms(fn: object) -> float:
    """GPU time of the kernels of one call of fn (ms), summed over kernels."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()  # type: ignore[operator]
        torch.cuda.synchronize()
    total = sum(ev.device_time for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)
    return total / 1e3 / 3


def graph_ms(runner: ModelRunner, items: list[PrefillItem]) -> float:
    """Replay time of the prefill forward captured for exactly these items (inputs built once, in place)."""
    arrays = runner._prefill_arrays(items)
    ids, positions, _, _, _, cu, want = arrays
    meta = runner._prefill_meta(arrays)
    tokens, pos = runner._dev(ids), runner._dev(positions)
    last = runner._dev(cu[1:][want] - 1)

    def forward() -> torch.Tensor:
        hidden = runner.model(tokens, pos, runner.kv_pool.layers, meta)
        return runner.model.compute_logits(hidden.index_select(0, last))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # warm up on a side stream, as torch.cuda.graphs recommends
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    times = time_ms(graph.replay, reps=REPS)
    del graph
    return statistics.median(times)


def host_profile(runner: ModelRunner, items: list[PrefillItem], top: int) -> str:
    """Where the host's time goes in 10 eager prefills of `items` (cProfile, sorted by own time)."""
    for _ in range(3):
        runner.prefill(items)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        runner.prefill(items)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:qwen3-8b")
    ap.add_argument("--tokens", default="16,32,64,128,256,512,1024,2048")
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--context", type=int, default=0, help="cached tokens before each prompt's chunk")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also print the N functions with the most host time per size (cProfile), to "
                         "<out>/prefill_host_profile.txt")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("prefill_graph_probe.py needs a CUDA (or ROCm) GPU: it times CUDA graphs", file=sys.stderr)
        return 2
    sizes = [int(x) for x in a.tokens.split(",")]
    if a.seqs < 1 or any(t < a.seqs for t in sizes) or a.context < 0:
        print("--seqs must be >= 1 and at most every --tokens size; --context >= 0", file=sys.stderr)
        return 2
    name = a.model.removeprefix("preset:")
    mcfg = preset_config(name)
    ecfg = engine_config(name, mcfg, "bfloat16", (1,), max(8192, a.context + max(sizes)), 0.85)
    runner = ModelRunner(ecfg, preset_source(name, mcfg, "cuda", torch.bfloat16), show_progress=False)
    gen = torch.Generator().manual_seed(0)
    # the engine's piecewise graphs (rapidserve/runner/prefill_graphs.py), one bucket per size: capture time and memory
    torch.cuda.synchronize()
    mem0, t0 = torch.cuda.memory_reserved(), time.perf_counter()
    pieces = PrefillGraphs(runner.model, runner.kv_pool.layers, sorted(sizes))
    pieces.capture("default")
    capture_s, capture_mib = time.perf_counter() - t0, (torch.cuda.memory_reserved() - mem0) / 2**20
    print(f"piecewise graphs of {len(sizes)} buckets captured in {capture_s:.1f} s, {capture_mib:.0f} MiB", flush=True)
    rows: list[dict[str, float]] = []
    profiles: list[str] = []
    for t in sizes:
        items = items_for(t, a.seqs, a.context, runner.block_size, mcfg.vocab_size, gen)
        runner._prefill_graphs = None
        eager = time_ms(lambda items=items: runner.prefill(items), reps=REPS)
        want = runner.prefill(items)
        runner._prefill_graphs = pieces
        piecewise = time_ms(lambda items=items: runner.prefill(items), reps=REPS)
        got = runner.prefill(items)
        runner._prefill_graphs = None
        logit_diff = float((got - want).abs().max())
        row = {"tokens": t, "seqs": a.seqs, "context": a.context, "eager_ms": statistics.median(eager),
               "eager_min_ms": min(eager), "eager_max_ms": max(eager),
               "piecewise_ms": statistics.median(piecewise), "piecewise_min_ms": min(piecewise),
               "piecewise_max_ms": max(piecewise), "piecewise_logit_max_abs_diff": logit_diff,
               "piecewise_same_argmax": bool(torch.equal(got.argmax(-1), want.argmax(-1))),
               "busy_ms": busy_ms(lambda items=items: runner.prefill(items)), "graph_ms": graph_ms(runner, items)}
        row["saved_share"] = 1 - row["graph_ms"] / row["eager_ms"]
        row["piecewise_saved_share"] = 1 - row["piecewise_ms"] / row["eager_ms"]
        if a.host_profile:
            profiles.append(f"## {t} tokens\n\n" + host_profile(runner, items, a.host_profile))
        rows.append(row)
        print(f"{t} tokens: eager {row['eager_ms']:.2f} ms, piecewise {row['piecewise_ms']:.2f} (logits max |diff| "
              f"{logit_diff:.3g}, same argmax {row['piecewise_same_argmax']}), busy {row['busy_ms']:.2f}, graph "
              f"{row['graph_ms']:.2f}", flush=True)
    meta = {"gpu": torch.cuda.get_device_name(0), "model": a.model, "attention": runner.attn.name,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python bench/experiments/2026-11/prefill_graph_probe.py " + " ".join(sys.argv[1:]),
            "piecewise_capture_s": capture_s, "piecewise_capture_mib": capture_mib, "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "prefill_graph_probe.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if profiles:
        with open(os.path.join(a.out, "prefill_host_profile.txt"), "w") as f:
            f.write("\n".join(profiles))
        print("\n".join(profiles))
    print(f"\n{meta['gpu']}, {a.model}, attention {meta['attention']}, {a.seqs} sequence(s) after {a.context} "
          "cached tokens\n")
    print(f"piecewise graphs: {len(sizes)} buckets captured in {capture_s:.1f} s, {capture_mib:.0f} MiB\n")
    print("| tokens | eager ms (min-max) | piecewise graphs ms (min-max) | piecewise saves | kernels busy ms | "
          "whole-forward graph ms | whole graph saves |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['eager_ms']:.2f} ({r['eager_min_ms']:.2f}-{r['eager_max_ms']:.2f}) | "
              f"{r['piecewise_ms']:.2f} ({r['piecewise_min_ms']:.2f}-{r['piecewise_max_ms']:.2f}) | "
              f"{r['piecewise_saved_share']:.0%} | {r['busy_ms']:.2f} | {r['graph_ms']:.2f} | {r['saved_share']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
