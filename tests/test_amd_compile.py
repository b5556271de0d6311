"""The AMD compile check (bench/amd_compile_check.py): every Triton kernel rapidserve can launch is in its registry,
its capture of the engine's launches reaches each of them with the launch parameters of the target's platform, its
occupancy rule agrees with LLVM's, and the CI matrix compiles for gfx942, gfx90a and sm_90 with nothing failed
and nothing flagged on gfx942. No GPU used: Triton compiles for all three targets on the CPU."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

import bench.amd_compile_check as check  # noqa: E402
from bench.amd_compile_check import compile_job, main, make_job  # noqa: E402
from bench.amd_launches import FP8_ONLY, KERNELS, NVIDIA_ONLY, TARGETS, Capture, Shape, capture, shapes  # noqa: E402
from bench.amd_occupancy import CDNA, cdna_occupancy, hopper_occupancy, sgpr_waves, total_vgprs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _is_jit(dec: ast.expr) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(target, ast.Attribute) and target.attr == "jit" and isinstance(target.value, ast.Name) \
        and target.value.id == "triton"


def _jit_functions() -> Iterator[tuple[str, ast.FunctionDef]]:
    """(module, function) of every @triton.jit function under rapidserve/."""
    for path in sorted((ROOT / "rapidserve").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                yield module, node


def _imported_names() -> dict[tuple[str, str], tuple[str, str]]:
    """(module, name) -> (module, name) it was imported from, of every `from rapidserve... import name` under
    rapidserve/ (a device function the kernels of several modules share, called under its own name)."""
    out = {}
    for path in (ROOT / "rapidserve").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("rapidserve."):
                for alias in node.names:
                    out[module, alias.asname or alias.name] = (node.module, alias.name)
    return out


def _launched() -> set[str]:
    """Names launched as `name[grid](...)` anywhere under rapidserve/."""
    out = set()
    for path in (ROOT / "rapidserve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                    and isinstance(node.func.value, ast.Name):
                out.add(node.func.value.id)
    return out


def test_every_triton_kernel_is_in_the_check() -> None:
    """A @triton.jit function is either a kernel the check captures and compiles (KERNELS, with its module), or a
    device function called from one of them; anything else (a new kernel the check does not know) fails here."""
    jit = {(m, f.name): f for m, f in _jit_functions()}
    assert len(jit) >= 10, "the AST walk found too few @triton.jit functions: is the decorator spelled otherwise?"
    launched = _launched()
    kernels = {(m, n) for (m, n) in jit if n in launched}
    assert kernels == {(module, name) for name, (module, _) in KERNELS.items()}, (
        "launched @triton.jit kernels and bench/amd_launches.py KERNELS differ: add the kernel to KERNELS and make "
        "capture() reach its launch site")
    imported = _imported_names()
    reached: set[tuple[str, str]] = set()
    todo = list(kernels)
    while todo:  # device functions called from the kernels, transitively: of the kernel's module, or imported by name
        module, name = todo.pop()
        for node in ast.walk(jit[module, name]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                callee = (module, node.func.id)
                callee = callee if callee in jit else imported.get(callee, callee)
                if callee in jit and callee not in reached:
                    reached.add(callee)
                    todo.append(callee)
    assert set(jit) - kernels - reached == set(), "@triton.jit functions neither launched nor called by a kernel"


@pytest.fixture(scope="module")
def captured() -> dict[tuple[str, Shape], Capture]:
    """capture() of every CI shape on gfx942 and sm_90, by (target, shape): made once for this module (the
    matrix test below reuses them rather than capturing them again)."""
    return {(t, s): capture(s, TARGETS[t]) for t in ("gfx942", "sm_90") for s in shapes("ci", t)}


@pytest.fixture(scope="module")
def captures(captured: dict[tuple[str, Shape], Capture]) -> dict[str, list[tuple[Shape, list]]]:
    return {t: [(s, c.launches) for (target, s), c in captured.items() if target == t] for t in ("gfx942", "sm_90")}


def test_capture_reaches_every_kernel_on_its_platforms(captures: dict[str, list[tuple[Shape, list]]]) -> None:
    assert {"_fp8_block_kernel", "_quantize_tokens_kernel", "_rms_norm_fp8_kernel", "_silu_and_mul_fp8_kernel"} \
        == FP8_ONLY
    amd = {launch.kernel for _, launches in captures["gfx942"] for launch in launches}
    nv = {launch.kernel for _, launches in captures["sm_90"] for launch in launches}
    assert amd == set(KERNELS) - NVIDIA_ONLY  # the skinny GEMM never on the ROCm path
    assert nv == set(KERNELS)


def test_capture_reaches_the_moe_tail_variants(captures: dict[str, list[tuple[Shape, list]]]) -> None:
    """A tuned table's TAIL_BLOCK_M (`ops.moe.TailBlocks`) compiles kernel variants no other launch reaches: both
    GEMMs with LISTS (at BLOCK_M and at the tail block) and the alignment's scatter writing the lists (FULL_M).
    The interpreter's tests never compile them: the check must, on both platforms."""
    for target in ("gfx942", "sm_90"):
        seen = set()
        for _, launches in captures[target]:
            for launch in launches:
                if launch.kernel in ("_gate_up_kernel", "_down_kernel") and launch.kwargs.get("LISTS"):
                    seen.add((launch.kernel, launch.kwargs["BLOCK_M"]))
                if launch.kernel == "_align_scatter_kernel" and launch.kwargs.get("FULL_M", 0) > 0:
                    seen.add((launch.kernel, launch.kwargs["FULL_M"]))
        assert {(k, m) for k in ("_gate_up_kernel", "_down_kernel") for m in (64, 16)} \
            | {("_align_scatter_kernel", 64)} <= seen, (target, sorted(seen))


