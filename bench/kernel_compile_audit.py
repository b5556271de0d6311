"""Every Triton kernel the engine launches, compiled for sm_90 on a CPU machine at the engine's own launch parameters,
with what its SASS does with memory: global loads and stores by width, cp.async copies by width, the tensor-core
instruction (wgmma or mma.sync), shared memory, registers, spills, programs an SM (bench/sm90_compile.py).

    PYTHONPATH=DIR_WITH_TRITON_3.6 python -m bench.kernel_compile_audit --out bench/results/kernel_compile_audit
        [--shapes qwen3-8b:1:bfloat16,...] [--kernels _rope_write_kernel,...] [--before OLD.json] [--jobs N]

Which launches: bench/amd_launches.py's capture of the engine's launch code for each model shape (`--shapes`,
preset:tp:dtype:block_size, or ci / full: bench/amd_launches.py's matrices; the default covers Qwen3-8B's dense
layer, Gemma 3's windowed head_dim-256 attention and the two MoE models, Qwen3-30B-A3B and Mixtral at tp 2) on the
sm_90 target: decode at every graph batch bucket, prefill, mixed steps, the unfused fallbacks, the skinny bf16 GEMM,
fp8 block and per-row layers (the skinny fp8 GEMM at the packaged tables' tiles, split-K and its reduce), an fp8 KV
cache; plus the MoE kernels at every bucket of every packaged MoE table (`fused_moe` at that bucket's pairs,
`moe_table_launches`). Each distinct launch is specialised as Triton's JIT would specialise it
(bench/amd_compile_check.make_job: pointer and integer divisibility, == 1) and compiled once; a row lists the steps
that use it.

The PDL column reads where a kernel launched with programmatic dependent launch (rapidserve/ops/pdl.py: every decode
kernel on sm_90) waits and lets the next kernel start, in its SASS (`pdl_sites`): "wait first" (no global access
and no launch_dependents before griddepcontrol.wait: else the row is flagged "pdl-order"), how many of its global
loads come before launch_dependents (all but the epilogue's for the GEMMs and the attention's split kernel), and its
bulk L2 prefetches.

A row is flagged "short" when a source line's global loads or stores are narrower than its layout allows
(`short_accesses` of bench/sm90_compile.py: the PTX's accesses by source line against the TTGIR's tile a thread
holds): a contiguous row read one element an instruction, as the decode attention's K/V tiles were under Triton 3.6
(the GPU machines') before 05f93ef (bench/results/decode_attn_compile/), or a gather, or an access masked by a bound
the compiler cannot see (which the site's source line decides). Run it under the GPU machines' Triton (PYTHONPATH:
the README of the results says how it was installed); this machine's Triton 3.9 infers facts 3.6 loses. `--before`:
an earlier run's JSON; cells that changed show "before -> after". Writes DIR/kernel_compile_audit.json and
DIR/README.md (the table; it links DIR/findings.md, a hand-written reading, where one exists).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.amd_compile_check import Job, make_job  # noqa: E402
from bench.amd_launches import TARGETS, Launch, Shape, capture, jit_function, recording, shapes  # noqa: E402
from bench.json_rows import dump_report  # noqa: E402
from bench.sm90_compile import compile_sm90, pdl_text, summarise, widths_text  # noqa: E402
from rapidserve.jsonfile import load_unique  # noqa: E402

DEFAULT_SHAPES = ("qwen3-8b:1:bfloat16", "gemma3-12b:1:bfloat16", "qwen3-30b-a3b:1:bfloat16", "mixtral-8x7b:2:bfloat16")
FINDINGS = "findings.md"  # a hand-written reading of the table in --out, linked from the README when present
SUMMARY_FIELDS = ("ldg", "stg", "cp_async", "tma", "mma", "smem", "regs", "spill_bytes", "programs_per_sm", "limiter")
TARGET = TARGETS["sm_90"]


def parse_shape(text: str) -> Shape:
    """"preset:tp:dtype:block_size" (all but the preset optional: 1, bfloat16, 16)."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 4 or not parts[0] or not all(p.isdigit() for p in parts[1:2] + parts[3:]):
        raise ValueError(f"shape {text!r}: use preset[:tp[:dtype[:block_size]]], e.g. qwen3-8b:1:bfloat16:16")
    return Shape(parts[0], int(parts[1]) if len(parts) > 1 else 1, parts[2] if len(parts) > 2 else "bfloat16",
                 int(parts[3]) if len(parts) > 3 else 16)


def parse_shapes(text: str) -> list[Shape]:
    """`--shapes`: comma-separated `parse_shape`s, and "ci" / "full": bench/amd_launches.shapes' matrices for sm_90
    (every real preset at tp 1 and its largest tp; every tp, dtype and block size 8 / 32)."""
    out: list[Shape] = []
    for part in (p for p in text.split(",") if p):
        out += shapes(part, "sm_90") if part in ("ci", "full") else [parse_shape(part)]
    return list(dict.fromkeys(out))


