"""Our fused MoE experts against maintained kernels (issue 40: "use a maintained kernel where one installs and runs
on the GPU machine ... measure candidates"): rapidserve's `fused_moe` (rapidserve/ops/triton_moe.py), vLLM's
`fused_experts` (vllm/model_executor/layers/fused_moe/fused_moe.py: Triton GEMMs on its tuned configs, the
alignment from its compiled _moe_C) and torch's own grouped GEMM, `torch._grouped_mm` ("torch_gmm": the pairs
sorted by expert with torch ops, two CUTLASS grouped GEMMs, torch's silu_and_mul between, the weighted k-way sum;
bench/moe_candidate_kernels.py's `grouped_mm_experts`, whose module docstring says what _grouped_mm requires), on
one layer of a MoE preset with the same random weights and the same routing. torch_gmm is measured because ours
reaches only 0.68 / 0.78 of the bound at Qwen3-30B-A3B's 4096 / 8192-token prefill and 0.75 at Mixtral's 1024
(bench/results/issue40.md): a CUTLASS grouped GEMM that ships with torch (2.11 on the GPU machine, nothing to
install) may do better there; at decode batches its sort, gathers and ~10 launches will probably lose. It has not
run on a GPU yet: the first run is the next H200 session's, the command of the GPU recipe below as it stands.
It runs CUTLASS only in bfloat16 on sm_90 / sm_100; elsewhere every row says why it is not measured.

    python bench/moe_candidates.py [--models qwen3-30b-a3b,mixtral-8x7b] [--tp 1[,2]] [--dtype bfloat16]
        [--decode-batches 1,2,4,8,16,32,64] [--prefill-tokens 1024,4096,8192] [--vllm-path DIR] [--tables DIR]
        [--candidates ours,vllm,torch_gmm] [--budget-s S] [--json PATH]
    TRITON_INTERPRET=1 python bench/moe_candidates.py --dry-run [--vllm-path DIR] [--json PATH]   # CPU: the flow

The layer, the routing and the limits are bench/moe_gemm.py's (imported, not copied): a rank's slice at each --tp
(w13 [E, 2I/tp, h] gate rows then up rows, w2 [E, h, I/tp]; vLLM 0.26 takes exactly this layout, w1 = w13 with
N = 2I, so both get the same tensors), tokens routed uniformly at random (a random router's softmax top-k,
renormalised; weights float32, ids int32 as vLLM's own fused_topk gives them). Per row, before any timing, each
candidate's output is checked against the torch reference (`moe_experts_ref` in float32; relative error < 3e-2, as
moe_gemm's check) and the candidates against each other ("between": the largest difference of two, relative to
the reference's max); a candidate that fails or disagrees is not timed and the row says why. --candidates: which
run (names from ours, vllm, torch_gmm; the columns keep that order whatever the flag's). Times: "us", a CUDA-graph
replay of the call (median; how the engine runs decode, and the GPU's time of a prefill); "eager us", calls
launched back to back from Python (per call: the larger of host and GPU time).
Limits: decode, moe_gemm's copy ceiling (the weights of the experts the batch's routing reads, at the copy bandwidth
of a 1 GiB device copy); prefill, moe_gemm's bound (the larger of the same flops on dense cuBLAS GEMMs and the
compulsory bytes at the copy bandwidth). "of ceiling" / "of bound" = limit / time (1 = at the limit).
"vLLM/ours", "torch/ours" = its time / ours (above 1: ours is faster). Columns "ours tiles": BLOCK_M
(+ TAIL_BLOCK_M) and whether a tuned table of this shape and device was found ("tuned") or the rule; "vLLM config":
BLOCK_SIZE_M x _N x _K, GROUP_SIZE_M, warps, stages, "tuned" where vLLM found its shipped config file for this E,
N = I/tp and device (E=128,N=768,device_name=NVIDIA_H200.json ...; it picks the entry whose batch key is nearest
the token count), "naive" where vLLM 0.26 skips the alignment (tokens * top_k * 4 <= E: Qwen3-30B-A3B decode at
batches 1-4, Mixtral at 1); "torch config": the path _grouped_mm took ("cutlass grouped", or the CPU's "mm-loop
fallback") and torch's version.

vLLM is optional: --vllm-path DIR goes first on sys.path (after torch, Triton and rapidserve are imported; it is
pip's --target of the peer install, /root/peersite on the GPU machine, whose only package the image also has is
setuptools). Its fused_moe module is imported in a child process first (a crash or hang there cannot take our rows
with it), then here; if either fails (or DIR holds no vllm), every row says why ("vllm not importable: ...") and
ours are still timed. Importing it needs no vLLM config: the functional `fused_experts` path (config lookup,
moe_align_block_size, the two GEMMs, silu_and_mul and moe_sum from its compiled ops) reads only environment
variables (VLLM_LOGGING_LEVEL defaults to WARNING here).

Rows run in order tp, model, decode batches then prefill tokens; none starts after --budget-s seconds (those left
are listed as skipped); a row that fails outside the candidates (the reference, the bound) says so and the next
runs; --json PATH is rewritten after every row (so a call cut short still returns what finished), the tables
(bench/moe_candidates_table.py) beside it as PATH with .md. The table comes last. The CPU dry run runs torch_gmm
on torch's CPU fallback of _grouped_mm (float16 there), so its flow and numbers are checked against the reference.

GPU machine (H200), next session. It reaches no package index; vLLM 0.26.0 and its missing wheels are the peer
benchmark's parts, /work/main/.peer/c0 ... c9 (bench/vs_vllm.sh step 0 made them: fetch.py, then --split; .peer is
git-ignored, so carry names them):
  1. One call a part, back to back (the machine keeps its disk only while held; if one of them lands on a fresh
     machine, begin again at c0), K = 0 .. 9 (as many as there are .peer/c* folders):
        run(command="bash bench/vs_vllm.sh --stash", carry=[".peer/cK", ".peer/peer_vllm"], timeout_s=120)
  2. At once, on the same machine, the install (what bench/peer_env.sh's peer_install runs: install.sh, stashed by
     --stash, unpacks the parts and pip-installs them with --target /root/peersite, beside the image's torch; skipped
     when an earlier call installed it) and this script, in one call whose command is these two lines (a newline
     or "; " between them; $SECONDS: the install's time comes off the budget):
     S=/root/peersite; [ -f $S/vllm/__init__.py ] || bash /root/peerstash/peer_vllm/install.sh 2>&1 | tail -3
     python3 bench/moe_candidates.py --vllm-path $S --tp 1,2 --budget-s $((500-SECONDS)) --json $OUT/moe_candidates.json
     with timeout_s=600. Without the stash calls, or if the install fails, the same command still times ours and
     each row says why vLLM is missing. Rows at tp 2 come last: those the budget leaves out are listed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import moe_gemm, moe_timing  # noqa: E402
from bench.moe_candidate_kernels import GMM_NAME, Candidate, grouped_mm, load_vllm, ours, short  # noqa: E402
from bench.moe_candidates_table import cell, note, table  # noqa: E402
from rapidserve.ops.moe import moe_experts_ref, route  # noqa: E402

DEFAULT_MODELS = "qwen3-30b-a3b,mixtral-8x7b"  # Qwen3 first: its decode is where ours is furthest from the ceiling
DECODE_BATCHES = moe_gemm.DECODE_BATCHES
PREFILL_TOKENS = (1024, 4096, 8192)
REPS = (10, 50)  # timings per prefill row, per decode row (moe_gemm's)
TOL = 3e-2  # relative error against the reference (moe_gemm's check)
CANDIDATES = ("ours", "vllm", GMM_NAME)  # --candidates' names, in the tables' order
DRY_RUN = {"model": "tiny-qwen3-moe", "dtype": "float16", "decode": (1, 4), "prefill": (32,), "reps": (1, 1)}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (want in float32)."""
    return float((got.float() - want).abs().max() / want.abs().max())


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


