"""The RAPID engine under load: does decode keep producing tokens while prefill runs? (issue 3)

    python bench/engine_itl.py [--model preset:llama-3-8b] [--mps auto] [--out bench/results] [--tag T]
                               [--code DIR]

Phase 0 (route probe): on the idle engine, `--probe` sequential requests of 32 random tokens
(max_tokens=4): their time to first token (TTFT) and inter-token latency (ITL) measure the
router -> workers route with no load.
Phase 1: `--num-decodes` (32) requests with `--decode-prompt` (2048)-token prompts start at once and
decode (long outputs, ignore_eos); their TTFTs are reported.
Phase 2: while they decode, `--long-prompt` (4096)-token prompts arrive one every `--gap` seconds.
It records every token's arrival time at the router, and reports the decode requests' ITL before and
during the prefill phase, how many decode tokens arrived while each long prompt was being prefilled,
prefill throughput, and the memory each worker process holds (the prefill worker's own device
allocations should be tiny: it uses the decode worker's weights and KV pool in place).
Writes <out>/engine_itl_mps-<mps>[_<tag>].json, .md and a timeline PNG; prints a table last.

`--code DIR` imports rapidserve from DIR (put first on sys.path and PYTHONPATH, which the spawned
workers inherit), so this script can drive an older checkout, e.g. one made with
`git archive <commit> rapidserve | tar -x -C _before` (bench/experiments/2026-11/route_ab.py compares two).
A CPU smoke run: `--model preset:tiny-llama --dtype float32 --num-decodes 4 --decode-prompt 64
--long-prompt 256 --num-long 2 --max-model-len 1024 --decode-tokens 200 --probe 3`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE_PROMPT = 32  # tokens of each phase-0 request
PROBE_TOKENS = 4  # max_tokens of each phase-0 request


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def gpu_used_mib() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def use_code(code_dir: str) -> str:
    """Import rapidserve from `code_dir` from now on: first on sys.path, and on PYTHONPATH for any
    child process. Returns the file of the rapidserve package actually imported (checked to be in
    code_dir, so an installed copy cannot stand in for it unnoticed)."""
    code_dir = os.path.realpath(code_dir)
    if not os.path.isfile(os.path.join(code_dir, "rapidserve", "__init__.py")):
        raise SystemExit(f"--code {code_dir}: no rapidserve/__init__.py there")
    sys.path.insert(0, code_dir)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = code_dir + (os.pathsep + old if old else "")
    import rapidserve

    got = os.path.realpath(rapidserve.__file__ or "")
    if not got.startswith(code_dir + os.sep):
        raise SystemExit(f"--code {code_dir}: rapidserve was imported from {got} instead")
    return got


def code_commit(code_dir: str) -> str:
    """The git commit of code_dir if it is a work tree's root (with '-dirty' when rapidserve/ has
    uncommitted changes), else the first line of code_dir/COMMIT if there is one, else 'n/a'.
    (A `git archive` export inside another repository must not report that repository's HEAD.)"""
    code_dir = os.path.realpath(code_dir)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", code_dir, *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        if os.path.realpath(git("rev-parse", "--show-toplevel")) == code_dir:
            head = git("rev-parse", "HEAD")
            return head + ("-dirty" if git("status", "--porcelain", "--", "rapidserve") else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open(os.path.join(code_dir, "COMMIT")) as f:
            return f.readline().strip() or "n/a"
    except OSError:
        return "n/a"


def _device(name: str) -> str:
    """'auto' stays 'auto' where there is a GPU (as before); without one it is 'cpu'."""
    if name != "auto":
        return name
    import torch

    return "auto" if torch.cuda.is_available() else "cpu"


def _ms(xs: list[float]) -> dict[str, float | int]:
    return {"p50": pct(xs, .5), "p95": pct(xs, .95), "p99": pct(xs, .99), "max": max(xs, default=0.0),
            "n": len(xs)}


async def run(a: argparse.Namespace) -> dict[str, object]:
    # imported here, after use_code() put --code first on sys.path
    from rapidserve.engine.client import AsyncEngine
    from rapidserve.launch_config import LaunchConfig
    from rapidserve.llm import build_engine_config
    from rapidserve.sampling_params import SamplingParams

    n_dec = a.num_decodes
    cfg, _ = build_engine_config(a.model, dtype=a.dtype, device=_device(a.device), max_model_len=a.max_model_len,
                                 max_num_batched_tokens=a.max_num_batched_tokens,
                                 gpu_memory_utilization=a.util, max_num_seqs=64,
                                 # only when asked: an older --code may not know the keyword
                                 **({"kv_cache_dtype": a.kv_cache_dtype} if a.kv_cache_dtype != "auto" else {}))
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mps=a.mps, startup_timeout_s=500))
    t0 = time.monotonic()
    engine: Any = await AsyncEngine.start(cfg)
    start_s = time.monotonic() - t0
    main_task = asyncio.current_task()
    if main_task is not None:  # a driver's SIGTERM (timeout) cancels the run; `finally` stops the engine
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    try:
        return await _phases(a, engine, cfg, SamplingParams, start_s, n_dec)
    finally:
        await engine.shutdown()


