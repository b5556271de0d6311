"""Compile every Triton kernel the engine launches for AMD Instinct (gfx942 = MI300X, gfx90a = MI250X) and, as the
control, for Hopper (sm_90), on a CPU machine; report each compiled variant's resources and occupancy.

    python -m bench.amd_compile_check --out bench/results/amd_compile [--matrix ci|full] [--jobs N]

Which launches: bench/amd_launches.py runs the engine's own launch code for every model shape of the matrix
and records each `kernel[grid](*args, **kwargs)` (constexprs, num_warps, num_stages and, on ROCm, whatever
AMD-only options the launch code passes). Each distinct launch is specialised as Triton's JIT would at that
call (its binder, with the target's backend) and compiled with `triton.compile(ASTSource(...),
target=GPUTarget(...))` down to the code object: AMDGCN + hsaco, or PTX + cubin (ptxas ships in the triton
wheel). Resources: VGPRs / AGPRs / SGPRs / spills / scratch from the AMDGCN's kernel metadata, LDS from the
compiled kernel's `metadata.shared` (Triton allocates LDS at launch), REG / LOCAL from `cuobjdump -res-usage`;
occupancy by bench/amd_occupancy.py. A gfx942 variant that spills, needs scratch, or allows fewer than
MIN_WAVES waves per SIMD is flagged. The table is printed last; JSON + markdown go to --out.

Compiled artefacts are cached by Triton under --cache-dir (default: the user cache), so a second run
compiles nothing; compiles run in --jobs processes (default: every core).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.amd_launches import KERNELS, NVIDIA_ONLY, TARGETS, Launch, Target, capture, jit_function, shapes  # noqa: E402
from bench.amd_occupancy import CDNA, cdna_occupancy, hopper_occupancy  # noqa: E402
from bench.json_rows import dump_report  # noqa: E402

MIN_WAVES = 2  # waves per SIMD below which a gfx942 variant is flagged
PRODUCT = "gfx942"  # the target whose every tile configuration the ci matrix checks; the others are controls
# Constexprs that only count heads (index arithmetic and the head masks; the tiles are their own constexprs,
# BLOCK_G, BLOCK_QH, ...): the ci matrix compiles PRODUCT once per variant without them (`Job.tiles`).
HEAD_COUNTS = frozenset({"NUM_HEADS", "NUM_KV_HEADS", "NUM_Q_HEADS", "NUM_K_HEADS", "GROUP"})
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rapidserve" / "triton-compile-check"


@dataclass
class Job:
    """One compile: a kernel specialised for one launch on one target (picklable, for the worker processes)."""

    kernel: str
    target: str
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]
    used_by: list[str] = field(default_factory=list)  # "shape: step" of every launch that compiles to this
    stands_for: int = 0  # the other variants of its ci-matrix cut (`ci_cut`) that are not compiled

    def key(self) -> str:
        return repr((self.kernel, self.target, sorted(self.signature.items()), sorted(self.constexprs.items()),
                     sorted((k, repr(v)) for k, v in self.attrs.items()), sorted(self.options.items())))

    def family(self) -> tuple[str, tuple[str, ...]]:
        """(kernel, the dtypes of its pointers): the compiles a control target of the ci matrix takes one of."""
        return self.kernel, tuple(v for v in self.signature.values() if v.startswith("*"))

    def tiles(self) -> str:
        """The key without the HEAD_COUNTS constexprs: the compiles PRODUCT takes one of in the ci matrix."""
        names = jit_function(self.kernel).arg_names
        kept = {k: v for k, v in self.constexprs.items() if names[k[0]] not in HEAD_COUNTS}
        return repr((self.kernel, self.target, sorted(self.signature.items()), sorted(kept.items()),
                     sorted((k, repr(v)) for k, v in self.attrs.items()), sorted(self.options.items())))

    def named_constexprs(self) -> dict[str, Any]:
        names = jit_function(self.kernel).arg_names
        return {names[path[0]]: v for path, v in sorted(self.constexprs.items())}

    def named_attrs(self) -> dict[str, list[list[Any]]]:
        """The JIT's specialisation of each argument that has one (`tt.divisibility`, AMD's `tt.pointer_range`):
        what tells apart two variants whose constexprs, dtypes and options are the same."""
        names = jit_function(self.kernel).arg_names
        return {names[path[0]]: [list(a) for a in v] for path, v in sorted(self.attrs.items()) if v}

    def launch_options(self) -> dict[str, Any]:
        """The launch options that differ between variants (num_warps, num_stages, AMD's own)."""
        keep = ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim", "kpack")
        return {k: self.options[k] for k in keep if k in self.options and (k != "kpack" or self.options[k] != 1)
                and (k not in ("waves_per_eu", "matrix_instr_nonkdim") or self.options[k])}


def make_job(launch: Launch, target: Target, binders: dict[tuple[str, str], Any]) -> Job:
    """Specialise `launch` as the JIT would on `target`: its binder gives the signature (dtypes, `tt.divisibility`
    of pointers and integers, AMD's `tt.pointer_range` of buffers under 2 GiB), constexprs and options.
    `binders`: a cache of (backend, binder) per (kernel, target), filled here."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = jit_function(launch.kernel)
    if (launch.kernel, target.name) not in binders:
        be = make_backend(GPUTarget(target.backend, target.arch, target.warp_size))
        binders[launch.kernel, target.name] = be, create_function_from_signature(fn.signature, fn.params, be)
    backend, binder = binders[launch.kernel, target.name]
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # Triton 3.9's; 3.6 (the GPU machines') has none
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    bound, specialization, opts = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, opts)
    return Job(launch.kernel, target.name, signature, constexprs, attrs, dict(options.__dict__))


def compile_job(job: Job) -> dict[str, Any]:
    """Compile one job (in a worker process); its resources, or {"error": ...}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = TARGETS[job.target]
    t0 = time.perf_counter()
    try:
        src = ASTSource(jit_function(job.kernel), job.signature, job.constexprs, job.attrs)
        gpu = GPUTarget(target.backend, target.arch, target.warp_size)
        with triton.knobs.compilation.scope():  # the AMDGCN text is read below: keep it even where the
            triton.knobs.compilation.store_binary_only = False  # environment asks Triton for binaries only
            kernel = triton.compile(src, target=gpu, options=job.options)
            if target.hip and "amdgcn" not in kernel.asm:  # a hit on an entry stored binary-only (an older run
                triton.knobs.compilation.always_compile = True  # under TRITON_STORE_BINARY_ONLY, a packed seed)
                kernel = triton.compile(src, target=gpu, options=job.options)
    except Exception as e:  # noqa: BLE001 - a failed compile is a result of the check, reported by name
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"}
    out: dict[str, Any] = {"lds": int(kernel.metadata.shared), "num_warps": int(kernel.metadata.num_warps),
                           "compile_s": round(time.perf_counter() - t0, 2)}
    if target.hip:
        out.update(amdgcn_resources(kernel.asm["amdgcn"]))
        out["hsaco_bytes"] = len(kernel.asm["hsaco"])
    else:
        out.update(cubin_resources(kernel.asm["cubin"]))
    return out


def amdgcn_resources(asm: str) -> dict[str, int]:
    """VGPRs, AGPRs, SGPRs, spills, scratch and LLVM's own occupancy (VGPRs and SGPRs only) from the AMDGCN."""
    def num(pattern: str) -> int:
        found = re.search(pattern, asm)
        if found is None:
            raise ValueError(f"no {pattern!r} in the AMDGCN")
        return int(found.group(1))
    return {"vgpr": num(r"; NumVgprs: (\d+)"), "agpr": num(r"; NumAgprs: (\d+)"),
            "sgpr": num(r"; NumSGPRsForWavesPerEU: (\d+)"), "vgpr_spill": num(r"\.vgpr_spill_count:\s+(\d+)"),
            "sgpr_spill": num(r"\.sgpr_spill_count:\s+(\d+)"), "scratch": num(r"; ScratchSize: (\d+)"),
            "llvm_occupancy": num(r"; Occupancy: (\d+)")}


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """REG and LOCAL (spill) bytes of a cubin, from the cuobjdump that ships with triton's NVIDIA backend."""
    import tempfile

    from triton import knobs
    tool = Path(knobs.nvidia.cuobjdump.path)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    if found is None:
        raise ValueError(f"cuobjdump -res-usage printed no REG/LOCAL line: {text!r}")
    return {"reg": int(found.group(1)), "stack": int(found.group(2)), "local": int(found.group(3))}


def assess(job: Job, res: dict[str, Any]) -> dict[str, Any]:
    """Occupancy and flags of one compiled variant."""
    if "error" in res:
        return {"flags": ["compile failed"]}
    if TARGETS[job.target].hip:
        occ = cdna_occupancy(res["vgpr"], res["agpr"], res["sgpr"], res["lds"], res["num_warps"], CDNA[job.target])
        flags = [f for f, bad in (("VGPR spills", res["vgpr_spill"] > 0), ("SGPR spills", res["sgpr_spill"] > 0),
                                  ("scratch", res["scratch"] > 0), ("LDS over 64 KiB", occ.by["lds"] == 0),
                                  (f"< {MIN_WAVES} waves/SIMD", occ.waves < MIN_WAVES)) if bad]
    else:
        occ = hopper_occupancy(res["reg"], res["lds"], res["num_warps"])
        flags = ["spills"] if res["local"] + res["stack"] > 0 else []  # ptxas spills to the stack frame (STACK)
    return {"waves": occ.waves, "limiter": occ.limiter, "waves_by": occ.by, "flags": flags}


def plan(matrix: str, targets: list[str]) -> tuple[list[Job], list[dict[str, str]]]:
    """Every distinct compile of the matrix on the targets, with the launches that use it; and the shapes that
    were skipped on a target (and why). In the ci matrix (`ci_cut`) a control target (not PRODUCT) compiles one
    variant of each `Job.family`, the first captured: nothing is flagged on a control, so its other variants would
    only repeat the family's compile for the target and the occupancy model's agreement with LLVM's. PRODUCT (its
    flags are the check) compiles every tile configuration (`Job.tiles`: every variant but for the head counts,
    which only move index arithmetic and masks: in the full matrix of 1320 compiles and the ci matrix's 401 no
    two PRODUCT variants that differ in head counts alone differ in waves or flags, nor by more than 3 VGPRs), but
    for the model dtypes served less (`secondary_dtype`: fp16 and fp32 models), of which it too compiles one variant
    of each family: their every tile configuration is the full matrix's (369 -> 268 PRODUCT compiles, about 80
    CPU-s of CI's, 2026-11-29)."""
    jobs: dict[str, Job] = {}
    binders: dict[tuple[str, str], Any] = {}
    skipped = []
    for name in targets:
        for shape in shapes(matrix, name):
            cap = capture(shape, TARGETS[name])
            if cap.skipped:
                skipped.append({"shape": shape.label, "target": name, "why": cap.skipped})
            for launch in cap.launches:
                job = make_job(launch, TARGETS[name], binders)
                job = jobs.setdefault(job.key(), job)
                use = f"{shape.label}: {launch.step}"
                if use not in job.used_by:
                    job.used_by.append(use)
    return ci_cut(list(jobs.values())) if matrix == "ci" else list(jobs.values()), skipped


def secondary_dtype(job: Job) -> bool:
    """Whether `job` is a compile for an fp16 or fp32 model: an fp16 pointer (fp8 weights or KV beside it
    included), or fp32 pointers and none of bf16 or fp8 (a bf16 or fp8 kernel's fp32 scales, partial sums or
    workspaces do not make it one)."""
    ptrs = [p[1:] for p in job.family()[1]]
    return "fp16" in ptrs or ("fp32" in ptrs and not any(p == "bf16" or p.startswith("fp8") for p in ptrs))


def ci_cut(jobs: list[Job]) -> list[Job]:
    """Of PRODUCT's jobs, the first of each `Job.tiles` (of an fp16 / fp32 model's, `secondary_dtype`: the first of
    each `Job.family`); of each control target's, the first of each `Job.family`; each kept job's `stands_for` the
    others."""
    first: dict[object, Job] = {}
    out = []
    for job in jobs:
        every_tile = job.target == PRODUCT and not secondary_dtype(job)
        key = job.tiles() if every_tile else (job.target, job.family())
        if key in first:
            first[key].stands_for += 1
        else:
            first[key] = job
            out.append(job)
    return out


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the compile workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def compile_all(todo: list[Job], jobs: int, cache_dir: Path) -> list[dict[str, Any]]:
    """compile_job of each, in `jobs` processes, with Triton's cache in `cache_dir` (the environment restored)."""
    before = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)  # read by Triton at each compile, inherited by the workers
    try:
        if jobs == 1:
            return [compile_job(j) for j in todo]
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            return list(pool.map(compile_job, todo))
    finally:
        if before is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = before