Clock = Callable[[Callable[[], object], int, str], float]  # (fn, reps, device) -> ms (moe_timing's)


def checked(label: str, call: Callable[[], torch.Tensor], want: torch.Tensor, device: str,
            tol: float = TOL) -> tuple[torch.Tensor | None, float | None, str]:
    """call()'s output against `want` (the reference, float32): (output, relative error, "") where it agrees within
    `tol`; else (None, the error or None, why: it failed, returned another shape, or disagrees)."""
    try:
        got = call()
        sync(device)
    except Exception as e:  # noqa: BLE001 - one candidate failing leaves the others their rows
        return None, None, f"{label} failed: {short(e)}"
    if tuple(got.shape) != tuple(want.shape):
        return None, None, f"{label} returned {tuple(got.shape)}, not {tuple(want.shape)}"
    err = rel_err(got, want)
    if not err < tol:  # NaN fails too
        return None, err, f"{label} disagrees with the reference: relative error {err:.3g}"
    return got, err, ""


def timed(label: str, call: Callable[[], object], clocks: dict[str, Clock], reps: int,
          device: str) -> tuple[dict[str, float | None], str]:
    """Each clock's ms of call (key: what it is, e.g. "graph"; None where it failed), and the failures ("" if
    none)."""
    out: dict[str, float | None] = {}
    why: list[str] = []
    for what, clock in clocks.items():
        try:
            out[what] = clock(call, reps, device)
        except Exception as e:  # noqa: BLE001 - e.g. a capture that fails: said in the row
            out[what] = None
            why.append(f"{label} {what} timing failed: {short(e)}")
    return out, "; ".join(why)