def test_capture_uses_each_platforms_launch_parameters(captures: dict[str, list[tuple[Shape, list]]]) -> None:
    """On ROCm the attention launches take the AMD tuning of triton_paged_decode.py and
    triton_paged_prefill.py; on NVIDIA none of AMD's options."""
    amd_only = {"waves_per_eu", "matrix_instr_nonkdim", "kpack"}
    for target in ("gfx942", "sm_90"):
        for shape, launches in captures[target]:
            for launch in launches:
                if target == "sm_90":
                    assert not amd_only & set(launch.kwargs), (shape, launch.kernel)
                    continue
                if launch.kernel == "_decode_split_kernel":
                    assert launch.kwargs["num_stages"] == 1, (shape, launch.step)
                if launch.kernel == "_prefill_kernel":  # fp32 over an fp8 cache stays out of scratch without
                    # waves_per_eu (triton_paged_prefill.py)
                    fp32 = {} if launch.kwargs["KV_FP8"] else {"waves_per_eu": 2}
                    want = fp32 if shape.dtype == "float32" else {"matrix_instr_nonkdim": 16}
                    assert launch.kwargs["num_stages"] == 1 and want.items() <= launch.kwargs.items(), shape


def test_one_kernel_compiles_for_each_target(captures: dict[str, list[tuple[Shape, list]]]) -> None:
    """The compile path end to end on a small kernel: gfx942 AMDGCN + hsaco, and the sm_90 cubin."""
    for target in ("gfx942", "sm_90"):
        launch = next(x for _, ls in captures[target] for x in ls if x.kernel == "_silu_and_mul_kernel")
        res = compile_job(make_job(launch, TARGETS[target], {}))
        assert "error" not in res, res
        if target == "gfx942":
            assert res["hsaco_bytes"] > 0 and res["vgpr"] > 0 and res["vgpr_spill"] == 0 and res["scratch"] == 0
            occ = cdna_occupancy(res["vgpr"], res["agpr"], res["sgpr"], res["lds"], res["num_warps"], CDNA[target])
            assert occ.waves == res["llvm_occupancy"] == 8
        else:
            assert res["reg"] > 0 and res["local"] == 0


