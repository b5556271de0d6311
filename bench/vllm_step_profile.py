"""vLLM 0.26's prefill step by kernel category, beside ours (bench/fused_step_profile.py): where our 15% goes.

    python bench/vllm_step_profile.py [--preset llama-3.1-70b] [--fp8] [--model-dir DIR] [--prompt-lens 4096,8192]
        [--steps 5] [--max-num-batched-tokens 8192] [--compare OURS.json] [--out DIR]        # GPU, vLLM importable
    python bench/vllm_step_profile.py --vllm-report vllm_step_profile.json --compare OURS.json    # the tables again

Llama-3.1-70B fp8 on one H200: our fused steps prefill ~7.4K prompt tokens/s, vLLM ~8.8K. This builds vLLM's offline
engine in this process (`vllm.LLM` with VLLM_ENABLE_V1_MULTIPROCESSING=0: its engine core and model run here, under
our profiler) on a random-weights folder of the preset's shape as bench/vs_vllm.sh serves it (bench/make_peer_model.py,
`--fp8` its FP8_DYNAMIC checkpoint folder, VLLM_FP8=checkpoint's; default /root/peermodel-PRESET[-fp8], vs_vllm.sh's
folder, written when missing): load_format dummy, bf16, gpu_memory_utilization 0.8, prefix caching off (each repeat
computes its prompt again), vLLM's default compilation (torch.compile and CUDA graphs, enforce_eager off; a prompt
above the largest graph, 512 tokens, runs the compiled pieces without one). --max-num-batched-tokens defaults to
8192, `vllm serve`'s default on an H200 (the LLM class alone would take 16384): a prompt of up to 8192 tokens is one
engine step. vLLM refuses a prompt as long as max_model_len (input_processor._validate_prompt_len: no room for the
sampled token), so --max-model-len (8192) is raised to the longest prompt + 1.

For each prompt length: one request of random token ids (TokensPrompt; SamplingParams(max_tokens=1, ignore_eos=True):
the prefill and its one sampled token), timed with CUDA events around `LLM.generate` after 3 warm-up requests
(gpu_timing.time_ms; `ms`: the request, host included, median of --steps), then --steps more under torch.profiler
(step_profile.timed_and_profiled: device time by step_profile.CATEGORIES, the categorizer of our profiles, and the
longest kernels, 10 in the .md with their category, 25 in the JSON, whose names show vLLM's GEMM choice: CUTLASS
`cutlass::device_kernel<...>` or cuBLAS `nvjet_...`; torch.compile's kernels are categorized by the ops in their
names, a rule read from vLLM's source and not yet seen on a run: check them there).
Per request, from the profile: `device ms`, its first kernel's start to its last one's end (what our `ms`, timed
back to back, is for our forward), `gaps`, the time in it no kernel ran (in profiled requests: where the host fell
behind the device under the profiler they would grow; a prefill of thousands of tokens keeps the device ahead), and
`host`, ms - device ms (scheduling, inputs, outputs outside vLLM's kernels).

`--compare REPORT.json` (a fused_step_profile.json of ours, e.g. bench/results/h200_1201b/fused_step_profile_70b_fp8
.json): for each prompt length measured there as a chunk alone (rows 0, no prefix), ours and vLLM's device ms, ms per
category and gaps, the difference (ours - vLLM) and its share of the steps' difference. A report of ours written
before a category existed holds its kernels in 'other': those of its longest kernels the categorizer now puts in a
category the report lacks move there (`rebinned`: `_quantize_tokens_kernel` -> act quant). That report's attention
is Triton (its machine had no FA3) where vLLM's is FA3: for FA3 on both sides profile ours again with `--backend fa3`
(bench/fused_step_profile.py's docstring says how, through the same stash) and compare with that. Writes
<out>/vllm_step_profile.json (args, versions, rows, the comparison) and .md (bench/table_out.py); prints the tables.

On the GPU machine, through the stash (bench/vs_vllm.sh's header: steps 0 and 1, `--split` here and then the N
`bash bench/vs_vllm.sh --stash` calls, carry [".peer/cK", ".peer/peer_vllm"], back to back), then in one call:
    run(command="PRESET=llama-3.1-70b VLLM_FP8=checkpoint SERVE_ARGS='--quantization fp8' OUT=$OUT/prep bash
        bench/vs_vllm.sh --prepare && PYTHONPATH=/root/peersite python3 bench/vllm_step_profile.py --preset
        llama-3.1-70b --fp8 --compare bench/results/h200_1201b/fused_step_profile_70b_fp8.json --out $OUT",
        timeout_s=600)
(one line; `--prepare` installs vLLM from the stash into /root/peersite, or finds it there, and writes the fp8 folder;
vLLM's start on the 70B shape with its compile is ~3-4 min, the requests ~1 min). Only torch and rapidserve.loader of
ours are imported beside vLLM (no .whl needed). The CPU tests cover the rows, spans, categories and the comparison.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_profile import CATEGORIES, category  # noqa: E402
from table_out import md_table, write_table_files  # noqa: E402

MARK = "vllm_step_profile.request"  # the record_function around each profiled request: its window on the timeline
MODEL_ROOT = "/root/peermodel"  # vs_vllm.sh's folders: MODEL_ROOT-PRESET[-fp8]
NAME_CHARS = 240  # of a kernel's name in the longest kernels (CUTLASS's say their tiles and schedule late)
TOP_KEPT, TOP_SHOWN = 25, 10  # longest kernels in the JSON (to check the categories of a first run), in the .md
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}  # serve_vllm.sh's, and the engine in this process
CATS = [c for c, _ in CATEGORIES] + ["other"]
SAMPLING = {"max_tokens": 1, "ignore_eos": True}  # SamplingParams: the prefill and its one token, whatever it is
GENERATE = {"use_tqdm": False}  # LLM.generate's


def llm_kwargs(folder: str, a: argparse.Namespace, max_len: int) -> dict[str, Any]:
    """vllm.LLM's arguments (its own and EngineArgs' fields, checked against vLLM 0.26's source by the tests):
    vs_vllm.sh's server settings, prefix caching off; compilation and CUDA graphs vLLM's defaults."""
    return {"model": folder, "load_format": "dummy", "dtype": "bfloat16", "max_model_len": max_len, "seed": 0,
            "gpu_memory_utilization": a.gpu_memory_utilization, "max_num_batched_tokens": a.max_num_batched_tokens,
            "enable_prefix_caching": False}


def model_folder(preset: str, fp8: bool, model_dir: str | None) -> str:
    """The model folder (`model_dir`, else vs_vllm.sh's MODEL_ROOT-PRESET[-fp8]), written by make_peer_model when it
    has no config.json; SystemExit where an existing folder's quantization is not the one asked for."""
    from make_peer_model import folder_quantization
    from make_peer_model import main as make_folder

    folder = model_dir or f"{MODEL_ROOT}-{preset}{'-fp8' if fp8 else ''}"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        make_folder(preset, folder, fp8=fp8)
    declared = folder_quantization(folder)
    if (declared == "fp8-dynamic") != fp8:
        raise SystemExit(f"vllm_step_profile: {folder} declares {declared or 'no quantization'}; "
                         + ("--fp8 needs an FP8_DYNAMIC folder (make_peer_model.py --fp8)" if fp8 else "give --fp8"))
    return folder


def request_windows(prof: Any) -> list[tuple[float, float]]:
    """(start, end) in us of each MARK range on the host in `prof`: one profiled request each."""
    import torch

    return [(ev.time_range.start, ev.time_range.end) for ev in prof.events()
            if ev.name == MARK and ev.device_type == torch.autograd.DeviceType.CPU]


def step_spans(windows: Sequence[tuple[float, float]], kernels: Sequence[tuple[float, float]],
               ) -> list[tuple[float, float]]:
    """Per window (a request, us), of the kernels that start in it (us): (first start to last end, time a kernel
    ran, overlaps counted once), in ms; windows without a kernel are left out."""
    out = []
    for w0, w1 in windows:
        mine = sorted((s, e) for s, e in kernels if w0 <= s <= w1)
        if not mine:
            continue
        busy, reach = 0.0, -math.inf
        for s, e in mine:
            if e > reach:
                busy += e - max(s, reach)
                reach = e
        out.append(((reach - mine[0][0]) / 1e3, busy / 1e3))
    return out


def rate(tokens: int, ms: float) -> float:
    """Tokens a second in `ms` (0 where nothing was timed)."""
    return 1e3 * tokens / ms if ms > 0 else 0.0


def vllm_row(tokens: int, batched: int, wall: Sequence[float], cats: dict[str, float], top: dict[str, float],
             spans: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """A prompt length's row: the request's ms (median, min, max of `wall`) and tokens/s, from the profiled
    requests' `spans` the device ms (median span), gaps (median span - busy) and host (ms - device ms), and the
    categories and longest kernels (ms a request). Without spans the device ms is the kernels' sum."""
    ms = statistics.median(wall)
    busy = sum(cats.values())
    device = statistics.median(s for s, _ in spans) if spans else busy
    gaps = statistics.median(s - b for s, b in spans) if spans else 0.0
    return {"prompt_tokens": tokens, "engine_steps": -(-tokens // batched), "ms": ms, "min_ms": min(wall),
            "max_ms": max(wall), "tokens_per_s": rate(tokens, ms), "device_ms": device,
            "device_tokens_per_s": rate(tokens, device), "gaps_ms": max(0.0, gaps), "host_ms": max(0.0, ms - device),
            "categories_ms": cats, "top_kernels_ms": top}


def table(rows: Sequence[dict[str, Any]], cats: Sequence[str]) -> str:
    """One row a prompt length: the request (ms, tokens/s), the device's part, ms per category, gaps, host."""
    return md_table(["prompt tokens", "steps", "ms (min-max)", "tokens/s", "device ms", "device tok/s", *cats, "gaps",
                     "host"],
                    ([str(r["prompt_tokens"]), str(r["engine_steps"]),
                      f"{r['ms']:.2f} ({r['min_ms']:.2f}-{r['max_ms']:.2f})", f"{r['tokens_per_s']:,.0f}",
                      f"{r['device_ms']:.2f}", f"{r['device_tokens_per_s']:,.0f}",
                      *(f"{r['categories_ms'].get(k, 0.0):.2f}" for k in cats), f"{r['gaps_ms']:.2f}",
                      f"{r['host_ms']:.2f}"] for r in rows))


def rebinned(cats: dict[str, float], top: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    """`cats` with each of the longest kernels `top` that the categorizer now puts in a category `cats` lacks moved
    there out of 'other' (where a report written before that category put it), and what moved."""
    out, moved = dict(cats), []
    for name, ms in top.items():
        c = category(name)
        if c != "other" and c not in cats and out.get("other", 0.0) >= ms - 1e-9:
            out["other"] = max(0.0, out["other"] - ms)
            out[c] = out.get(c, 0.0) + ms
            moved.append(f"`{name}` -> {c}")
    return out, moved


def compare(ours: dict[str, Any], rows: Sequence[dict[str, Any]], cats: Sequence[str]) -> list[dict[str, Any]]:
    """Per prompt length both measured (ours: a chunk alone, no decode rows nor prefix): ours and vLLM's device ms
    ("step"), ms per category (those either has) and gaps, each with ours - vLLM and its share of the steps'."""
    alone = {int(s["chunk"]): s for s in ours.get("shapes", []) if s.get("rows") == 0 and not s.get("prefix")}
    out = []
    for r in rows:
        o = alone.get(int(r["prompt_tokens"]))
        if o is None:
            continue
        ocats, moved = rebinned(o["categories_ms"], o.get("top_kernels_ms", {}))
        vcats = r["categories_ms"]
        pairs = [("step", o["ms"], r["device_ms"])]
        pairs += [(c, ocats.get(c, 0.0), vcats.get(c, 0.0)) for c in cats if ocats.get(c) or vcats.get(c)]
        pairs.append(("gaps", o["gaps_ms"], r["gaps_ms"]))
        step = o["ms"] - r["device_ms"]
        items = [{"item": k, "ours_ms": a, "vllm_ms": b, "diff_ms": a - b, "share": (a - b) / step if step else None}
                 for k, a, b in pairs]
        t = int(r["prompt_tokens"])
        out.append({"prompt_tokens": t, "ours_tokens_per_s": rate(t, o["ms"]),
                    "vllm_tokens_per_s": rate(t, r["device_ms"]), "vllm_request_ms": r["ms"], "moved": moved,
                    "items": items})
    return out


def ours_timing(ours: dict[str, Any]) -> str:
    """How fused_step_profile.py timed our steps (its --idle-ms), for the comparison's heading."""
    idle = float(ours.get("idle_ms") or 0)
    return f"ours each after {idle:g} ms idle, as vLLM's requests" if idle > 0 else "ours timed back to back"


def compare_table(cmp: Sequence[dict[str, Any]], ours_name: str, ours_lens: Sequence[int]) -> str:
    """The side-by-side tables of `compare`, one a prompt length."""
    if not cmp:
        return (f"No prompt length of this run is a chunk alone in {ours_name} (its: "
                + ", ".join(map(str, ours_lens)) + ").")
    out = []
    for c in cmp:
        out += [f"### {c['prompt_tokens']} prompt tokens: ours {c['ours_tokens_per_s']:,.0f} tokens/s, vLLM "
                f"{c['vllm_tokens_per_s']:,.0f} (device ms; the request {c['vllm_request_ms']:.2f} ms), vLLM/ours "
                f"{c['vllm_tokens_per_s'] / max(c['ours_tokens_per_s'], 1e-9):.2f}x", "",
                md_table(["", "ours ms", "vLLM ms", "ours - vLLM", "of the difference"],
                         ([i["item"], f"{i['ours_ms']:.2f}", f"{i['vllm_ms']:.2f}", f"{i['diff_ms']:+.2f}",
                           "-" if i["share"] is None else f"{i['share']:.0%}"] for i in c["items"]))]
        if c["moved"]:
            out += ["", f"Ours, moved out of 'other' ({ours_name} predates their category): " + "; ".join(c["moved"])]
        out.append("")
    return "\n".join(out).rstrip()


def measure(a: argparse.Namespace, lens: Sequence[int]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """vLLM's engine in this process; per prompt length its timed and profiled requests (`vllm_row`)."""
    for k, v in VLLM_ENV.items():  # the in-process engine always; the rest where the caller set nothing
        if k == "VLLM_ENABLE_V1_MULTIPROCESSING" or k not in os.environ:
            os.environ[k] = v
    import numpy as np
    import torch
    import vllm
    from gpu_timing import time_ms
    from step_profile import device_events, timed_and_profiled
    from torch.profiler import record_function
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    folder = model_folder(a.preset, a.fp8, a.model_dir)
    max_len = max(a.max_model_len, max(lens) + 1)
    llm = LLM(**llm_kwargs(folder, a, max_len))
    params = SamplingParams(**SAMPLING)
    rng = np.random.default_rng(0)
    vocab = llm.model_config.get_vocab_size()
    rows = []
    for t in lens:
        prompt = TokensPrompt(prompt_token_ids=rng.integers(0, vocab, t).tolist())
        spans: list[tuple[float, float]] = []

        def request(prompt: Any = prompt) -> Any:
            with record_function(MARK):
                return llm.generate([prompt], params, **GENERATE)

        def windows(prof: Any, spans: list[tuple[float, float]] = spans) -> None:
            kernels = [(ev.time_range.start, ev.time_range.end) for ev in device_events(prof)]
            spans.extend(step_spans(request_windows(prof), kernels))

        wall, cats, top = timed_and_profiled(request, a.steps, time_ms, inspect=windows, top=TOP_KEPT,
                                             name_chars=NAME_CHARS)
        rows.append(vllm_row(t, a.max_num_batched_tokens, wall, cats, top, spans))
        print(f"{t} tokens: {rows[-1]['ms']:.2f} ms ({rows[-1]['device_ms']:.2f} on the device, "
              f"{len(spans)} of {a.steps} profiled requests seen)", flush=True)
    meta = {"vllm": vllm.__version__, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"), "preset": a.preset,
            "weights": "fp8" if a.fp8 else "bf16", "model_dir": folder, "max_model_len": max_len,
            "max_num_batched_tokens": a.max_num_batched_tokens, "gpu_memory_utilization": a.gpu_memory_utilization}
    return meta, rows


def report(meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """The markdown before the comparison: what ran, the longest kernels, the table."""
    text = (f"# vLLM {meta.get('vllm', '?')}'s prefill by kernel category: {meta.get('preset', '?')} "
            f"{meta.get('weights', '?')} on {meta.get('gpu', '?')} ({meta.get('date', '?')})\n\n"
            f"max_num_batched_tokens {meta.get('max_num_batched_tokens')}, max_model_len {meta.get('max_model_len')}. "
            "One request a prompt length (max_tokens 1); ms: the request (median); device ms: first kernel to last; "
            "categories, gaps (no kernel ran) and host (ms - device ms) in ms a request.\n")
    for r in rows:
        text += f"\nLongest kernels, {r['prompt_tokens']} tokens (ms a request):\n\n"
        text += "\n".join(f"- {v:.3f} `{k}` ({category(k)})"
                          for k, v in list(r["top_kernels_ms"].items())[:TOP_SHOWN]) + "\n"
    return text + "\n" + table(rows, CATS) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.1-70b", help="the model shape (rapidserve's presets)")
    ap.add_argument("--fp8", action="store_true", help="the FP8_DYNAMIC checkpoint folder (VLLM_FP8=checkpoint's)")
    ap.add_argument("--model-dir", default=None, help=f"the HF folder (default {MODEL_ROOT}-PRESET[-fp8])")
    ap.add_argument("--prompt-lens", default="4096,8192", help="comma-separated prompt lengths")
    ap.add_argument("--steps", type=int, default=5, help="timed requests a length (median), and profiled")
    ap.add_argument("--max-model-len", type=int, default=8192, help="raised to the longest prompt + 1")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--compare", type=Path, default=None, help="a fused_step_profile.json of ours: side by side")
    ap.add_argument("--vllm-report", type=Path, default=None,
                    help="an earlier run's vllm_step_profile.json: its tables (no GPU, vLLM not run)")
    ap.add_argument("--out", type=Path, default=None, help="write vllm_step_profile.json and .md here")
    a = ap.parse_args(argv)
    try:
        lens = [int(x) for x in a.prompt_lens.split(",")]
    except ValueError:
        lens = []
    if not lens or min(lens) < 1 or a.steps < 1 or a.max_num_batched_tokens < 1:
        ap.error("--prompt-lens: positive integers; --steps, --max-num-batched-tokens >= 1")
    if a.vllm_report is not None:
        earlier = json.loads(a.vllm_report.read_text())
        rows = earlier["rows"]
        meta = {k: v for k, v in earlier.items() if k not in ("args", "rows", "compare", "compared_with")}
    else:
        import torch

        if not torch.cuda.is_available():
            print("vllm_step_profile needs a GPU (or --vllm-report)", file=sys.stderr)
            return 2
        meta, rows = measure(a, lens)
    text = report(meta, rows)
    if a.compare is not None:
        ours = json.loads(a.compare.read_text())
        meta["compared_with"] = str(a.compare)
        meta["compare"] = compare(ours, rows, CATS)
        ours_lens = [int(s["chunk"]) for s in ours.get("shapes", []) if s.get("rows") == 0 and not s.get("prefix")]
        text += (f"\nOurs ({a.compare}: {ours.get('model', '?')} {ours.get('weights', '?')}, {ours.get('backend', '?')}"
                 f" attention, {ours.get('date', '?')}) beside vLLM, ms a step; step: device ms ({ours_timing(ours)}); "
                 "the difference's share: of the steps' difference.\n\n"
                 + compare_table(meta["compare"], a.compare.name, ours_lens) + "\n")
    write_table_files(a.out, "vllm_step_profile", a, list(rows), text, meta)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
