"""The goodput frontier's system groups, and the device-time plan of a session that measures them
(bench/vs_vllm.sh and bench/frontier_parallel.sh read both; pure, tested on CPU). The groups and the model
arithmetic behind them (GROUPS, group_systems, disagg_note, peak_guess) are bench/frontier_groups.py's.

A group is what one device call runs (one after another on the same GPUs, inside the call's 10 minutes; `a+b`: both
groups' systems in one call, for shapes whose searches are short):

| group | systems |
|---|---|
| ours | duet, always-fused, always-split (issue 37 on one GPU) |
| duet | duet alone (beside vllm-default, for workloads whose probes are long: multi-turn, traces) |
| duet-none | duet (its default SLO, 50 ms) and duet@none (no SLO: the whole budget every step; searched unbounded) |
| ours-slo | duet@25, @50, @100, @200, @none: duet with `--slo-itl-ms B` (or none), each searched at B alone |
| baselines | always-fused, always-split (beside ours-slo: ours' duet would repeat duet@50's server and search) |
| graphs-ab | duet, duet-g512 (its fused steps' graphs cut to 512 tokens: the larger ones launched from Python) |
| fill-ab | duet, duet-g256 (its fused steps' buckets every 256 tokens from 1024 to 2048, the default before 11-30) |
| g4096-ab | duet@100, duet100-g4096 (the same at SLO 100 with buckets on to 4096: ~4K-token fused steps replayed) |
| lookup-ab | duet (`auto`: fused steps read between buckets), duet-roundup (before 11-30), duet-interp (splits too) |
| margin-ab | duet (its SLO margin adapted, the default), duet-m90 (fixed at 0.9 x SLO, as before 2026-11-30) |
| correction-ab | duet (its correction by step shape, the default), duet-perkind (one ratio a kind, as before 11-30) |
| vllm-a / vllm-b | vLLM default and --max-num-batched-tokens 1024 / 2048 and --performance-mode interactivity |
| ours-tp | rapidserve (the engine's default policy) and disagg-npmd (prefill on TP/2 GPUs, decode on TP/2) |
| hybrid-chunks | hybrid at chunk 512, 1024, 2048 (RAPID-Serve's own baseline: `--mode hybrid`, its chunk) |
| vllm-default / vllm-1024 / vllm-2048 | vLLM at one setting each (a big shape's vLLM start takes ~3 min: one a call) |

With TP=N every system of a group holds the same N GPUs (ours `--tensor-parallel-size N`, vLLM the same flag);
a machine of G GPUs runs G/N groups side by side (bench/frontier_parallel.sh). disagg-npmd is dropped, with the
reason, where TP is odd or 1, where the engine's own check refuses it (`ParallelConfig.disagg_problem`), or where
the weights do not fit half the GPUs (each side holds a whole copy).

    python bench/frontier_plan.py plan --gpus 4 --tp 4 --preset llama-3.1-70b --groups ours-tp,hybrid-chunks
    python bench/frontier_plan.py group ours-tp --tp 2 --preset llama-3.1-70b   # 3 lines: ours, vLLM, note

The plan's times are estimates from earlier runs (bench/results: vLLM's start 180-190 s for the 70B shape at
TP 2 with its dummy loader, ours 20-60 s, duet at TP 1 12-25 s with a committed profile (without one, its first
start measures and caches one, up to 55 s more); a machine's start "a minute or more"; the stash calls ~8 s each
on a warm machine, as many as `bash bench/vs_vllm.sh --split` cut parts: `stash_parts` counts its .peer/c0 ..
.peer/cN-1, the folders the `--stash` calls carry one each), and a prefill-bound guess of each system's closed-loop peak
(qwen3-8b's 8.5 req/s on one H200 at 4096:64, scaled by active parameters, prompt length and TP at 85% per
doubling): a plan, not a measurement. A search of every bound wants --max-probes probes; a search of one bound
(duet@B) ONE_BOUND_PROBES at most (h200x2_1129's searches settled a bound in 2 probes at the peak, 6-8 inside it).

Probes above the closed-loop peak (SEARCH_ARGS with a ceiling above it, `--search-shared-ceiling` or
`--search-max-rate R`, and `--search-above-peak-factor F`; rapidserve/benchmark/sustain.py): `--above-peak-factor F`
plans ABOVE_PEAK_PROBES of each search's probes above the peak, each of discard + F x (num_prompts - discard)
arrivals at about ABOVE_PEAK_RATE x the peak, instead of num_prompts arrivals near half the peak. For qwen3-8b at
4096:64 (peak ~8.5 req/s), 48 arrivals a probe and F 4: a long probe ~16 s against ~11 s, ~15 s more a search; the
probe count is still capped by --max-probes, so what grows is each probe's length, not their number. F 1 (the
default) plans as before: probes above the peak, if the ceiling allows any, are as long as the others (and then the
plan's ~11 s each, a little long at rates above the peak).

Every probe's warm-up (the ramp rule, rapidserve/benchmark/sustain.py): a probe sends the larger of SEARCH_DISCARD
arrivals and those within RAMP_MARGIN request lifetimes before the ones it counts, and drains for about one lifetime
after its last arrival, so a probe at rate r lasts about (warm-up + counted) / r + the lifetime (`probe_seconds`, at
most --max-probe-arrivals arrivals). The lifetime is `--lifetime-s`, else a guess from the workload's output length
(`lifetime_guess`: LIFE_BASE_S + LIFE_TOKEN_S per output token, from the H200 of 2026-11-30: 1024:256 lived 5-8 s,
2048:28 about 1 s); `--output` defaults to the 64 of 4096:64 (bench/frontier_parallel.sh passes its workload's). A
decode-heavy shape's probes are long: 1024:256 at ~30 req/s warms up for ~300 arrivals. Called without a lifetime
(`plan`, `group_call` from Python), the plan is the one before the ramp rule: the discard, then DRAIN_S to drain.

Repeated searches (SEARCH_ARGS' `--search-repeats N`, `--repeats N` here; bench/compare_repeats.py): compare.py runs
each system's search N times against the same server, each repetition a whole search (its closed-loop peak and its
probes) with an even share of the budget, so the plan counts N closed-loop runs and N x the probes per system (the
start-up once) and shares BUDGET_S over N x the systems' searches; where a repetition's share cannot hold the probes
it wants, the plan says so on a line of its own (`BUDGET_S ... does not fit N repetitions`; `cannot fit` where it
holds no probe), with the BUDGET_S that would, and whether that is more than a device call's 600 s.
With SEARCH_ARGS' `--search-peak-from-prior` (`--peak-from-prior` here) no search runs its closed loop (num_prompts at
once, num_prompts / peak s; 35-40 s a system on Mooncake's 11K-token prompts): the plan leaves it out.

ours-slo's five servers start one after the other (the engine reads its ITL SLO once, from its frozen config: no
knob changes it at runtime), so on two GPUs `GROUP=ours-slo,baselines` runs them beside always-fused and
always-split (`ours` would also run duet at SLO 50, which duet@50 already is). The table's
composite row "default (SLO = bound)" reads duet@B at each bound B (bench/compare_slo.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from frontier_groups import H200_GIB, REF_PEAK, TP_GROUPS, group_systems, peak_guess, weights_gib  # noqa: E402

from rapidserve.config import ModelConfig  # noqa: E402

SESSION_S = 1800  # a session's device time
MACHINE_START_S = 120
STASH_CALL_S = 8  # one `vs_vllm.sh --stash` call on a warm machine: ~55 MiB over; 9 took 56 s of lease on 2026-11-30
# Where `bash bench/vs_vllm.sh --split` cuts vLLM's bundle: .peer/c0 .. .peer/cN-1, one part a `--stash` call
PEER_DIR = Path(__file__).resolve().parent.parent / ".peer"
# The part count where this checkout has no .peer/c* (not split yet): what `--split` cut last (2026-12-01: vLLM
# 0.26.0's 387 MiB bundle beside a 20 MiB working tree, c0 .. c9); `--split` prints the real count
STASH_PARTS_UNSPLIT = 10
VLLM_INSTALL_S = 40  # install.sh (untar, pip --target) on the session's first group call; the model folder ~6 s
CALL_OVERHEAD_S = 30  # the tree over, the wheels installed, the results back
STARTUP_S = {"vllm": 190.0, "hybrid": 30.0, "ours": 60.0, "duet-tp1": 25.0}  # per system, by kind (kind_of)
# vLLM's start grows with the model (its compile and graph capture go layer by layer, whatever the TP): 60 s for
# qwen3-8b (15 GiB of bf16 weights; H200 2026-11-30: 60.3 s), 180-190 s for llama-3.1-70b (131 GiB, at TP 2 and 4);
# a straight line between
VLLM_STARTUP_POINTS = ((15.0, 60.0), (131.0, 190.0))  # (the model's bf16 weights GiB, start-up s)
ONE_BOUND_PROBES = 5  # probes a search of one bound wants (its two shares' brackets closed), at most
ABOVE_PEAK_PROBES = 3  # of a search's probes, those planned above the peak with --above-peak-factor > 1
ABOVE_PEAK_RATE = 1.2  # their rate, x the peak (between the peak and a ceiling ~1.4-2 x it, bisected)
SEARCH_DISCARD = 16  # bench's --search-discard default: the fewest warm-up arrivals of a probe
# rapidserve/benchmark/sustain.py's (this plan runs where the bench client's packages are not installed: not imported)
RAMP_MARGIN = 1.25  # a probe's warm-up covers this many request lifetimes
DEFAULT_MAX_PROBE_ARRIVALS = 1024  # --search-max-probe-arrivals' default
DRAIN_S = 2.0  # a probe's drain after its last arrival, at least (without a lifetime: the whole of it)
LIFE_BASE_S, LIFE_TOKEN_S = 0.3, 0.025  # a request's lifetime guess: s, and s per output token (see the docstring)
CALL_S = 600  # a device call's limit
MARGIN_S = 100  # vs_vllm.sh starts nothing new in a call's last 100 s


class Call(NamedTuple):
    what: str
    seconds: float
    detail: str
    note: str = ""  # what the plan says of it on a line of its own (BUDGET_S cannot fit --search-repeats)


def stash_parts(peer: Path | None = None) -> tuple[int, str]:
    """How many `bash bench/vs_vllm.sh --stash` calls install vLLM, and whence the count: one per part folder
    `bash bench/vs_vllm.sh --split` made in `peer` (default PEER_DIR: .peer/c0 .. .peer/cN-1, which vs_vllm.sh
    itself counts and the calls carry, `.peer/cK` each), else STASH_PARTS_UNSPLIT, said to be assumed."""
    peer = PEER_DIR if peer is None else peer
    n = sum(1 for d in peer.glob("c[0-9]*") if d.is_dir() and d.name[1:].isdigit())
    if n:
        return n, f"one part each, {peer.name}/c0 .. c{n - 1} (cut by `bash bench/vs_vllm.sh --split`)"
    return STASH_PARTS_UNSPLIT, (f"one part each; {STASH_PARTS_UNSPLIT} assumed: no {peer}/c* here yet (`bash "
                                 "bench/vs_vllm.sh --split` cuts them and says how many)")


def kind_of(system: str, tp: int = 1) -> str:
    if system.startswith("vllm"):
        return "vllm"
    if system.startswith("hybrid"):
        return "hybrid"
    return "duet-tp1" if system.startswith("duet") and tp == 1 else "ours"


def probes_wanted(system: str, max_probes: int) -> int:
    """The probes a system's search wants: a duet@B one searches one bound (bench/compare_slo.py)."""
    return min(max_probes, ONE_BOUND_PROBES) if "@" in system else max_probes


