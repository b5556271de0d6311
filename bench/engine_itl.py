"""The RAPID engine under load: does decode keep producing tokens while prefill runs? (issue 3)

    python bench/engine_itl.py [--model preset:llama-3-8b] [--mps auto] [--out bench/results]

Phase 1: 32 requests with 2048-token prompts start and decode (long outputs, ignore_eos).
Phase 2: while they decode, 4096-token prompts arrive one every `--gap` seconds.
It records every token's arrival time at the router, and reports the decode requests' inter-token
latency (ITL) before and during the prefill phase, how many decode tokens arrived while each long
prompt was being prefilled, prefill throughput, and the memory each worker process holds (the
prefill worker's own device allocations should be tiny: it uses the decode worker's weights and KV
pool in place). Writes <out>/engine_itl.json, .md and a timeline PNG; prints a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rapidserve.config import LaunchConfig  # noqa: E402
from rapidserve.engine.client import AsyncEngine  # noqa: E402
from rapidserve.llm import build_engine_config  # noqa: E402
from rapidserve.sampling_params import SamplingParams  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def gpu_used_mib() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"


async def run(a: argparse.Namespace) -> dict[str, object]:
    cfg, _ = build_engine_config(a.model, dtype="bfloat16", max_model_len=8192, max_num_batched_tokens=8192,
                                 gpu_memory_utilization=a.util, max_num_seqs=64)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mps=a.mps, startup_timeout_s=500))
    t0 = time.monotonic()
    engine = await AsyncEngine.start(cfg)
    start_s = time.monotonic() - t0
    ready = {k: dict(v.info) for k, v in engine.workers.ready.items()}  # type: ignore[union-attr]
    mem_after_start = gpu_used_mib()
    vocab = cfg.model_config.vocab_size
    rng = __import__("random").Random(0)
    arrivals: dict[str, list[float]] = {}

    async def one(rid: str, n_prompt: int, max_tokens: int) -> None:
        prompt = [rng.randrange(vocab) for _ in range(n_prompt)]
        times = arrivals.setdefault(rid, [])
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for _ in engine.generate(rid, prompt, params):
            times.append(time.monotonic())

    decodes = [asyncio.create_task(one(f"d{i}", 2048, a.decode_tokens)) for i in range(32)]
    # wait until all 32 produce tokens (their prompts were prefilled), then let them decode a while
    while sum(1 for i in range(32) if len(arrivals.get(f"d{i}", [])) >= 2) < 32:
        await asyncio.sleep(0.05)
    await asyncio.sleep(a.warm)
    phase2 = time.monotonic()
    prefills = []
    windows: list[tuple[float, float]] = []
    for j in range(a.num_long):
        sent = time.monotonic()
        task = asyncio.create_task(one(f"p{j}", 4096, 1))
        prefills.append((sent, task))
        await asyncio.sleep(a.gap)
    for _, task in prefills:
        await task
    for j, (sent, _) in enumerate(prefills):
        windows.append((sent, arrivals[f"p{j}"][0]))
    phase2_end = max(w[1] for w in windows)
    mem_peak = gpu_used_mib()
    for t in decodes:
        t.cancel()
    await asyncio.gather(*decodes, return_exceptions=True)
    stats = engine.stats
    await engine.shutdown()

    def itl_between(lo: float, hi: float) -> list[float]:
        out = []
        for i in range(32):
            ts = arrivals[f"d{i}"]
            out += [(b - x) * 1e3 for x, b in zip(ts, ts[1:], strict=False) if lo <= x and b <= hi]
        return out

    before = itl_between(phase2 - a.warm, phase2)
    during = itl_between(phase2, phase2_end)
    per_window = []
    for lo, hi in windows:
        n = sum(1 for i in range(32) for x in arrivals[f"d{i}"] if lo <= x <= hi)
        per_window.append({"ttft_s": hi - lo, "decode_tokens_meanwhile": n})
    trace = {rid: [round(x - phase2, 5) for x in ts] for rid, ts in arrivals.items()}
    return {
        "gpu": _gpu_name(), "date": datetime.date.today().isoformat(), "model": a.model, "mps": a.mps,
        "mps_plan": engine.mps_plan.reason if engine.mps_plan else None,
        "command": "python bench/engine_itl.py " + " ".join(sys.argv[1:]),
        "engine_start_s": start_s, "workers": ready, "gpu_memory_after_start": mem_after_start,
        "gpu_memory_at_end_of_load": mem_peak, "final_stats": str(stats),
        "itl_ms_decode_only": {"p50": pct(before, .5), "p95": pct(before, .95), "n": len(before)},
        "itl_ms_during_prefill": {"p50": pct(during, .5), "p95": pct(during, .95), "max": max(during, default=0),
                                  "n": len(during)},
        "long_prompts": per_window,
        # each long prompt's own rate: 4096 tokens over its time to first token (queueing included)
        "prefill_tokens_per_s": statistics.median(4096 / (hi - lo) for lo, hi in windows),
        "trace": trace, "windows": [(lo - phase2, hi - phase2) for lo, hi in windows],
    }


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def plot(res: dict[str, object], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no timeline plot", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    trace: dict[str, list[float]] = res["trace"]  # type: ignore[assignment]
    for i in range(32):
        ts = trace[f"d{i}"]
        ax.plot(ts[1:], [(b - x) * 1e3 for x, b in zip(ts, ts[1:], strict=False)], ".", ms=2, alpha=.5)
    for lo, hi in res["windows"]:  # type: ignore[union-attr]
        ax.axvspan(lo, hi, color="orange", alpha=.15)
    ax.set_xlabel("time since the first 4096-token prompt (s); orange: a long prompt waiting for its first token")
    ax.set_ylabel("decode inter-token latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{res['model']} on {res['gpu']}, MPS {res['mps']}: 32 decodes x 2048 ctx + 4096-token prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:llama-3-8b")
    ap.add_argument("--mps", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--util", type=float, default=0.8, help="decode's KV pool share (prefill needs room too)")
    ap.add_argument("--num-long", type=int, default=6)
    ap.add_argument("--gap", type=float, default=1.0)
    ap.add_argument("--warm", type=float, default=2.0)
    ap.add_argument("--decode-tokens", type=int, default=2000)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    res = asyncio.run(run(a))
    os.makedirs(a.out, exist_ok=True)
    tag = f"engine_itl_mps-{a.mps}"
    with open(os.path.join(a.out, tag + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out, tag + ".png"))
    w = res["workers"]
    b, d = res["itl_ms_decode_only"], res["itl_ms_during_prefill"]
    gib = 2**30
    lines = [
        f"# RAPID engine under load: {res['model']} bf16 on {res['gpu']} ({res['date']}), MPS {a.mps}", "",
        f"Command: `{res['command']}`  ", f"MPS: {res['mps_plan']}", "",
        "| what | value |", "| --- | --- |",
        f"| decode ITL, decode only (p50 / p95) | {b['p50']:.1f} / {b['p95']:.1f} ms (n={b['n']}) |",  # type: ignore[index]
        f"| decode ITL while 4096-token prompts prefill (p50 / p95 / max) | {d['p50']:.1f} / {d['p95']:.1f} / "  # type: ignore[index]
        f"{d['max']:.1f} ms (n={d['n']}) |",  # type: ignore[index]
        f"| decode tokens delivered while each long prompt waited for its first token | "
        f"{[x['decode_tokens_meanwhile'] for x in res['long_prompts']]} |",  # type: ignore[union-attr]
        f"| long-prompt TTFT (s) | {[round(x['ttft_s'], 3) for x in res['long_prompts']]} |",  # type: ignore[union-attr]
        f"| prefill rate beside decode (median of 4096 tokens / TTFT) | {res['prefill_tokens_per_s']:.0f} tokens/s |",
        f"| weights (one copy, decode worker) | {int(w['decode']['weight_bytes']) / gib:.2f} GiB |",  # type: ignore[index]
        f"| KV pool (one copy, decode worker) | {int(w['decode']['kv_bytes']) / gib:.2f} GiB |",  # type: ignore[index]
        f"| decode worker's own device allocations | "
        f"{int(w['decode']['device_allocated_bytes']) / gib:.2f} GiB |",  # type: ignore[index]
        f"| prefill worker's own device allocations (uses both in place) | "
        f"{int(w['prefill']['device_allocated_bytes']) / gib:.3f} GiB |",  # type: ignore[index]
        f"| GPU memory used after start / at the end (nvidia-smi) | {res['gpu_memory_after_start']} / "
        f"{res['gpu_memory_at_end_of_load']} |",
        "", f"Timeline: `{tag}.png`",
    ]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, tag + ".md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
