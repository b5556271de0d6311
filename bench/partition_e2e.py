"""The adaptive partition end to end: decode ITL and prefill throughput under load, with a timeline.

    python bench/partition_e2e.py --model preset:llama-3-8b --partition adaptive [--profile P] [--batches 16,32,64]

1. Solo prefill: `--burst` prompts of 4096 tokens at once, nothing decoding (max_tokens=1): tokens/s.
2. For each decode batch B: B requests with 2048-token prompts decode (ignore_eos); after `--warm` s of
   decode alone, a burst of `--burst` 4096-token prompts arrives at once (max_tokens=1, so they
   leave after their first token and the decode batch stays B). Reported: decode ITL alone and during
   the burst (p50/p95/max), the burst's prefill tokens/s and its ratio to solo, and the
   configurations the manager used. The engine's Stats (every 20 ms) give the timeline of switches.
Writes <out>/partition_e2e_<tag>.{json,md,png}; prints the table last.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rapidserve.engine.client import AsyncEngine  # noqa: E402
from rapidserve.launch_config import LaunchConfig  # noqa: E402
from rapidserve.llm import build_engine_config  # noqa: E402
from rapidserve.partition_config import PartitionConfig  # noqa: E402
from rapidserve.sampling_params import SamplingParams  # noqa: E402

PROMPT = 4096
CONTEXT = 2048


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def run(a: argparse.Namespace) -> dict[str, object]:
    cfg, _ = build_engine_config(a.model, dtype="bfloat16", max_model_len=8192, max_num_batched_tokens=a.budget,
                                 gpu_memory_utilization=a.util, max_num_seqs=160)
    part = PartitionConfig.parse(a.partition, profile=a.profile, slo_itl_ms=a.slo_itl_ms)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mps=a.mps, startup_timeout_s=600, stats_interval_s=0.02),
                              partition=part)
    t0 = time.monotonic()
    engine = await AsyncEngine.start(cfg)
    start_s = time.monotonic() - t0
    ready = {k: dict(v.info) for k, v in engine.workers.ready.items()}  # type: ignore[union-attr]
    vocab = cfg.model_config.vocab_size
    rng = random.Random(0)
    arrivals: dict[str, list[float]] = {}
    samples: list[tuple[float, str, int, int]] = []
    origin = time.monotonic()

    async def sample_stats() -> None:
        while True:
            s = engine.stats
            if s is not None:
                samples.append((time.monotonic() - origin, s.partition, s.num_running, s.partition_switches))
            await asyncio.sleep(0.02)

    async def one(rid: str, n_prompt: int, max_tokens: int) -> None:
        prompt = [rng.randrange(vocab) for _ in range(n_prompt)]
        times = arrivals.setdefault(rid, [])
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for _ in engine.generate(rid, prompt, params):
            times.append(time.monotonic() - origin)

    async def burst(tag: str) -> tuple[float, float]:
        sent = time.monotonic() - origin
        await asyncio.gather(*(one(f"{tag}-{j}", PROMPT, 1) for j in range(a.burst)))
        return sent, max(arrivals[f"{tag}-{j}"][0] for j in range(a.burst))

    sampler = asyncio.create_task(sample_stats())
    await burst("warmup")  # first prefill shapes compile their kernels: not timed
    lo, hi = await burst("solo")
    solo_tps = a.burst * PROMPT / (hi - lo)
    rows, windows = [], []
    for b in a.batches:
        ids = [f"b{b}-d{i}" for i in range(b)]
        decodes = [asyncio.create_task(one(rid, CONTEXT, 4000)) for rid in ids]
        while sum(1 for rid in ids if len(arrivals.get(rid, [])) >= 2) < b:
            await asyncio.sleep(0.02)
        alone_lo = time.monotonic() - origin
        await asyncio.sleep(a.warm)
        lo, hi = await burst(f"b{b}-burst")
        await asyncio.sleep(a.after)
        for t in decodes:
            t.cancel()
        await asyncio.gather(*decodes, return_exceptions=True)
        windows.append((b, lo, hi))

        def itl(x0: float, x1: float, ids: list[str] = ids) -> list[float]:
            return [(q - p) * 1e3 for rid in ids for p, q in zip(arrivals[rid], arrivals[rid][1:], strict=False)
                    if x0 <= p and q <= x1]

        alone, during = itl(alone_lo, lo), itl(lo, hi)
        used = sorted({c for t, c, _, _ in samples if lo <= t <= hi})
        tps = a.burst * PROMPT / (hi - lo)
        rows.append({"batch": b, "itl_alone_p50": pct(alone, .5), "itl_alone_p95": pct(alone, .95),
                     "itl_burst_p50": pct(during, .5), "itl_burst_p95": pct(during, .95),
                     "itl_burst_max": max(during, default=float("nan")), "n_burst": len(during),
                     "prefill_tps": tps, "prefill_vs_solo": tps / solo_tps, "configs_during_burst": used})
        await asyncio.sleep(0.3)
    sampler.cancel()
    switches = engine.stats.partition_switches if engine.stats else 0
    await engine.shutdown()
    return {"gpu": _gpu_name(), "date": datetime.date.today().isoformat(), "model": a.model,
            "partition": a.partition, "mps": engine.mps_plan.reason if engine.mps_plan else None,
            "command": "python bench/partition_e2e.py " + " ".join(sys.argv[1:]), "engine_start_s": start_s,
            "workers": ready, "solo_prefill_tps": solo_tps, "rows": rows, "switches": switches,
            "timeline": samples, "windows": windows,
            "trace": {k: v for k, v in arrivals.items() if "-d" in k}}


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def plot(res: dict[str, object], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for ts in res["trace"].values():  # type: ignore[union-attr]
        ax.plot(ts[1:], [(q - p) * 1e3 for p, q in zip(ts, ts[1:], strict=False)], ".", ms=1.5, alpha=.4)
    for b, lo, hi in res["windows"]:  # type: ignore[union-attr]
        ax.axvspan(lo, hi, color="orange", alpha=.2)
        ax.text(lo, 1.0, f"B={b}", fontsize=8)
    ax.axhline(50, color="red", ls="--", lw=1, label="50 ms SLO")
    ax.set_yscale("log")
    ax.set_ylabel("decode ITL (ms)")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"{res['model']} on {res['gpu']}, --partition {res['partition']}: orange = 4096-token burst "
                 "prefilling", fontsize=10)
    tl = res["timeline"]
    names = sorted({c for _, c, _, _ in tl}, key=lambda n: (n != "overallocated", int(n[5:]) if n[5:].isdigit() else 0))  # type: ignore[union-attr]
    ax2.step([t for t, *_ in tl], [names.index(c) for _, c, _, _ in tl], where="post")  # type: ignore[union-attr]
    ax2.set_yticks(range(len(names)), names, fontsize=7)
    ax2.set_xlabel("time (s)")
    ax2.set_ylabel("configuration")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:llama-3-8b")
    ap.add_argument("--partition", default="adaptive")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--slo-itl-ms", type=float, default=50.0)
    ap.add_argument("--mps", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--util", type=float, default=0.8)
    ap.add_argument("--budget", type=int, default=8192, help="prefill tokens per forward")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64])
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--warm", type=float, default=1.5)
    ap.add_argument("--after", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    res = asyncio.run(run(a))
    os.makedirs(a.out, exist_ok=True)
    tag = f"partition_e2e_{a.model.replace('preset:', '')}_{a.partition.replace(':', '-')}"
    with open(os.path.join(a.out, tag + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out, tag + ".png"))
    lines = [f"# Partition end to end: {res['model']} on {res['gpu']} ({res['date']}), --partition {a.partition}", "",
             f"Command: `{res['command']}`  ", f"Partition plan: {res['workers']['decode'].get('partition')}  ",  # type: ignore[index]
             f"MPS: {res['mps']}  ", f"Solo prefill (burst of {a.burst} x {PROMPT} tokens, no decode): "
             f"{res['solo_prefill_tps']:,.0f} tokens/s; switches over the run: {res['switches']}", "",
             "| decode batch | ITL alone p50/p95 (ms) | ITL during burst p50/p95/max (ms) | prefill tok/s during burst "
             "| vs solo | configurations during burst |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:  # type: ignore[union-attr]
        lines.append(f"| {r['batch']} | {r['itl_alone_p50']:.1f} / {r['itl_alone_p95']:.1f} | "
                     f"{r['itl_burst_p50']:.1f} / {r['itl_burst_p95']:.1f} / {r['itl_burst_max']:.1f} | "
                     f"{r['prefill_tps']:,.0f} | "
                     f"{r['prefill_vs_solo']:.2f} | {', '.join(r['configs_during_burst'])} |")
    lines += ["", f"Timeline: `{tag}.png`"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, tag + ".md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