def lifetime_guess(output_tokens: int) -> float:
    """A request's lifetime (its E2E, s) under load, guessed from its output length (see the docstring)."""
    return LIFE_BASE_S + LIFE_TOKEN_S * output_tokens


def probe_seconds(rate: float, counted: int, lifetime_s: float | None,
                  cap: int = DEFAULT_MAX_PROBE_ARRIVALS) -> tuple[float, int]:
    """(seconds, warm-up arrivals) of one probe at `rate` counting `counted` arrivals: its warm-up (the ramp rule)
    and counted arrivals (at most `cap`) over the rate, then one lifetime to drain (at least DRAIN_S); without a
    lifetime the warm-up is the discard alone (the plan before the ramp rule)."""
    warm = max(SEARCH_DISCARD, math.ceil(rate * RAMP_MARGIN * (lifetime_s or 0.0) - 1e-9))  # sustain.warmup_arrivals
    return min(warm + counted, cap) / rate + max(DRAIN_S, lifetime_s or 0.0), warm


def vllm_startup_s(model_gib: float | None) -> float:
    """vLLM's start-up estimate for a model of `model_gib` of weights (VLLM_STARTUP_POINTS' line, never under its
    first point's time; None: STARTUP_S's, the largest measured)."""
    if model_gib is None:
        return STARTUP_S["vllm"]
    (w0, s0), (w1, s1) = VLLM_STARTUP_POINTS
    return max(s0, s0 + (s1 - s0) * (model_gib - w0) / (w1 - w0))