def test_a_binary_only_cache_hit_is_compiled_again(captures: dict[str, list[tuple[Shape, list]]], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry stored without its AMDGCN text (TRITON_STORE_BINARY_ONLY, or a cache packed binary-only by
    bench/triton_cache.py) is a hit that cannot be read: the job compiles it again instead of raising KeyError."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench.amd_compile_check import jit_function

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    launch = next(x for _, ls in captures["gfx942"] for x in ls if x.kernel == "_silu_and_mul_kernel")
    job = make_job(launch, TARGETS["gfx942"], {})
    t = TARGETS["gfx942"]
    with triton.knobs.compilation.scope():  # the entry as a binary-only store writes it: json and hsaco
        triton.knobs.compilation.store_binary_only = True
        triton.compile(ASTSource(jit_function(job.kernel), job.signature, job.constexprs, job.attrs),
                       target=GPUTarget(t.backend, t.arch, t.warp_size), options=job.options)
    assert list(tmp_path.rglob("*.hsaco")) and not list(tmp_path.rglob("*.amdgcn"))
    res = compile_job(job)
    assert "error" not in res and res["vgpr"] > 0, res
    assert triton.knobs.compilation.always_compile is False  # the knob was scoped to the job


@pytest.mark.parametrize("vgpr, agpr, sgpr, lds, warps, waves, limiter", [
    (154, 0, 106, 0, 4, 3, "vgpr"),  # 160 after the granule: 512 // 160
    (157, 0, 97, 32768, 4, 2, "lds"),  # two 4-wave workgroups a CU
    (256, 0, 50, 0, 8, 2, "vgpr"),
    (128, 0, 50, 0, 4, 4, "vgpr"),
    (64, 0, 82, 0, 4, 7, "sgpr"),  # 82 + 16 for the trap handler -> 112: 800 // 112 (LLVM's figure, _route_kernel)
    (64, 0, 101, 0, 4, 6, "sgpr"),  # 117 -> 128
    (101, 28, 50, 0, 4, 3, "vgpr"),  # AGPRs after the VGPRs rounded to 4: 104 + 28 = 132 -> 136
    (7, 0, 10, 0, 1, 8, "-"),
    (32, 0, 30, 16384, 1, 1, "lds"),  # four 1-wave workgroups a CU: one wave a SIMD
    (32, 0, 30, 65536 + 512, 4, 0, "lds"),  # more LDS than a CU has: cannot launch
])
def test_cdna_occupancy(vgpr: int, agpr: int, sgpr: int, lds: int, warps: int, waves: int, limiter: str) -> None:
    occ = cdna_occupancy(vgpr, agpr, sgpr, lds, warps, CDNA["gfx942"])
    assert (occ.waves, occ.limiter) == (waves, limiter)


def test_occupancy_pieces() -> None:
    assert total_vgprs(101, 0) == 101 and total_vgprs(101, 3) == 107
    assert [sgpr_waves(s, CDNA["gfx942"]) for s in (40, 80, 81, 96, 97, 102)] == [8, 8, 7, 7, 6, 6]
    assert hopper_occupancy(255, 0, 4).waves == 2  # 8192 registers a warp: two 4-warp blocks an SM
    assert hopper_occupancy(32, 0, 4).waves == 16
    smem = hopper_occupancy(32, 100 * 1024, 4)  # two blocks of 100 KiB (+1 KiB reserved) an SM
    assert (smem.waves, smem.limiter) == (2, "smem")


def test_ci_cut_keeps_every_tile_configuration_and_one_variant_of_each_control_family() -> None:
    """The ci matrix's cut: of gfx942's jobs, the first of each variant but for the head counts (two GQA groups of
    one tile configuration: one compile); of a control's, the first of each (kernel, pointer dtypes); each counts
    the others it stands for."""
    names = check.jit_function("_decode_split_kernel").arg_names
    at = {n: (names.index(n),) for n in ("NUM_KV_HEADS", "GROUP", "BLOCK_N")}

    def job(target: str, dtypes: tuple[str, ...], kv_heads: int, group: int, block_n: int) -> check.Job:
        sig = {f"p{i}": f"*{d}" for i, d in enumerate(dtypes)} | {"n": "i32"}
        return check.Job("_decode_split_kernel", target, sig,
                         {at["NUM_KV_HEADS"]: kv_heads, at["GROUP"]: group, at["BLOCK_N"]: block_n}, {}, {})

    jobs = [job(t, d, h, g, n) for t in ("gfx942", "sm_90") for d in (("bf16",), ("bf16", "fp8e4nv"))
            for n in (32, 64) for h, g in ((8, 4), (1, 8), (4, 7))]
    kept = check.ci_cut(jobs)
    product = [(j.family()[1], j.constexprs[at["BLOCK_N"]], j.stands_for) for j in kept if j.target == "gfx942"]
    assert product == [(d, n, 2) for d in (("*bf16",), ("*bf16", "*fp8e4nv")) for n in (32, 64)]
    assert all(j.constexprs[at["GROUP"]] == 4 for j in kept)  # the first of each, as captured
    control = [(j.family()[1], j.constexprs[at["BLOCK_N"]], j.stands_for) for j in kept if j.target == "sm_90"]
    assert control == [(d, 32, 5) for d in (("*bf16",), ("*bf16", "*fp8e4nv"))]


@pytest.mark.slow
def test_ci_matrix_compiles_for_amd_and_the_control(tmp_path: Path, captured: dict[tuple[str, Shape], Capture],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The check as CI runs it (Triton's cache in the user cache: a second run compiles nothing). capture() is a
    function of its shape and target alone: the module's captures of gfx942 and sm_90 stand in for its calls
    there (each one's launches only read), gfx90a's are made here."""
    def capture_once(shape: Shape, target: Any) -> Capture:
        return captured.get((target.name, shape)) or capture(shape, target)

    monkeypatch.setattr(check, "capture", capture_once)
    assert main(["--out", str(tmp_path), "--matrix", "ci"]) == 0
    report = json.loads((tmp_path / "amd_compile_ci.json").read_text())
    s = report["summary"]
    for target in ("gfx942", "gfx90a", "sm_90"):
        assert s[target]["failed"] == 0 and s[target]["compiled"] == s[target]["total"], s[target]
        assert s[target]["variants"] > 50, s[target]  # distinct compiles captured
    def ptrs(r: dict[str, Any]) -> tuple[str, ...]:
        return tuple(v for v in r["signature"].values() if v.startswith("*"))

    def secondary(r: dict[str, Any]) -> bool:  # an fp16 / fp32 model's compile (check.secondary_dtype)
        p = [v[1:] for v in ptrs(r)]
        return "fp16" in p or ("fp32" in p and not any(x == "bf16" or x.startswith("fp8") for x in p))

    product = [r for r in report["rows"] if r["target"] == "gfx942"]
    tiles = [(r["kernel"], json.dumps(r["signature"]), json.dumps(r["attrs"]), json.dumps(r["options"], sort_keys=True),
              json.dumps({k: v for k, v in r["constexprs"].items() if k not in check.HEAD_COUNTS}, sort_keys=True))
             for r in product]  # the product target: every tile configuration of a bf16 / fp8 model's kernels
    assert len(tiles) == len(set(tiles)) == s["gfx942"]["total"] < s["gfx942"]["variants"], s["gfx942"]
    second = [(r["kernel"], ptrs(r)) for r in product if secondary(r)]  # fp16 / fp32: one of each family
    assert second and len(second) == len(set(second)), second
    for target in ("gfx90a", "sm_90"):  # the controls: one variant of each (kernel, pointer dtypes) family
        families = [(r["kernel"], tuple(v for v in r["signature"].values() if v.startswith("*")))
                    for r in report["rows"] if r["target"] == target]
        assert len(families) == len(set(families)) == s[target]["total"] < s[target]["variants"], s[target]
    assert set(s["gfx942"]["kernels"]) == set(KERNELS) - NVIDIA_ONLY
    assert set(s["gfx90a"]["kernels"]) == set(KERNELS) - NVIDIA_ONLY - FP8_ONLY  # MI250X: no fp8, the reference
    assert set(s["sm_90"]["kernels"]) == set(KERNELS)
    flagged = [(r["kernel"], r["dtype"], r["constexprs"], r["flags"]) for r in report["rows"]
               if r["target"] == "gfx942" and r["flags"]]
    assert flagged == [], flagged
    for r in report["rows"]:
        if r["target"] in CDNA:  # ours, without LDS (which LLVM does not see), is LLVM's own occupancy
            assert min(r["waves_by"]["vgpr"], r["waves_by"]["sgpr"]) == r["llvm_occupancy"], r
    assert (tmp_path / "amd_compile_ci.md").read_text().count("| _decode_split_kernel |") >= 3 * 4