def record(call: Callable[[], object], label: str) -> list[Launch]:
    """The kernel launches `call` makes (on meta tensors: nothing runs) with the sm_90 target's platform, each marked
    `label`."""
    sink: list[Launch] = []
    with recording(TARGET, sink, lambda: label):
        call()
    return sink


def moe_table_launches() -> list[Launch]:
    """The MoE kernels' launches (alignment, gate|up, down) at each bucket of every packaged MoE table, as `fused_moe`
    makes them with that bucket's config at its pairs count (meta tensors: nothing runs); at the prefill buckets
    (BLOCK_M 64 and up) also with both GEMMs' weights by TMA, and by TMA on a persistent grid (the variants
    ops/triton_moe_gemm.py offers the tuner: bench/results/moe_prefill.md)."""
    import torch

    from rapidserve.loader.preset_table import preset_table
    from rapidserve.ops import triton_moe

    out: list[Launch] = []
    meta = torch.device("meta")
    top_ks = {(c.moe.num_experts, c.hidden_size): c.moe.top_k for c in preset_table().values() if c.moe is not None}
    for key, table in triton_moe.TUNED.items():
        dtype = getattr(torch, key.dtype)
        top_k = top_ks.get((key.num_experts, key.k), 2)
        variants = [(per_expert, cfg, "") for per_expert, cfg in table.buckets]
        variants += [(per_expert, cfg._replace(gate_up=cfg.gate_up._replace(tma=1, persistent=p),
                                               down=cfg.down._replace(tma=1, persistent=p)),
                      ", TMA, persistent" if p else ", TMA")
                     for per_expert, cfg in table.buckets if cfg.block_m >= 64 for p in (0, 1)]
        for per_expert, cfg, variant in variants:
            pairs = max(top_k, round(per_expert * key.num_experts) // top_k * top_k)
            t = pairs // top_k
            out += record(lambda t=t, top_k=top_k, dtype=dtype, key=key, cfg=cfg: triton_moe.fused_moe(
                torch.empty(t, key.k, dtype=dtype, device=meta),
                torch.empty(key.num_experts, 2 * key.n, key.k, dtype=dtype, device=meta),
                torch.empty(key.num_experts, key.k, key.n, dtype=dtype, device=meta),
                torch.empty(t, top_k, dtype=torch.float32, device=meta),
                torch.empty(t, top_k, dtype=torch.int32, device=meta), config=cfg),
                f"MoE table E={key.num_experts} N={key.n} K={key.k}, {per_expert:g} pairs an expert{variant}")
    return out


def make_jobs(sources: list[tuple[str, list[Launch]]], kernels: set[str] | None = None) -> list[Job]:
    """Every distinct sm_90 compile of the launches of `sources` ((label, launches) pairs), of `kernels` (None:
    all), each with the "label: step" of the launches that use it."""
    jobs: dict[str, Job] = {}
    binders: dict[tuple[str, str], Any] = {}
    for label, launches in sources:
        for launch in launches:
            if kernels is not None and launch.kernel not in kernels:
                continue
            job = make_job(launch, TARGET, binders)
            job = jobs.setdefault(job.key(), job)
            use = f"{label}: {launch.step}"
            if use not in job.used_by:
                job.used_by.append(use)
    return list(jobs.values())


def plan(models: list[Shape], kernels: set[str] | None, moe_tables: bool = True) -> list[Job]:
    """Every distinct sm_90 compile of the model shapes' launches (and the MoE tables'), of `kernels` (None: all), with
    the steps that use each."""
    sources: list[tuple[str, list[Launch]]] = [(s.label, capture(s, TARGET).launches) for s in models]
    if moe_tables and (kernels is None or kernels & {"_gate_up_kernel", "_down_kernel", "_align_one_kernel",
                                                      "_align_count_kernel", "_align_scatter_kernel"}):
        sources.append(("packaged MoE tables", moe_table_launches()))
    return make_jobs(sources, kernels)


def row_key(job: Job) -> str:
    """A launch's identity across runs and Triton versions (`--before`): kernel, argument types, constexprs, the
    arguments specialised as multiples of 16, warps and stages (Job.key() holds every compile option, which differ
    between Triton versions)."""
    return repr((job.kernel, sorted(job.signature.items()), sorted(job.named_constexprs().items()), aligned_args(job),
                 job.options.get("num_warps"), job.options.get("num_stages")))


def aligned_args(job: Job) -> list[str]:
    """The arguments the JIT specialised as multiples of 16 (pointers: 16-byte aligned)."""
    names = jit_function(job.kernel).arg_names
    return sorted(names[p[0]] for p, v in job.attrs.items() if ["tt.divisibility", 16] in v)


def audit_job(job: Job) -> dict[str, Any]:
    """Compile one job for sm_90 and summarise it (in a worker process); {"error": ...} if it does not compile."""
    t0 = time.perf_counter()
    try:
        kernel = compile_sm90(jit_function(job.kernel), job.signature, job.constexprs, job.attrs, job.options)
        out = summarise(kernel)
    except Exception as e:  # noqa: BLE001 - a failed compile is a row of the audit, named
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:100] if str(e).strip() else ''}"}
    pdl = out["pdl"]
    flags = (["short"] if out["short"] else []) + (["pdl-order"] if pdl["before_wait"] or pdl["dependents_before_wait"]
                                                    else [])
    return {**out, "flags": flags, "compile_s": round(time.perf_counter() - t0, 1)}