def search_s(wanted: int, probe_s: float, long_s: float, above_peak_factor: float) -> float:
    """The probes of one search: `wanted` of `probe_s` each, ABOVE_PEAK_PROBES of them `long_s` instead where
    `above_peak_factor` > 1."""
    long = min(wanted, ABOVE_PEAK_PROBES) if above_peak_factor > 1 else 0
    return (wanted - long) * probe_s + long * long_s


def group_call(group: str, systems: Sequence[str], peak: float, num_prompts: int, max_probes: int,
               budget_s: float, first_vllm: bool, tp: int = 1, above_peak_factor: float = 1.0,
               lifetime_s: float | None = None, cap: int = DEFAULT_MAX_PROBE_ARRIVALS,
               model_gib: float | None = None, repeats: int = 1, peak_from_prior: bool = False) -> Call:
    """One group's device call: its start-ups, then each search's share of what is left (as compare.py shares it).
    `lifetime_s`: a request's lifetime, for the probes' warm-ups (`probe_seconds`; None: the discard alone).
    `model_gib`: the model's weights, for vLLM's start-up (`vllm_startup_s`; None: the largest measured).
    `repeats`: compare.py's --search-repeats, each system's search that many times (each repetition a search of its
    own: its closed-loop peak, its probes, its share); where BUDGET_S cannot give every repetition its probes the
    detail says so, and what BUDGET_S would. `peak_from_prior`: SEARCH_ARGS' --search-peak-from-prior, no closed-loop
    run (each search reuses its earlier report's peak)."""
    setup = CALL_OVERHEAD_S + (VLLM_INSTALL_S if first_vllm else 0)
    startups = sum(vllm_startup_s(model_gib) if kind_of(s, tp) == "vllm" else STARTUP_S[kind_of(s, tp)]
                   for s in systems)
    counted = max(0, num_prompts - SEARCH_DISCARD)
    closed_s = 0.0 if peak_from_prior else num_prompts / peak  # a search's closed-loop run
    # probes lie between peak/4 and the peak, most near peak/2: 1 / rate averages ~1.6 / peak, a rate of peak / 1.6
    probe_s, warm = probe_seconds(peak / 1.6, counted, lifetime_s, cap)
    long_counted = math.ceil(above_peak_factor * counted)
    long_s, long_warm = probe_seconds(ABOVE_PEAK_RATE * peak, long_counted, lifetime_s, cap)
    long_n = min(long_warm + long_counted, cap)
    wanted = [probes_wanted(s, max_probes) for s in systems]
    share = max(0.0, budget_s - setup - startups - MARGIN_S) / max(1, len(systems) * repeats)
    fit = {w: max(0, int((share - closed_s) // (search_s(w, probe_s, long_s, above_peak_factor) / w)))
           for w in wanted}
    searches = repeats * (closed_s * len(systems) + sum(search_s(w, probe_s, long_s, above_peak_factor)
                                                                  for w in wanted))  # each peak, then the probes
    seconds = min(setup + startups + searches, budget_s + CALL_OVERHEAD_S)
    over = f" over {repeats} repetitions" if repeats > 1 else ""
    each = f" x {repeats} repetitions" if repeats > 1 else ""
    kinds = ", ".join(f"{wanted.count(w)} search(es){each} of ~{min(w, fit[w])} probes"
                      + (" (one bound each)" if w < max_probes else "")
                      + ("" if fit[w] >= w else f" (cut from {w} by BUDGET_S {budget_s:g}{over})")
                      for w in dict.fromkeys(wanted))
    note = ""
    if repeats > 1 and any(fit[w] < w for w in wanted):
        full = max(closed_s + search_s(w, probe_s, long_s, above_peak_factor) for w in wanted)
        need = setup + startups + MARGIN_S + full * len(systems) * repeats
        note = (f"BUDGET_S {budget_s:g} " + ("cannot fit" if min(fit.values()) < 1 else "does not fit")
                + f" {repeats} repetitions of each search: ~{share:.0f} s each, a whole one ~{full:.0f} s; "
                f"BUDGET_S ~{need:.0f} would" + (f" (more than a call's {CALL_S} s: fewer systems a call, or fewer "
                                                 "repetitions)" if need > CALL_S - CALL_OVERHEAD_S else ""))
    above = (f", up to {ABOVE_PEAK_PROBES} a search above the peak ~{long_s:.0f} s each ({long_n} arrivals)"
             if above_peak_factor > 1 else "")
    ramp = f" (warm-up ~{warm} arrivals, lifetime {lifetime_s:.2g} s)" if lifetime_s is not None else ""
    return Call(f"{group} [{', '.join(systems)}]", seconds,
                f"start-ups ~{startups:.0f} s, {kinds}, ~{probe_s:.0f} s a probe{ramp}{above}", note)


def plan(cfg: ModelConfig, preset: str, gpus: int, tp: int, groups: Sequence[str], prompt: int = 4096,
         num_prompts: int = 48, max_probes: int = 6, budget_s: float = 540, vllm_parts: int | None = None,
         stashed: bool = False, gpu_gib: float = H200_GIB, gpu_mem: float = 0.8,
         above_peak_factor: float = 1.0, lifetime_s: float | None = None,
         cap: int = DEFAULT_MAX_PROBE_ARRIVALS, repeats: int = 1, peak_from_prior: bool = False) -> list[str]:
    """The session's calls, in order, with their estimated device time and what fits in SESSION_S. `lifetime_s`: a
    request's lifetime, for the probes' warm-ups (None: the discard alone, as before the ramp rule). `repeats`: each
    search's repetitions (compare.py --search-repeats). `peak_from_prior`: no closed-loop runs (`group_call`).
    `vllm_parts`: the vLLM stash's part count (None: `stash_parts`, what `bash bench/vs_vllm.sh --split` cut)."""
    slots = gpus // tp
    if repeats < 1:
        raise ValueError(f"--search-repeats {repeats}: each search runs at least once (give N >= 1)")
    if slots < 1:
        raise ValueError(f"TP {tp} needs {tp} GPUs; the machine has {gpus}")
    peak = peak_guess(cfg, tp, prompt)
    lines = [f"frontier plan: {preset} at TP {tp} on {gpus} GPUs: {slots} group(s) side by side per call; "
             f"{prompt}-token prompts, {num_prompts} arrivals a probe, <= {max_probes} probes"
             + (f", each search {repeats} times (--search-repeats)" if repeats > 1 else "")
             + f", BUDGET_S {budget_s:g}",
             f"  closed-loop peak guess (prefill-bound, from qwen3-8b's {REF_PEAK} req/s on one H200): "
             f"{peak:.2g} req/s; weights {weights_gib(cfg):.0f} GiB bf16"
             + (f"; request lifetime {lifetime_s:.2g} s (the probes' warm-ups: the ramp rule)"
                if lifetime_s is not None else "")]
    calls = [Call("machine start", MACHINE_START_S, "a minute or more, held")]
    if not stashed:  # vLLM's FA3 build serves ours too (FA3_FROM_VLLM=1): every group wants it installed
        parts, whence = stash_parts() if vllm_parts is None else (vllm_parts, "one part each (--vllm-parts)")
        calls.append(Call(f"vLLM stash: {parts} calls", parts * STASH_CALL_S,
                          f"bash bench/vs_vllm.sh --stash, {whence}, back to back"))
    first_vllm = not stashed
    for i in range(0, len(groups), slots):
        side = []
        for g in groups[i:i + slots]:
            ours, vllm, note = group_systems(g, cfg, tp, gpu_gib, gpu_mem)
            side.append(group_call(g, [*vllm, *ours], peak, num_prompts, max_probes, budget_s, first_vllm, tp,
                                   above_peak_factor, lifetime_s, cap, weights_gib(cfg), repeats, peak_from_prior))
            lines += [f"  {g}: {x}" for x in (note, side[-1].note) if x]
        first_vllm = False  # the first call installs it
        calls.append(Call(" | ".join(c.what for c in side), max(c.seconds for c in side),
                          " | ".join(c.detail for c in side)))
    total = 0.0
    for k, c in enumerate(calls):
        total += c.seconds
        mark = "" if total <= SESSION_S else "  <- over the session's 30 min: next session"
        lines.append(f"  {k}. {c.what}: ~{c.seconds:.0f} s ({c.detail}); total ~{total:.0f} s{mark}")
    lines.append(f"  total ~{total:.0f} s of {SESSION_S} s: "
                 + ("fits" if total <= SESSION_S else f"over by {total - SESSION_S:.0f} s: run the calls marked "
                    "over in a later session (or fewer probes, fewer groups)"))
    return lines


def _model(preset: str) -> ModelConfig:
    """The preset's ModelConfig, from rapidserve/loader/preset_table.py read alone: the loader package imports
    torch (5 s), which this plan does not need."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rapidserve", "loader", "preset_table.py")
    spec = importlib.util.spec_from_file_location("_frontier_preset_table", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    table = mod.preset_table()
    if preset not in table:
        raise ValueError(f"PRESET={preset}: give one of {', '.join(sorted(table))}")
    return table[preset]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the frontier's groups and a session's device-time plan")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("group", help="print a group's systems: ours, vLLM's (comma-separated), a note")
    g.add_argument("group")
    pl = sub.add_parser("plan", help="print the calls of a session and their estimated device time")
    pl.add_argument("--gpus", type=int, required=True)
    pl.add_argument("--groups", default=",".join(TP_GROUPS[:3]))
    pl.add_argument("--prompt", type=int, default=4096, help="prompt tokens of the workload")
    pl.add_argument("--num-prompts", type=int, default=48)
    pl.add_argument("--max-probes", type=int, default=6)
    pl.add_argument("--budget-s", type=float, default=540)
    pl.add_argument("--vllm-parts", type=int, default=None, help="the vLLM stash's part count (default: the "
                    f".peer/c* folders `bash bench/vs_vllm.sh --split` made, else {STASH_PARTS_UNSPLIT})")
    pl.add_argument("--above-peak-factor", type=float, default=1.0,
                    help="SEARCH_ARGS' --search-above-peak-factor: plan each search's probes above the peak that long")
    pl.add_argument("--output", type=int, default=64, help="output tokens of the workload: the request lifetime's "
                    "guess, for the probes' warm-ups (the ramp rule)")
    pl.add_argument("--lifetime-s", type=float, default=None, help="a request's lifetime under load, s (default: "
                    "guessed from --output)")
    pl.add_argument("--max-probe-arrivals", type=int, default=DEFAULT_MAX_PROBE_ARRIVALS,
                    help="SEARCH_ARGS' --search-max-probe-arrivals: no probe is planned longer")
    pl.add_argument("--repeats", type=int, default=1, help="SEARCH_ARGS' --search-repeats: each search that many times")
    pl.add_argument("--peak-from-prior", action="store_true",
                    help="SEARCH_ARGS' --search-peak-from-prior: no closed-loop run before each search")
    pl.add_argument("--stashed", action="store_true", help="vLLM is installed on the machine already (a warm one)")
    for q in (g, pl):
        q.add_argument("--tp", type=int, default=1)
        q.add_argument("--preset", default="qwen3-8b")
        q.add_argument("--gpu-gib", type=float, default=H200_GIB)
        q.add_argument("--gpu-mem", type=float, default=0.8)
    a = p.parse_args(argv)
    try:
        cfg = _model(a.preset)
        if a.cmd == "group":
            ours, vllm, note = group_systems(a.group, cfg, a.tp, a.gpu_gib, a.gpu_mem)
            print(",".join(ours), ",".join(vllm), note, sep="\n")
        else:
            groups = [x.strip() for x in a.groups.split(",") if x.strip()]
            life = a.lifetime_s if a.lifetime_s is not None else lifetime_guess(a.output)
            print("\n".join(plan(cfg, a.preset, a.gpus, a.tp, groups, a.prompt, a.num_prompts, a.max_probes,
                                 a.budget_s, a.vllm_parts, a.stashed, a.gpu_gib, a.gpu_mem, a.above_peak_factor,
                                 life, a.max_probe_arrivals, a.repeats, a.peak_from_prior)))
    except ValueError as e:
        print(f"frontier_plan: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