async def _phases(a: argparse.Namespace, engine: Any, cfg: Any, sampling_params: Any, start_s: float,
                n_dec: int) -> dict[str, object]:
    ready = {k: dict(v.info) for k, v in engine.workers.ready.items()}
    mem_after_start = gpu_used_mib()
    vocab = cfg.model_config.vocab_size
    rng = random.Random(0)  # phase 1 and 2 prompts, drawn in the same order as before phase 0 existed
    sent: dict[str, float] = {}
    arrivals: dict[str, list[float]] = {}

    async def one(rid: str, prompt: list[int], max_tokens: int, into: dict[str, list[float]]) -> None:
        times = into.setdefault(rid, [])
        params = sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        sent[rid] = time.monotonic()
        async for _ in engine.generate(rid, prompt, params):
            times.append(time.monotonic())

    # phase 0: the route probe, one short request at a time on the idle engine
    probe_rng = random.Random(1)
    probes: dict[str, list[float]] = {}
    for k in range(a.probe):
        await one(f"s{k}", [probe_rng.randrange(vocab) for _ in range(PROBE_PROMPT)], PROBE_TOKENS, probes)
    probe_ttft = [(ts[0] - sent[rid]) * 1e3 for rid, ts in probes.items() if ts]
    probe_itl = [(b - x) * 1e3 for ts in probes.values() for x, b in zip(ts, ts[1:], strict=False)]

    # phase 1: n_dec decodes start at once
    dprompts = [[rng.randrange(vocab) for _ in range(a.decode_prompt)] for _ in range(n_dec)]
    decodes = [asyncio.create_task(one(f"d{i}", dprompts[i], a.decode_tokens, arrivals)) for i in range(n_dec)]
    try:
        # wait until all produce tokens (their prompts were prefilled), then let them decode a while
        while sum(1 for i in range(n_dec) if len(arrivals.get(f"d{i}", [])) >= 2) < n_dec:
            failed = next((t for t in decodes if t.done() and t.exception() is not None), None)
            if failed is not None:
                raise RuntimeError("a phase-1 request failed") from failed.exception()
            await asyncio.sleep(0.05)
        phase1_ttft = [arrivals[f"d{i}"][0] - sent[f"d{i}"] for i in range(n_dec)]
        await asyncio.sleep(a.warm)
        phase2 = time.monotonic()
        prefills = []
        for j in range(a.num_long):
            prompt = [rng.randrange(vocab) for _ in range(a.long_prompt)]
            prefills.append(asyncio.create_task(one(f"p{j}", prompt, 1, arrivals)))
            await asyncio.sleep(a.gap)
        await asyncio.gather(*prefills)
        windows = [(sent[f"p{j}"], arrivals[f"p{j}"][0]) for j in range(a.num_long)]
        phase2_end = max(w[1] for w in windows)
        # decodes that ran out of tokens before phase 2 ended: raise --decode-tokens if this is > 0
        finished_early = sum(1 for i in range(n_dec) if len(arrivals[f"d{i}"]) >= a.decode_tokens)
        mem_peak = gpu_used_mib()
    finally:
        for t in decodes:
            t.cancel()
        await asyncio.gather(*decodes, return_exceptions=True)
    stats = engine.stats

    def itl_between(lo: float, hi: float) -> list[float]:
        out = []
        for i in range(n_dec):
            ts = arrivals[f"d{i}"]
            out += [(b - x) * 1e3 for x, b in zip(ts, ts[1:], strict=False) if lo <= x and b <= hi]
        return out

    before = itl_between(phase2 - a.warm, phase2)
    during = itl_between(phase2, phase2_end)
    per_window = []
    for lo, hi in windows:
        n = sum(1 for i in range(n_dec) for x in arrivals[f"d{i}"] if lo <= x <= hi)
        per_window.append({"ttft_s": hi - lo, "decode_tokens_meanwhile": n})
    trace = {rid: [round(x - phase2, 5) for x in ts] for rid, ts in arrivals.items()}
    plan = getattr(engine, "mps_plan", None)
    return {
        "gpu": _gpu_name(), "date": datetime.date.today().isoformat(), "model": a.model, "mps": a.mps,
        "mps_plan": getattr(plan, "reason", None),
        "command": "python bench/engine_itl.py " + " ".join(sys.argv[1:]),
        "code_dir": os.path.realpath(a.code), "code_commit": code_commit(a.code), "rapidserve_file": a.rapidserve_file,
        "sizes": {"num_decodes": n_dec, "decode_prompt": a.decode_prompt, "long_prompt": a.long_prompt,
                  "num_long": a.num_long, "decode_tokens": a.decode_tokens, "max_model_len": a.max_model_len,
                  "util": a.util, "dtype": a.dtype, "device": cfg.runner.device, "probe": a.probe},
        "engine_start_s": start_s, "workers": ready, "gpu_memory_after_start": mem_after_start,
        "gpu_memory_at_end_of_load": mem_peak, "final_stats": str(stats),
        "idle_short_requests": {
            "prompt_tokens": PROBE_PROMPT, "max_tokens": PROBE_TOKENS, "n": len(probe_ttft),
            "ttft_ms": {"p50": pct(probe_ttft, .5), "p90": pct(probe_ttft, .9), "max": max(probe_ttft, default=0.0)},
            "itl_ms": {"p50": pct(probe_itl, .5), "n": len(probe_itl)},
            "ttft_ms_each": probe_ttft,
            # each request's token arrival times, ms after it was sent
            "arrivals_ms": [[round((x - sent[rid]) * 1e3, 3) for x in ts] for rid, ts in probes.items()],
        },
        "phase1_ttft_s": {"p50": pct(phase1_ttft, .5), "p90": pct(phase1_ttft, .9), "max": max(phase1_ttft),
                          "n": len(phase1_ttft)},
        "itl_ms_decode_only": _ms(before),
        "itl_ms_during_prefill": _ms(during),
        "decodes_finished_before_phase2_end": finished_early,
        "long_prompts": per_window,
        # each long prompt's own rate: its tokens over its time to first token (queueing included)
        "prefill_tokens_per_s": statistics.median(a.long_prompt / (hi - lo) for lo, hi in windows),
        "trace": trace, "windows": [(lo - phase2, hi - phase2) for lo, hi in windows],
    }


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def plot(res: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no timeline plot", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sz = res["sizes"]
    fig, ax = plt.subplots(figsize=(11, 4))
    trace: dict[str, list[float]] = res["trace"]
    for i in range(sz["num_decodes"]):
        ts = trace[f"d{i}"]
        ax.plot(ts[1:], [(b - x) * 1e3 for x, b in zip(ts, ts[1:], strict=False)], ".", ms=2, alpha=.5)
    for lo, hi in res["windows"]:
        ax.axvspan(lo, hi, color="orange", alpha=.15)
    ax.set_xlabel(f"time since the first {sz['long_prompt']}-token prompt (s); "
                  "orange: a long prompt waiting for its first token")
    ax.set_ylabel("decode inter-token latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{res['model']} on {res['gpu']}, MPS {res['mps']}: {sz['num_decodes']} decodes x "
                 f"{sz['decode_prompt']} ctx + {sz['long_prompt']}-token prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gib(workers: dict[str, Any], who: str, key: str, digits: int = 2) -> str:
    v = workers.get(who, {}).get(key)
    return f"{int(v) / 2**30:.{digits}f} GiB" if v is not None else "n/a"


def table(res: dict[str, Any], tag: str) -> str:
    w, sz = res["workers"], res["sizes"]
    b, d = res["itl_ms_decode_only"], res["itl_ms_during_prefill"]
    idle, p1 = res["idle_short_requests"], res["phase1_ttft_s"]
    lines = [
        f"# RAPID engine under load: {res['model']} {sz['dtype']} on {res['gpu']} ({res['date']}), MPS {res['mps']}",
        "",
        f"Command: `{res['command']}`  ", f"Code: `{res['code_dir']}` at {res['code_commit']}  ",
        f"MPS: {res['mps_plan']}", "",
        "| what | value |", "| --- | --- |",
        f"| idle engine, {idle['prompt_tokens']}-token prompt, {idle['max_tokens']} tokens, one at a time: "
        f"TTFT (p50 / p90 / max) | {idle['ttft_ms']['p50']:.2f} / {idle['ttft_ms']['p90']:.2f} / "
        f"{idle['ttft_ms']['max']:.2f} ms (n={idle['n']}) |",
        f"| idle engine, same requests: ITL p50 | {idle['itl_ms']['p50']:.2f} ms (n={idle['itl_ms']['n']}) |",
        f"| phase 1: TTFT of {sz['num_decodes']} x {sz['decode_prompt']}-token prompts sent at once "
        f"(p50 / p90 / max) | {p1['p50']:.3f} / {p1['p90']:.3f} / {p1['max']:.3f} s |",
        f"| decode ITL, decode only (p50 / p95 / p99) | {b['p50']:.1f} / {b['p95']:.1f} / {b['p99']:.1f} ms "
        f"(n={b['n']}) |",
        f"| decode ITL while {sz['long_prompt']}-token prompts prefill (p50 / p95 / p99 / max) | {d['p50']:.1f} / "
        f"{d['p95']:.1f} / {d['p99']:.1f} / {d['max']:.1f} ms (n={d['n']}) |",
        f"| decode tokens delivered while each long prompt waited for its first token | "
        f"{[x['decode_tokens_meanwhile'] for x in res['long_prompts']]} |",
        f"| long-prompt TTFT (s) | {[round(x['ttft_s'], 3) for x in res['long_prompts']]} |",
        f"| prefill rate beside decode (median of {sz['long_prompt']} tokens / TTFT) | "
        f"{res['prefill_tokens_per_s']:.0f} tokens/s |",
        f"| weights (one copy, decode worker) | {_gib(w, 'decode', 'weight_bytes')} |",
        f"| KV pool (one copy, decode worker) | {_gib(w, 'decode', 'kv_bytes')} |",
        f"| decode worker's own device allocations | {_gib(w, 'decode', 'device_allocated_bytes')} |",
        f"| prefill worker's own device allocations (uses both in place) | "
        f"{_gib(w, 'prefill', 'device_allocated_bytes', 3)} |",
        f"| GPU memory used after start / at the end (nvidia-smi) | {res['gpu_memory_after_start']} / "
        f"{res['gpu_memory_at_end_of_load']} |",
        "", f"Timeline: `{tag}.png`",
    ]
    if res["decodes_finished_before_phase2_end"]:
        lines += ["", f"WARNING: {res['decodes_finished_before_phase2_end']} of {sz['num_decodes']} decodes ran out of "
                  f"tokens (--decode-tokens {sz['decode_tokens']}) before the last long prompt's first token: the "
                  "ITL during prefill saw fewer decodes; raise --decode-tokens"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:llama-3-8b")
    ap.add_argument("--code", default=REPO, help="directory holding the rapidserve package to import (default: "
                    "this repository); e.g. an older checkout")
    ap.add_argument("--mps", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--util", type=float, default=0.8, help="decode's KV pool share (prefill needs room too)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8 (as rapidserve serve's flag)")
    ap.add_argument("--device", default="auto", help="auto (cpu when no GPU is visible), cpu, cuda, cuda:N")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--probe", type=int, default=20, help="phase 0: sequential short requests on the idle engine")
    ap.add_argument("--num-decodes", type=int, default=32)
    ap.add_argument("--decode-prompt", type=int, default=2048, help="prompt tokens of each phase-1 request")
    ap.add_argument("--decode-tokens", type=int, default=2000, help="max_tokens of each phase-1 request")
    ap.add_argument("--long-prompt", type=int, default=4096, help="prompt tokens of each phase-2 request")
    ap.add_argument("--num-long", type=int, default=6)
    ap.add_argument("--gap", type=float, default=1.0)
    ap.add_argument("--warm", type=float, default=2.0)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--tag", default="", help="appended to the output file names")
    a = ap.parse_args()
    if a.num_long < 1 or a.num_decodes < 1:
        ap.error("--num-long and --num-decodes must be >= 1")
    a.rapidserve_file = use_code(a.code)
    res = asyncio.run(run(a))
    os.makedirs(a.out, exist_ok=True)
    tag = f"engine_itl_mps-{a.mps}" + (f"_{a.tag}" if a.tag else "")
    with open(os.path.join(a.out, tag + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out, tag + ".png"))
    text = table(res, tag)
    with open(os.path.join(a.out, tag + ".md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