def audit(todo: list[Job], procs: int = 1) -> list[dict[str, Any]]:
    """One row a job (its launch, the steps that use it and `audit_job`'s summary), sorted by kernel and launch;
    compiled in `procs` processes (Triton's cache: $TRITON_CACHE_DIR, inherited by them)."""
    if procs <= 1:
        results = [audit_job(j) for j in todo]
    else:
        with ProcessPoolExecutor(procs, mp_context=get_context("spawn")) as pool:
            results = list(pool.map(audit_job, todo))
    rows = [{"kernel": j.kernel, "key": row_key(j), "signature": j.signature, "constexprs": j.named_constexprs(),
             "aligned": aligned_args(j),
             "options": {k: v for k, v in j.launch_options().items() if k in ("num_warps", "num_stages")},
             "used_by": j.used_by, **res} for j, res in zip(todo, results, strict=True)]
    return sorted(rows, key=lambda r: (r["kernel"], json.dumps(r["constexprs"], sort_keys=True, default=str),
                                       json.dumps(r["signature"], sort_keys=True),
                                       json.dumps(r["options"], sort_keys=True)))


def run(models: list[Shape], kernels: set[str] | None, procs: int, cache_dir: Path | None) -> dict[str, Any]:
    """The audit of the models' (and MoE tables') launches as a report: Triton's version, the date, the shapes, the
    rows (`audit`)."""
    import triton

    t0 = time.perf_counter()
    todo = plan(models, kernels)
    before = os.environ.get("TRITON_CACHE_DIR")
    if cache_dir is not None:
        os.environ["TRITON_CACHE_DIR"] = str(cache_dir)  # read at each compile, inherited by the workers
    try:
        rows = audit(todo, procs)
    finally:
        if cache_dir is not None and before is None:
            del os.environ["TRITON_CACHE_DIR"]
        elif cache_dir is not None:
            os.environ["TRITON_CACHE_DIR"] = before  # type: ignore[assignment]
    return {"triton": triton.__version__, "target": "sm_90 (cuda, 90, warp 32)",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
            "shapes": [s.label for s in models], "seconds": round(time.perf_counter() - t0, 1), "rows": rows}


def _varying(rows: list[dict[str, Any]], field: str) -> list[str]:
    """The names under `field` whose values differ between `rows` (one kernel's)."""
    names = sorted({n for r in rows for n in r[field]})
    return [n for n in names if len({json.dumps(r[field].get(n), default=str) for r in rows}) > 1]


def short_text(short: list[dict[str, Any]]) -> str:
    """The short sites as "load|store file:line[ <- caller] widths < ideal" ("-" for none)."""
    return "; ".join(f"{x.get('op', 'load')} {x['site']} {widths_text(x['bits'])} < {x['ideal']}b"
                     for x in short) or "-"


def _cells(r: dict[str, Any]) -> list[str]:
    if "error" in r:
        return [r["error"]] + [""] * 9
    return [widths_text(r["ldg"]), widths_text(r["stg"]), widths_text(r["cp_async"]) + (f", TMA x{r['tma']}"
            if r["tma"] else ""), short_text(r.get("short", [])), r["mma"], str(r["smem"]), str(r["regs"]),
            str(r["spill_bytes"]), f"{r['programs_per_sm']} ({r['limiter']})", pdl_text(r.get("pdl", {}))]


def _launch_text(r: dict[str, Any], consts: list[str], sig: list[str], aligned: set[str]) -> str:
    parts = [f"{n}={r['constexprs'][n]}" for n in consts if n in r["constexprs"]]
    parts += [f"{n}:{r['signature'].get(n)}" for n in sig]
    parts += [f"{n}%16=0" for n in sorted(aligned & set(r.get("aligned", [])))]
    parts += [f"w{r['options'].get('num_warps')} s{r['options'].get('num_stages')}"]
    return " ".join(str(p).replace("True", "1").replace("False", "0") for p in parts)