def run(matrix: str, targets: list[str], jobs: int, cache_dir: Path) -> dict[str, Any]:
    t0, cpu0, load0 = time.perf_counter(), _cpu_seconds(), os.getloadavg()[0]
    todo, skipped = plan(matrix, targets)
    t_plan = time.perf_counter() - t0
    results = compile_all(todo, jobs, cache_dir)
    rows = []
    for job, res in zip(todo, results, strict=True):
        dtype = next((v[1:] for v in job.signature.values() if v.startswith("*")), "-")
        rows.append({"kernel": job.kernel, "target": job.target, "dtype": dtype, "constexprs": job.named_constexprs(),
                     "options": job.launch_options(), "signature": job.signature, "attrs": job.named_attrs(),
                     **res, **assess(job, res),
                     "used_by": job.used_by, "stands_for": job.stands_for})
    return {"matrix": matrix, "targets": targets, "triton": __import__("triton").__version__,
            "seconds": {"capture": round(t_plan, 1), "total": round(time.perf_counter() - t0, 1),
                        "cpu": round(_cpu_seconds() - cpu0, 1)},
            "machine": {"cores": os.cpu_count(), "load_avg_1min": [round(load0, 1), round(os.getloadavg()[0], 1)]},
            "jobs": jobs, "kernels": sorted(KERNELS), "nvidia_only": sorted(NVIDIA_ONLY),
            "skipped": skipped, "rows": rows, "summary": summary(rows, targets)}