def measure(cands: list[Candidate], x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
            ids: torch.Tensor, want: torch.Tensor, reps: int, device: str,
            graph_ms: Clock = moe_timing.graph_ms, eager_ms: Clock = moe_timing.back_to_back_ms) -> dict[str, object]:
    """Each candidate on (x, ...): its output against `want` (the reference, `checked`), then, where it agrees, its
    graph and eager ms; and the outputs against each other ("between_err": the largest max |a - b| of two that
    agreed, relative to max |want|; None with fewer than two). Keys per candidate NAME: NAME_ms, NAME_eager_ms,
    NAME_err, NAME_config, NAME_why ("" when it was timed)."""
    row: dict[str, object] = {}
    outs: dict[str, torch.Tensor] = {}
    t, k = ids.shape
    for c in cands:
        n = c.name
        row.update({f"{n}_ms": None, f"{n}_eager_ms": None, f"{n}_err": None, f"{n}_config": None,
                    f"{n}_why": c.why})
        if c.run is None:
            continue
        if c.describe is not None:
            try:
                row[f"{n}_config"] = c.describe(t, k, w13, w2)
            except Exception as e:  # noqa: BLE001 - the description is a courtesy: the row goes on without it
                row[f"{n}_config"] = f"? ({short(e, 60)})"
        call = lambda c=c: c.run(x, w13, w2, weights, ids)  # type: ignore[misc]  # run is not None here
        got, row[f"{n}_err"], row[f"{n}_why"] = checked(c.label, call, want, device)
        if got is None:
            continue
        outs[n] = got
        ms, row[f"{n}_why"] = timed(c.label, call, {"graph": graph_ms, "eager": eager_ms}, reps, device)
        row[f"{n}_ms"], row[f"{n}_eager_ms"] = ms["graph"], ms["eager"]
    got_all = list(outs.values())
    between = [float((a.float() - b.float()).abs().max() / want.abs().max())
               for i, a in enumerate(got_all) for b in got_all[i + 1:]]
    row["between_err"] = max(between) if between else None
    return row


def ratio(a: object, b: object) -> float | None:
    return float(a) / float(b) if isinstance(a, float) and isinstance(b, float) and b > 0 else None


def finish_row(row: dict[str, object], limit_ms: float, names: Sequence[str]) -> dict[str, object]:
    """The derived columns of the candidates `names`: each one's time over ours (NAME_over_ours, but ours) and its
    share of the limit (ceiling or bound)."""
    for n in names:
        if n != "ours":
            row[f"{n}_over_ours"] = ratio(row.get(f"{n}_ms"), row.get("ours_ms"))
        row[f"{n}_of_limit"] = ratio(limit_ms, row.get(f"{n}_ms"))
    return row