def table(report: dict[str, Any], before: dict[str, dict[str, Any]] | None = None) -> str:
    """One markdown row per kernel and launch: the launch's constexprs and argument types that differ between that
    kernel's rows, its warps and stages, the summary, and the steps that use it; with `before` (rows by key) a cell
    that changed reads "before -> after"."""
    head = ["kernel", "launch", "LDG", "STG", "cp.async", "short", "mma", "smem B", "regs", "spill B",
            "programs/SM", "PDL", "flags", "used by"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = report["rows"]
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in rows if r["kernel"] == kernel]
        consts, sig = _varying(mine, "constexprs"), _varying(mine, "signature")
        sets = [set(r.get("aligned", [])) for r in mine]
        aligned = set.union(*sets) - set.intersection(*sets)  # the multiples of 16 that tell the rows apart
        for r in mine:
            cells = _cells(r)
            old = (before or {}).get(r["key"])
            if old is not None:
                cells = [c if c == o else f"{o} -> {c}" for c, o in zip(cells, _cells(old), strict=True)]
            used = r["used_by"]
            used_s = "; ".join(used[:2]) + (f"; +{len(used) - 2} more" if len(used) > 2 else "")
            flags = ", ".join(r.get("flags", [])) or "-"
            if old is not None and old.get("flags", []) != r.get("flags", []):
                flags = f"{', '.join(old.get('flags', [])) or '-'} -> {flags}"
            lines.append("| " + " | ".join([kernel, _launch_text(r, consts, sig, aligned), *cells, flags, used_s])
                         + " |")
    return "\n".join(lines)


def markdown(report: dict[str, Any], command: str, before: dict[str, Any] | None = None,
             findings: bool = False) -> str:
    rows = report["rows"]
    flagged = sorted({r["kernel"] for r in rows if r.get("flags")})
    out = [f"# Triton kernels compiled for sm_90: Triton {report['triton']} ({report['date']})", "",
           f"Command: `{command}` ({report['seconds']} s). Shapes: {', '.join(report['shapes'])}, and every bucket "
           "of the packaged MoE tables. Counts are static SASS instructions of the whole kernel (a loop's body "
           "once), by width in bits: LDG / STG global loads / stores, cp.async (LDGSTS; TMA: bulk tensor copies); "
           "short: the source lines whose loads or stores (PTX, by width) are narrower than what a thread of their "
           "layout could move at once if the addresses were known contiguous and aligned (bench/sm90_compile.py, "
           "`short_accesses`; flag short); mma: wgmma (HGMMA / QGMMA) or mma.sync (HMMA); programs/SM: H100/H200 "
           "limits (limiter); PDL: programmatic dependent launch (rapidserve/ops/pdl.py; `pdl_text`: where the "
           "griddepcontrol wait and launch_dependents sit among the global accesses; flag pdl-order: an access "
           "or launch_dependents before the wait). The launch column lists what differs between one kernel's rows.", "",
           f"- {len(rows)} launches of {len({r['kernel'] for r in rows})} kernels; "
           f"{sum('error' in r for r in rows)} failed to compile; with short accesses: {', '.join(flagged) or 'none'}"]
    if before is not None:
        out.append(f"- before: Triton {before['triton']} ({before['date']}, `{before.get('command', '')}`); "
                   "changed cells read before -> after")
    if findings:
        out.append(f"- what the table says, kernel by kernel (the short sites, and whether a hint applies): "
                   f"[{FINDINGS}]({FINDINGS})")
    return "\n".join([*out, "", table(report, {r["key"]: r for r in before["rows"]} if before else None)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for kernel_compile_audit.json and README.md")
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help="comma-separated preset:tp:dtype:block_size, or ci / full (parse_shapes)")
    p.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    p.add_argument("--before", type=Path, help="an earlier run's kernel_compile_audit.json to compare with")
    p.add_argument("--jobs", type=int, default=1, help="compile processes")
    p.add_argument("--cache-dir", type=Path, help="Triton's cache for the compiles (default: Triton's own)")
    a = p.parse_args(argv)
    kernels = set(a.kernels.split(",")) if a.kernels else None
    before = load_unique(a.before) if a.before else None  # ValueError naming the file: a key written twice
    report = run(parse_shapes(a.shapes), kernels, a.jobs, a.cache_dir)
    args = argv if argv is not None else sys.argv[1:]
    args = [x for i, x in enumerate(args) if x != "--cache-dir" and (i == 0 or args[i - 1] != "--cache-dir")]
    command = "python -m bench.kernel_compile_audit " + " ".join(args)  # (--cache-dir changes nothing but time)
    report["command"] = command
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "kernel_compile_audit.json").write_text(dump_report(report))
    text = markdown(report, command, before, (a.out / FINDINGS).exists())
    (a.out / "README.md").write_text(text)
    print(text)
    return 1 if any("error" in r for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