def summary(rows: list[dict[str, Any]], targets: list[str]) -> dict[str, Any]:
    out = {}
    for t in targets:
        mine = [r for r in rows if r["target"] == t]
        out[t] = {"compiled": sum("error" not in r for r in mine), "total": len(mine),
                  "variants": len(mine) + sum(r.get("stands_for", 0) for r in mine),
                  "failed": sum("error" in r for r in mine), "flagged": sum(bool(r["flags"]) for r in mine),
                  "kernels": sorted({r["kernel"] for r in mine})}
    return out


def _short(d: dict[str, Any]) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in d.items())


def table(report: dict[str, Any], target: str) -> str:
    """Markdown table of one target's variants."""
    hip = TARGETS[target].hip
    common = ["kernel", "dtype", "constexprs", "launch"]
    head = (common + ["VGPR", "AGPR", "SGPR", "spill v/s", "scratch", "LDS B", "waves/SIMD", "limit", "LLVM occ."]
            if hip else common + ["REG", "LOCAL B", "smem B", "warps/SMSP", "limit"]) + ["flags", "used by"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted((r for r in report["rows"] if r["target"] == target),
                    key=lambda r: (r["kernel"], r["dtype"], json.dumps(r["constexprs"], sort_keys=True))):
        used = r["used_by"]
        used_s = "; ".join(used[:2]) + (f"; +{len(used) - 2} more" if len(used) > 2 else "")
        flags = ", ".join(r["flags"]) or "-"
        cells = [r["kernel"], r["dtype"], _short(r["constexprs"]), _short(r["options"])]
        if "error" in r:
            cells += [r["error"]] + [""] * (len(head) - len(cells) - 3)
        elif hip:
            cells += [r["vgpr"], r["agpr"], r["sgpr"], f"{r['vgpr_spill']}/{r['sgpr_spill']}", r["scratch"], r["lds"],
                      r["waves"], r["limiter"], r["llvm_occupancy"]]
        else:
            cells += [r["reg"], r["local"], r["lds"], r["waves"], r["limiter"]]
        lines.append("| " + " | ".join(str(c) for c in [*cells, flags, used_s]) + " |")
    return "\n".join(lines)


def markdown(report: dict[str, Any], command: str) -> str:
    s, m = report["summary"], report["machine"]
    out = [f"# Triton kernels compiled for AMD Instinct ({report['matrix']} matrix)", "",
           "Compiled on a CPU machine with triton " + report["triton"] + "; never run on an AMD GPU. Made by `"
           + command + "`; the method is in bench/amd_compile_check.py and docs/amd.md.", ""]
    for t in report["targets"]:
        tg = TARGETS[t]
        what = ("tile configuration (of an fp16 / fp32 model's kernels: a kernel and pointer dtypes)" if t == PRODUCT
                else "kernel and pointer dtypes")
        cut = "" if s[t]["variants"] == s[t]["total"] else f" (one a {what} of {s[t]['variants']})"
        out.append(f"- {t} ({tg.gpu}): {s[t]['compiled']}/{s[t]['total']} variants compiled{cut}, {s[t]['failed']} "
                   f"failed, {s[t]['flagged']} flagged; kernels: {len(s[t]['kernels'])}")
    nv = ", ".join(report["nvidia_only"])
    out += [f"- kernels launchable on ROCm: {len(report['kernels']) - len(report['nvidia_only'])} (+ {nv}, NVIDIA "
            + ("only, compiled for sm_90 alone)" if "sm_90" in report["targets"] else "only: not compiled here)"),
            f"- {report['seconds']['total']} s ({report['seconds']['cpu']} CPU-s) with {report['jobs']} compile "
            f"processes on {m['cores']} cores, 1-minute load average {m['load_avg_1min'][0]} at the start and "
            f"{m['load_avg_1min'][1]} at the end (Triton's cache: {report['cache']})", ""]
    for sk in report["skipped"]:
        out.append(f"- skipped: {sk['shape']} on {sk['target']}: {sk['why']}")
    for t in report["targets"]:
        out += ["", f"## {t} ({TARGETS[t].gpu})", "", table(report, t)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="folder for amd_compile.json and amd_compile.md")
    p.add_argument("--matrix", choices=("ci", "full"), default="ci")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {list(TARGETS)}")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    a = p.parse_args(argv)
    targets = a.targets.split(",")
    for t in targets:
        if t not in TARGETS:
            p.error(f"--targets: {t!r} is not one of {list(TARGETS)}")
    cold = not a.cache_dir.exists() or not any(a.cache_dir.iterdir())
    report = run(a.matrix, targets, max(1, a.jobs), a.cache_dir)
    report["cache"] = "empty at the start" if cold else "already filled"
    args = argv if argv is not None else sys.argv[1:]
    args = [x for i, x in enumerate(args) if x != "--cache-dir" and (i == 0 or args[i - 1] != "--cache-dir")]
    command = "python -m bench.amd_compile_check " + " ".join(args)  # (--cache-dir changes nothing but time)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"amd_compile_{a.matrix}.json").write_text(dump_report(report))
        (a.out / f"amd_compile_{a.matrix}.md").write_text(markdown(report, command))
    for t in reversed(targets):  # gfx942 last
        print(f"\n## {t} ({TARGETS[t].gpu})\n" + table(report, t))
    s = report["summary"]
    print("\n" + "; ".join(f"{t}: {s[t]['compiled']}/{s[t]['total']} compiled, {s[t]['failed']} failed, "
                           f"{s[t]['flagged']} flagged" for t in targets) + f"; {report['seconds']['total']} s")
    return 1 if any(s[t]["failed"] for t in targets) else 0


if __name__ == "__main__":
    sys.exit(main())