def bench_layer(model: str, tp: int, dtype: torch.dtype, copy_bw: float, cands: list[Candidate], device: str,
                decode_batches: tuple[int, ...], prefill_tokens: tuple[int, ...], reps: tuple[int, int],
                deadline: float, emit: Callable[[dict[str, object]], None], skipped: list[str]) -> None:
    """`model`'s layer at tp: every decode batch, then every prefill token count, each row passed to `emit`; one
    that would start after `deadline` (time.perf_counter) is appended to `skipped` instead."""
    router, w13, w2, k, h = moe_gemm.layer(model, tp, dtype, device)
    w13f, w2f = w13.float(), w2.float()
    g = torch.Generator(device=device).manual_seed(1)
    for phase, sizes in (("decode", decode_batches), ("prefill", prefill_tokens)):
        for t in sizes:
            name = f"{model} tp{tp} {phase} {t}"
            if time.perf_counter() > deadline:
                skipped.append(name)
                continue
            row: dict[str, object] = {"model": model, "tp": tp, "phase": phase, "tokens": t, "pairs": t * k,
                                      "unique_experts": None, "bytes_read": None}
            try:
                x = torch.randn(t, h, device=device, dtype=dtype, generator=g)
                weights, ids = route(F.linear(x, router), k, True)
                want = moe_experts_ref(x.float(), w13f, w2f, weights, ids).float()
                row["unique_experts"], row["bytes_read"] = unique, read = moe_gemm.experts_read(ids, w13)
                row.update(measure(cands, x, w13, w2, weights, ids, want, reps[phase == "decode"], device))
                if phase == "decode":
                    row["ceiling_ms"] = limit = moe_gemm.decode_ceiling_ms(read, copy_bw)
                else:
                    bound = moe_gemm.prefill_bound(x, ids, w13, w2, copy_bw, reps[0], device, g)
                    row.update(bound)
                    limit = float(bound["bound_ms"])  # type: ignore[arg-type]  # prefill_bound's float
                finish_row(row, limit, [c.name for c in cands])
            except Exception as e:  # noqa: BLE001 - the row says so and the next one runs (what finished is kept)
                row["error"] = f"row failed: {short(e)}"
            emit(row)
            x = weights = ids = want = None  # type: ignore[assignment]  # freed before the next row's
    del router, w13, w2, w13f, w2f
    if device == "cuda":
        torch.cuda.empty_cache()


def parse_counts(flag: str, text: str) -> tuple[int, ...]:
    """--decode-batches / --prefill-tokens: comma-separated whole numbers >= 1, each once, in the order given."""
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: comma-separated whole numbers >= 1 (e.g. 1,2,4)") from None
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise ValueError(f"{flag} {text!r}: comma-separated whole numbers >= 1, each once (e.g. 1,2,4)")
    return counts


def parse_candidates(text: str) -> tuple[str, ...]:
    """--candidates: comma-separated names from CANDIDATES, each once; returned in CANDIDATES' order (the tables')."""
    names = [t.strip() for t in text.split(",")]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown or len(set(names)) != len(names):
        what = f"unknown {', '.join(map(repr, unknown))}: " if unknown else ""
        raise ValueError(f"--candidates {text!r}: {what}comma-separated names from {', '.join(CANDIDATES)}, each once")
    return tuple(n for n in CANDIDATES if n in names)


def parse_budget(text: str) -> float:
    try:
        budget = float(text)
    except ValueError:
        budget = float("nan")
    if not budget > 0 or math.isinf(budget):
        raise ValueError(f"--budget-s {text!r}: a number of seconds > 0 (no row starts after it)")
    return budget


def write_json(path: Path | None, report: dict[str, object], tables: str | None = None) -> None:
    if path is None:
        return
    path.write_text(json.dumps(report, indent=1))
    if tables is not None:
        path.with_suffix(".md").write_text(tables + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=None, help=f"comma-separated MoE presets (default {DEFAULT_MODELS})")
    ap.add_argument("--tp", default=None, help="time one rank's slice of every expert at these TP sizes "
                    "(comma-separated; default 1)")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float16"), help="default bfloat16")
    ap.add_argument("--decode-batches", default=None,
                    help=f"comma-separated (default {','.join(map(str, DECODE_BATCHES))})")
    ap.add_argument("--prefill-tokens", default=None,
                    help=f"comma-separated (default {','.join(map(str, PREFILL_TOKENS))})")
    ap.add_argument("--vllm-path", type=Path, default=None,
                    help="a folder holding the vllm package (pip --target; /root/peersite on the GPU machine), put "
                    "first on sys.path; without it, `import vllm` as installed")
    ap.add_argument("--tables", type=Path, help="our tuned tables from this folder (bench/moe_tune.py's "
                    "moe_configs/) instead of the packaged ones")
    ap.add_argument("--candidates", default=",".join(CANDIDATES),
                    help=f"which run: comma-separated from {','.join(CANDIDATES)} (default all)")
    ap.add_argument("--budget-s", default="480", help="start no row after this many seconds (default 480)")
    ap.add_argument("--json", type=Path, help="write the rows here (after every row), the tables beside it (.md)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter: tiny-qwen3-moe, float16, "
                    "decode 1 and 4, prefill 32, one timing each: checks the flow, measures nothing")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    try:  # every flag first: a bad one is refused by name on any machine
        budget = parse_budget(args.budget_s)
        names = parse_candidates(args.candidates)
        if args.dry_run:
            fixed = [flag for flag, v in (("--models", args.models), ("--tp", args.tp), ("--dtype", args.dtype),
                                          ("--decode-batches", args.decode_batches),
                                          ("--prefill-tokens", args.prefill_tokens), ("--tables", args.tables))
                     if v is not None]
            if fixed:
                raise ValueError(f"--dry-run times {DRY_RUN['model']} at TP 1 in float16 on the CPU: drop "
                                 f"{', '.join(fixed)}")
            models, tps, dtype_name = [str(DRY_RUN["model"])], [1], str(DRY_RUN["dtype"])
            decode, prefill = DRY_RUN["decode"], DRY_RUN["prefill"]
            reps: tuple[int, int] = DRY_RUN["reps"]  # type: ignore[assignment]
            tables = None
        else:
            models = moe_gemm.parse_models(args.models or DEFAULT_MODELS)
            tps = moe_gemm.parse_tps(args.tp or "1", models)
            dtype_name = args.dtype or "bfloat16"
            decode = parse_counts("--decode-batches", args.decode_batches or ",".join(map(str, DECODE_BATCHES)))
            prefill = parse_counts("--prefill-tokens", args.prefill_tokens or ",".join(map(str, PREFILL_TOKENS)))
            reps = REPS
            tables = moe_gemm.read_tables_dir(args.tables) if args.tables else None
        if args.json is not None and not args.json.parent.is_dir():
            raise ValueError(f"--json {args.json}: no folder {args.json.parent}")
    except ValueError as e:
        ap.error(str(e))
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--dry-run runs the kernels on the CPU: set TRITON_INTERPRET=1")
        device = "cpu"
    elif not torch.cuda.is_available():
        print("needs a CUDA or ROCm GPU (or --dry-run under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    else:
        device = "cuda"
    dtype = getattr(torch, dtype_name)
    cands: list[Candidate] = []
    vllm: Candidate | None = None
    for n in names:
        if n == "ours":
            cands.append(ours(tables))
        elif n == "vllm":
            cands.append(vllm := load_vllm(args.vllm_path))
            print(f"vLLM: {vllm.version + ' from ' + vllm.where if vllm.run else vllm.why}", flush=True)
        else:
            cands.append(gmm := grouped_mm(device, dtype))
            print(gmm.title if gmm.run else f"{gmm.label}: {gmm.why}", flush=True)
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    copy_bw = moe_timing.copy_bandwidth(device, 1 << 20 if args.dry_run else 1 << 29)
    rows: list[dict[str, object]] = []
    skipped: list[str] = []

    def report(done: bool) -> dict[str, object]:
        return {"device": dev_name, "copy_bw": copy_bw, "dtype": dtype_name, "torch": torch.__version__,
                "vllm": None if vllm is None else {
                    "version": vllm.version or None, "why": vllm.why or None, "from": vllm.where or None,
                    "vllm_path": str(args.vllm_path) if args.vllm_path else None},
                "candidates": {c.name: {"label": c.label, "version": c.version or None, "why": c.why or None}
                               for c in cands},
                "budget_s": budget, "done": done, "skipped": skipped, "rows": rows}

    def emit(row: dict[str, object]) -> None:
        rows.append(row)
        said = [f"{c.head} {cell(row.get(f'{c.name}_ms'), '.1f', 1e3)} us" for c in cands] + \
            [f"{c.head}/ours {cell(row.get(f'{c.name}_over_ours'), '.2f')}" for c in cands
             if c.name != "ours" and "ours" in names]
        why = note(row, list(names))
        print(f"[{time.perf_counter() - start:.0f} s] {row['model']} tp{row['tp']} {row['phase']} {row['tokens']}: "
              f"{', '.join(said)}{' (' + why + ')' if why else ''}", flush=True)
        write_json(args.json, report(False))

    deadline = start + budget
    for tp in tps:
        for model in models:
            try:
                bench_layer(model, tp, dtype, copy_bw, cands, device, decode, prefill, reps, deadline, emit, skipped)
            except Exception as e:  # noqa: BLE001 - e.g. the layer's weights not fitting: the next layer still runs
                skipped.append(f"{model} tp{tp} (failed: {short(e)})")
                print(f"{model} tp{tp} failed: {short(e)}", flush=True)
    tables_text = table(rows, copy_bw, cands)
    if skipped:
        tables_text += f"\n\nnot run (past --budget-s {budget:g}, or failed): {', '.join(skipped)}"
    write_json(args.json, report(True), tables_text)
    print(f"\n{dev_name}, {dtype_name}, {time.perf_counter() - start:.0f} s\n")
    print(tables_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
