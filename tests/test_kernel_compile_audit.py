"""bench/kernel_compile_audit.py and bench/sm90_compile.py: the SASS readings as pure functions (opcode widths, a
listing's loads, stores, copies and tensor-core family), the audit's shapes and its before/after table; and, where
the GPU machines' Triton 3.6 is installed in a side directory (RAPIDSERVE_TRITON36=DIR, `pip install --target DIR`
of the triton 3.6.0 wheel), the audit end to end on the KV-cache write kernel under that Triton: 16-byte loads and
stores, nothing narrow, no spills (this machine's Triton infers facts 3.6 lost: bench/results/kernel_compile_audit/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import json_rows
from bench import kernel_compile_audit as kca
from bench.amd_launches import Shape
from bench.sm90_compile import (
    by_width,
    global_access_sites,
    memory_ops,
    parse_res_usage,
    pdl_sites,
    pdl_text,
    ptx_access_sites,
    short_accesses,
    width,
    widths_text,
)

ROOT = Path(__file__).resolve().parent.parent
TRITON36_ENV = "RAPIDSERVE_TRITON36"


@pytest.mark.parametrize(("op", "bits"), [
    ("LDG.E.U16", 16), ("LDG.E.S8", 8), ("LDG.E", 32), ("LDG.E.64", 64), ("LDG.E.128.CONSTANT", 128),
    ("LDG.E.EL.U8", 8), ("STG.E.U16", 16), ("LDGSTS.E.BYPASS.LTC128B.128", 128), ("LDGSTS.E.LTC128B.64", 64),
    ("LDGSTS.E.LTC128B", 32),
])
def test_opcode_width(op: str, bits: int) -> None:
    assert width(op) == bits


def test_reads_a_listing() -> None:
    sass = """
        /*0070*/                   LDG.E.U16 R2, desc[UR4][R2.64] ;
        /*0080*/              @!P0 LDG.E.U16 R4, desc[UR4][R4.64] ;
        /*0090*/                   LDG.E.128 R8, desc[UR4][R6.64] ;
        /*00a0*/               @P1 LDGSTS.E.BYPASS.LTC128B.128 [R11], desc[UR4][R12.64] ;
        /*00b0*/                   UTMALDG.2D [UR8], [UR10] ;
        /*00c0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*00d0*/                   HMMA.16816.F32.BF16 R40, R4, R8, R40 ;
        /*00e0*/                   STG.E.64 desc[UR4][R2.64], R20 ;
        /*00f0*/                   EXIT ;
    """
    got = memory_ops(sass)
    assert got["ldg"] == {16: 2, 128: 1} and got["stg"] == {64: 1} and got["cp_async"] == {128: 1}
    assert got["tma"] == 1 and got["mma"] == "mma.sync+wgmma" and got["instructions"] == 9
    assert memory_ops("/*0000*/ LDG.E R1, desc[UR4][R2.64] ;")["mma"] == "-"
    assert by_width(["LDG.E", "LDG.E", "LDG.E.64"]) == {32: 2, 64: 1}
    assert widths_text({16: 256, 128: 4}) == "16b x256, 128b x4" and widths_text({"128": 1}) == "128b x1"
    assert widths_text({}) == "-"


GEMM_SASS = """
        /*0010*/                   S2R R33, SR_CTAID.X ;
        /*0020*/                   UBLKPF.L2 [UR8], UR4 ;
        /*0030*/                   ACQBULK ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R5], desc[UR10][R48.64], P0 ;
        /*0050*/                   HMMA.16816.F32.BF16 R40, R4, R8, R40 ;
        /*0060*/                   LDGSTS.E.BYPASS.128 [R5+0x800], desc[UR10][R46.64], P0 ;
        /*0070*/                   PREEXIT ;
        /*0080*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0090*/                   STG.E.128 desc[UR4][R2.64], R20 ;
        /*00a0*/                   EXIT ;
"""


def test_pdl_sites() -> None:
    """Where a kernel launched with PDL waits and lets the next start, from its SASS: a GEMM that prefetches, waits
    before any access, and triggers after its K loop (two of three loads before); a small kernel that waits and
    triggers first; one that reads before its wait and one that triggers before it (rules 1 and 2 of
    rapidserve/ops/pdl.py broken: the audit flags both); a kernel without PDL."""
    gemm = pdl_sites(GEMM_SASS)
    assert gemm == {"wait": 1, "dependents": 1, "prefetch": 1, "before_wait": 0, "dependents_before_wait": 0,
                    "loads": 3, "loads_before_dependents": 2}
    assert pdl_text(gemm) == "wait first; dependents after 2/3 loads; L2 prefetch x1"
    small = (GEMM_SASS.replace("PREEXIT", "NOP").replace("ACQBULK", "PREEXIT").replace("S2R R33, SR_CTAID.X", "ACQBULK")
             .replace("UBLKPF.L2 [UR8], UR4", "NOP"))
    assert pdl_text(pdl_sites(small)) == "wait first; dependents after 0/3 loads"
    early = GEMM_SASS.replace("S2R R33, SR_CTAID.X", "LDG.E R7, desc[UR4][R8.64]")
    assert pdl_sites(early)["before_wait"] == 1 and pdl_text(pdl_sites(early)).startswith("wait after 1 accesses")
    eager = GEMM_SASS.replace("PREEXIT", "NOP").replace("S2R R33, SR_CTAID.X", "PREEXIT")  # dependents before the wait
    assert pdl_sites(eager)["dependents_before_wait"] == 1 and "dependents before the wait" in pdl_text(
        pdl_sites(eager))
    assert gemm["dependents_before_wait"] == 0 == pdl_sites(small)["dependents_before_wait"]
    plain = GEMM_SASS.replace("ACQBULK", "NOP").replace("PREEXIT", "NOP")
    assert pdl_sites(plain)["wait"] == 0 and pdl_text(pdl_sites(plain)) == "-"
    assert pdl_text({}) == "-"  # a row of an audit from before the column


TTGIR = """
#blocked = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [2, 1], order = [1, 0]}>
#blocked1 = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [4, 8], warpsPerCTA = [2, 1], order = [1, 0]}>
#loc5 = loc("/src/rapidserve/attention/triton_paged.py":220:20)
#loc6 = loc("/src/rapidserve/ops/triton_ops.py":160:21)
#loc7 = loc("/src/rapidserve/ops/triton_ops.py":283:74)
#loc8 = loc("/src/rapidserve/ops/triton_ops.py":40:9)
#loc9 = loc("/src/rapidserve/ops/triton_ops.py":41:5)
#loc20 = loc("k"(#loc5))
#loc21 = loc(callsite(#loc6 at #loc7))
    %k = tt.load %p, %m, %o : tensor<64x128x!tt.ptr<bf16>, #blocked> loc(#loc20)
    %x = tt.load %q, %m2 : tensor<1x64x!tt.ptr<bf16>, #blocked1> loc(#loc21)
    %s = tt.load %r : !tt.ptr<f32> loc(#loc8)
    tt.store %d, %v, %m3 : tensor<4x128x!tt.ptr<f8E4M3FN>, #blocked1> loc(#loc9)
"""
PTX = """
\t.loc\t1 220 20                        // triton_paged.py:220:20
\t@%p1 ld.global.b16 { %rs1 }, [ %rd1 + 0 ];
\t@%p1 ld.global.b16 { %rs2 }, [ %rd2 + 0 ];
\t.loc\t2 160 21                        // triton_ops.py:160:21 @[ triton_ops.py:283:74 ]
\t@%p2 ld.global.b16 { %rs3 }, [ %rd3 + 0 ];
\t.loc\t2 40 9                          // triton_ops.py:40:9
\tld.global.b32 { %r1 }, [ %rd4 + 0 ];
\t.loc\t1 220 20                        // triton_paged.py:220:20
\tcp.async.cg.shared.global [ %r2 + 0 ], [ %rd5 + 0 ], 0x10, %r3;
\t.loc\t2 41 5                          // triton_ops.py:41:5
\t@%p3 st.global.b32 [ %rd6 + 0 ], { %r4 };
\t@%p3 st.global.v2.b32 [ %rd7 + 0 ], { %r5, %r6 };
"""


@pytest.mark.parametrize(("line", "want"), [
    # the MoE down kernel at Qwen3-30B-A3B's prefill tiles before its chunked top-k sum (bench/results/moe_prefill.md)
    (" Function _down_kernel:\n  REG:255 STACK:160 SHARED:1024 LOCAL:0 CONSTANT[0]:664 TEXTURE:0 SURFACE:0 SAMPLER:0",
     {"regs": 255, "spill_bytes": 160}),
    ("  REG:138 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:664", {"regs": 138, "spill_bytes": 0}),
    ("  REG:40 STACK:8 SHARED:0 LOCAL:16 CONSTANT[0]:400", {"regs": 40, "spill_bytes": 24}),
])
def test_spill_is_the_stack_frame_and_local(line: str, want: dict[str, int]) -> None:
    """ptxas spills into the stack frame (STACK), LOCAL staying 0: a Triton kernel calls nothing, so the frame is
    spill; reading LOCAL alone had the audit call a 160-byte spill none."""
    assert parse_res_usage(line) == want


def test_spill_reading_needs_the_line() -> None:
    with pytest.raises(ValueError, match="no REG/STACK/LOCAL line"):
        parse_res_usage("Resource usage:\n")


def test_short_accesses_by_source_line() -> None:
    """A [64, 128] bf16 tile over 2 warps holds 128 elements a thread: 16-byte accesses are possible, so its
    one-element loads are short (the decode kernel's fault before 05f93ef); a [1, 64] tile holds one element a thread
    (16 bits is all it can take) and a scalar its own width: neither is short. Inlined sites match by their chain;
    stores are read alike."""
    sites = global_access_sites(TTGIR, 2)
    assert sites["load", ("triton_paged.py:220:20",)] == {"elem_bits": 16, "shape": [64, 128], "ideal": 128}
    assert sites["load", ("triton_ops.py:160:21", "triton_ops.py:283:74")]["ideal"] == 16
    assert sites["load", ("triton_ops.py:40:9",)] == {"elem_bits": 32, "shape": [], "ideal": 32}
    assert sites["store", ("triton_ops.py:41:5",)] == {"elem_bits": 8, "shape": [4, 128], "ideal": 64}
    ptx = ptx_access_sites(PTX)
    assert ptx["load", ("triton_paged.py:220:20",)] == {16: 2, 128: 1}
    assert ptx["load", ("triton_ops.py:160:21", "triton_ops.py:283:74")] == {16: 1}
    assert ptx["store", ("triton_ops.py:41:5",)] == {32: 1, 64: 1}
    assert short_accesses(PTX, TTGIR, 2) == []  # the tile's widest access is a 16-byte copy, the store's 8 bytes
    one_by_one = PTX.replace("cp.async.cg.shared.global [ %r2 + 0 ], [ %rd5 + 0 ], 0x10, %r3;", "")
    one_by_one = one_by_one.replace("st.global.v2.b32 [ %rd7 + 0 ], { %r5, %r6 };", "")
    short = short_accesses(one_by_one, TTGIR, 2)
    assert short == [{"op": "load", "site": "triton_paged.py:220", "bits": {16: 2}, "ideal": 128, "elem_bits": 16,
                      "shape": [64, 128]},
                     {"op": "store", "site": "triton_ops.py:41", "bits": {32: 1}, "ideal": 64, "elem_bits": 8,
                      "shape": [4, 128]}]
    assert kca.short_text(short) == ("load triton_paged.py:220 16b x2 < 128b; "
                                     "store triton_ops.py:41 32b x1 < 64b")


def test_shapes() -> None:
    assert kca.parse_shape("qwen3-8b") == Shape("qwen3-8b", 1, "bfloat16", 16)
    assert kca.parse_shape("mixtral-8x7b:2:float16:32") == Shape("mixtral-8x7b", 2, "float16", 32)
    for bad in ("", "qwen3-8b:two", "a:1:bfloat16:16:x", "a:1:bfloat16:big"):
        with pytest.raises(ValueError, match="preset"):
            kca.parse_shape(bad)
    ci = kca.parse_shapes("ci,qwen3-8b")  # the CI matrix already holds qwen3-8b at tp 1: no duplicate
    assert Shape("qwen3-8b", 1, "bfloat16") in ci and len(ci) == len(set(ci)) > 10


def _row(ldg: dict[int, int], key: str = "k", n: int = 64) -> dict[str, Any]:
    short = [{"op": "load", "site": "a.py:1", "bits": {16: 256}, "ideal": 128}] if 16 in ldg else []
    return {"kernel": "_k", "key": key, "signature": {"x_ptr": "*bf16"}, "constexprs": {"BLOCK_N": n},
            "options": {"num_warps": 4, "num_stages": 3}, "used_by": ["qwen3-8b: decode b1", "b", "c"], "ldg": ldg,
            "stg": {}, "cp_async": {}, "tma": 0, "mma": "-", "smem": 0, "regs": 32, "spill_bytes": 0,
            "programs_per_sm": 16, "limiter": "regs", "short": short,
            "flags": ["short"] if short else []}


def test_table_marks_what_changed() -> None:
    """A row's launch shows what differs between the kernel's rows; with an earlier run, changed cells read
    before -> after and unchanged ones stay plain."""
    after = {"rows": [_row({128: 4}), _row({128: 8}, "k2", 128), {**_row({128: 8}, "k3", 128), "aligned": ["M"]}]}
    text = kca.table(after, {"k": _row({16: 256})})
    first, second, third = text.splitlines()[2:5]
    assert "| _k | BLOCK_N=64 w4 s3 | 16b x256 -> 128b x4 | - | - | load a.py:1 16b x256 < 128b -> - |" in first
    assert "short -> -" in first
    assert "+1 more" in first
    assert "| BLOCK_N=128 w4 s3 |" in second and "->" not in second
    assert "| BLOCK_N=128 M%16=0 w4 s3 |" in third  # a specialisation is what tells these two apart


@pytest.mark.parametrize(("uses", "want"), [
    (["m: decode b1", "m: decode b2", "m: prefill 512", "n: decode b1", "m: decode b2"],
     ["m: decode b1,2", "m: prefill 512", "n: decode b1"]),
    (["m: decode bx", "m: moe table"], ["m: decode bx", "m: moe table"]),  # not a batch: kept as it is
    ([], []),
])
def test_compact_uses(uses: list[str], want: list[str]) -> None:
    assert json_rows.compact_uses(uses) == want


def test_dump_report_is_the_report_one_row_a_line() -> None:
    report = {"triton": "3.6.0", "rows": [{**_row({128: 4}), "used_by": ["m: decode b1", "m: decode b8"]},
                                          _row({128: 8}, "k2", 128)]}
    text = json_rows.dump_report(report)
    back = json.loads(text)
    assert back["triton"] == "3.6.0" and [r["key"] for r in back["rows"]] == ["k", "k2"]
    assert back["rows"][0]["used_by"] == ["m: decode b1,8"]
    assert len(text.splitlines()) == 3 + 2 + 2  # the head's lines, one a row, the closing ones


def _audit_under_triton36(script: str, tmp_path: Path, timeout: int) -> dict[str, Any]:
    """The JSON report `script` prints last, run in a subprocess whose Triton is the 3.6 side directory's (its own
    cache in `tmp_path`)."""
    env = {**os.environ, "PYTHONPATH": f"{_triton36()}{os.pathsep}{ROOT}", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _triton36() -> Path | None:
    d = os.environ.get(TRITON36_ENV)
    if not d or not (Path(d) / "triton" / "__init__.py").exists():
        return None
    return Path(d) if any(Path(d).glob("triton-3.6*.dist-info")) else None


AUDIT_WRITE_KV = """
import json, sys
import torch
from bench import kernel_compile_audit as kca
from rapidserve.ops import triton_kv

meta = torch.device("meta")
def write(dtype):  # one token's keys and values of Qwen3-8B (8 kv heads of 128) into a cache of `dtype`
    kv = torch.empty(1, 8, 128, dtype=torch.bfloat16, device=meta)
    cache = torch.empty(1024, 8, 16, 128, dtype=dtype, device=meta)
    scale = torch.empty(1, dtype=torch.float32, device=meta) if dtype != torch.bfloat16 else None
    triton_kv.write_kv(kv, kv, cache, cache, torch.empty(1, dtype=torch.int64, device=meta), scale, scale)
rows = kca.audit(kca.make_jobs([("write_kv", kca.record(lambda: write(torch.float8_e4m3fn), "fp8 cache"))]))
import triton
print(json.dumps({"triton": triton.__version__, "rows": rows}))
"""


@pytest.mark.skipif(_triton36() is None, reason=f"no Triton 3.6 side directory: set {TRITON36_ENV}=DIR after "
                    "`pip install --no-deps --target DIR triton==3.6.0` (the GPU machines' version; the wheel is in "
                    "/opt/pypi/files here); this machine's own Triton infers facts 3.6 loses")
def test_audit_under_triton36(tmp_path: Path) -> None:
    """The audit under Triton 3.6, in a subprocess, of the KV-cache write kernel as write_kv launches it for one
    token of Qwen3-8B over an fp8 cache (bf16 rows in, fp8 rows out): it compiles for sm_90 with 16-byte loads and
    stores, nothing short, no spill."""
    report = _audit_under_triton36(AUDIT_WRITE_KV, tmp_path, timeout=120)
    assert report["triton"].startswith("3.6")
    (row,) = report["rows"]
    assert row["kernel"] == "_write_kv_kernel" and row["signature"]["kc_ptr"] == "*fp8e4nv", row
    assert row["short"] == [] and row["flags"] == [] and row["spill_bytes"] == 0, row
    assert not {"8", "16"} & set(row["ldg"]) and row["ldg"]["128"] >= 2, row  # k and v (and the slot, the scales)
    assert set(row["stg"]) == {"128"} and row["mma"] == "-", row


AUDIT_PDL = """
import json
import torch
from bench import kernel_compile_audit as kca
from rapidserve.attention import triton_paged_decode
from rapidserve.ops import triton_fp8_fold, triton_fp8_fused, triton_fp8_skinny as fsk, triton_moe, triton_ops
from rapidserve.ops import triton_rope, triton_skinny
from rapidserve.ops.fp8 import SplitSums

meta, bf16, fp8 = torch.device("meta"), torch.bfloat16, torch.float8_e4m3fn
h, inter, heads, kv, d = 4096, 12288, 32, 8, 128  # Qwen3-8B at one decode row
def e(*shape, dtype=bf16):
    return torch.empty(*shape, dtype=dtype, device=meta)
def step():
    x, w = e(1, h), e(h)
    triton_ops.add_rms_norm(x, x, w, 1e-6)
    qkv = e(1, (heads + 2 * kv) * d)
    q, k, v = qkv.split([heads * d, kv * d, kv * d], dim=-1)
    cache = e(4096, kv, 16, d)
    q = triton_rope.rope_write(q.view(1, heads, d), k.view(1, kv, d), v.view(1, kv, d), e(d), e(d), 1e-6, e(1,
        dtype=torch.int64), e(8192, d, dtype=torch.float32), cache, cache, e(1, dtype=torch.int64))
    triton_paged_decode.decode_attention(q, cache, cache, e(1, 128, dtype=torch.int32), e(1, dtype=torch.int32), 0.088)
    # the output quantized for an fp8 o_proj in the reduce kernel
    triton_paged_decode.decode_attention_fp8(q, cache, cache, e(1, 128, dtype=torch.int32), e(1, dtype=torch.int32),
                                             0.088, out_fp8=fp8)
    triton_fp8_fused.add_rms_norm_fp8(x, x, w, 1e-6, fp8)
    f32 = torch.float32
    sums = SplitSums(e(8, 1, h, dtype=f32), e(1, 1, dtype=f32), e(h, dtype=f32), None, bf16)
    triton_fp8_fold.add_rms_norm_fp8_sums(sums, x, w, 1e-6, fp8)  # down_proj's split-K sums folded into the norm
    triton_fp8_fused.silu_and_mul_fp8(e(1, 2 * inter), fp8)
    fsk.skinny_fp8_linear(x, e(h, h, dtype=fp8), e(h, dtype=torch.float32),
                          config=fsk.rule_tiles(1, h, h)._replace(split_k=4))
    triton_skinny.skinny_linear(x, e(2 * inter, h), gated=True)
    triton_moe.fused_moe(e(1, 2048), e(128, 1536, 2048), e(128, 2048, 768), e(1, 8, dtype=torch.float32),
                         e(1, 8, dtype=torch.int32))
launches = kca.record(step, "decode")
first = {}
for launch in launches:
    if launch.kernel != "_align_one_kernel":  # the MoE alignment: after the router's GEMM, launched without PDL
        first.setdefault((launch.kernel, launch.kwargs.get("FP8_OUT"), launch.kwargs.get("ZERO_COUNTS")), launch)
rows = kca.audit(kca.make_jobs([("pdl", list(first.values()))]))
import triton
print(json.dumps({"triton": triton.__version__, "rows": rows}))
"""


@pytest.mark.skipif(_triton36() is None, reason=f"no Triton 3.6 side directory: set {TRITON36_ENV}=DIR (see "
                    "test_audit_under_triton36)")
def test_pdl_placement_under_triton36(tmp_path: Path) -> None:
    """Every kernel of a decode step, launched as the engine launches it for one row of Qwen3-8B (the attention's also
    with its output quantized for an fp8 o_proj, and a Qwen3-30B-A3B MoE layer's experts) with programmatic dependent
    launch on (the sm_90 target), compiled for sm_90 under Triton 3.6 (the GPU machines'): one griddepcontrol.wait
    before any global access and one launch_dependents after it (rapidserve/ops/pdl.py's rules 1 and 2); the small
    kernels let their dependents start before any load, the GEMMs and the attention's split kernel after their main
    loop's loads (rule 3), and the skinny GEMMs prefetch their weights into L2 before the wait."""
    report = _audit_under_triton36(AUDIT_PDL, tmp_path, timeout=900)
    assert report["triton"].startswith("3.6")
    late = {"_fp8_skinny_kernel", "_skinny_kernel", "_decode_split_kernel", "_gate_up_kernel", "_down_kernel"}
    early = {"_rms_norm_kernel", "_rope_write_kernel", "_decode_reduce_kernel", "_rms_norm_fp8_kernel",
             "_silu_and_mul_fp8_kernel", "_quantize_tokens_kernel", "_fp8_split_reduce_kernel",
             "_sums_rms_norm_fp8_kernel"}
    names = [r["kernel"] for r in report["rows"]]
    assert set(names) == late | early, set(names) ^ (late | early)
    assert names.count("_decode_reduce_kernel") == 2 == names.count("_decode_split_kernel")  # with and without fp8
    for row in report["rows"]:
        name, pdl = row["kernel"], row["pdl"]
        assert pdl["wait"] == 1 and pdl["before_wait"] == 0 and pdl["dependents"] == 1, (name, pdl)
        assert pdl["dependents_before_wait"] == 0 and "pdl-order" not in row["flags"], (name, pdl)
        if name in early:
            assert pdl["loads_before_dependents"] == 0 and pdl["prefetch"] == 0, (name, pdl)
        else:  # the main loop's loads first: what follows is the epilogue's (scales, bias, the split sums)
            assert pdl["loads_before_dependents"] >= pdl["loads"] / 2 > 0, (name, pdl)
            assert (pdl["prefetch"] > 0) is (name in {"_fp8_skinny_kernel", "_skinny_kernel"}), (name, pdl)


AUDIT_MOE_PDL = """
import json
import torch
from bench import kernel_compile_audit as kca
from rapidserve.ops import triton_moe
from rapidserve.ops.moe_tiles import GemmTiles, MoeKernelConfig

meta, bf16 = torch.device("meta"), torch.bfloat16
def e(*shape, dtype=bf16):
    return torch.empty(*shape, dtype=dtype, device=meta)
E, N, K, top_k, t = 128, 768, 2048, 8, 512  # Qwen3-30B-A3B's experts at a 512-token prefill
tiles = GemmTiles(128, 64, 8, 4, 3)
jobs = []
for tma, persistent in ((1, 0), (0, 1), (1, 1)):
    both = tiles._replace(tma=tma, persistent=persistent)
    for pdl in (True, False):
        launches = kca.record(lambda both=both, pdl=pdl: triton_moe.fused_moe(
            e(t, K), e(E, 2 * N, K), e(E, K, N), e(t, top_k, dtype=torch.float32), e(t, top_k, dtype=torch.int32),
            config=MoeKernelConfig(64, both, both), pdl=pdl), "prefill")
        jobs.append((f"tma={tma} persistent={persistent} pdl={pdl}",
                     [x for x in launches if x.kernel in ("_gate_up_kernel", "_down_kernel")]))
rows = kca.audit(kca.make_jobs(jobs))
import triton
print(json.dumps({"triton": triton.__version__, "rows": rows}))
"""


@pytest.mark.skipif(_triton36() is None, reason=f"no Triton 3.6 side directory: set {TRITON36_ENV}=DIR (see "
                    "test_audit_under_triton36)")
def test_moe_gemm_variants_pdl_under_triton36(tmp_path: Path) -> None:
    """The MoE GEMMs' prefill variants (ops/triton_moe_gemm.py: TMA, persistent, both) at Qwen3-30B-A3B's experts,
    compiled for sm_90 under Triton 3.6 with programmatic dependent launch on and off: on, one wait before any global
    access (the tile count and the TMA loads included) and launch_dependents only after it (no pdl-order flag); a
    one-tile program triggers once, after its K loop's loads; a persistent one only on its last tile (a runtime
    test: gate|up's flattened, software-pipelined tile loop may hold the instruction twice, and its place in address
    order says nothing of when it runs). (A one-tile program's epilogue loads may outnumber its main loop's: down's
    top-k sum, or any with TMA, so the check is that every cp.async / TMA copy comes before the trigger.) The late
    trigger costs no pipelining: the same cp.async and TMA copies and spill as without PDL."""
    report = _audit_under_triton36(AUDIT_MOE_PDL, tmp_path, timeout=900)
    assert report["triton"].startswith("3.6")
    by: dict[tuple[str, int, int, bool], dict] = {}
    for row in report["rows"]:
        c = row["constexprs"]
        by[(row["kernel"], int(c["TMA"]), int(c["PERSISTENT"]), bool(c["USE_GDC"]))] = row
    assert len(by) == 12 == len(report["rows"]), sorted(by)
    for (name, tma, persistent, on), row in by.items():
        pdl, off = row["pdl"], by[(name, tma, persistent, False)]
        assert "pdl-order" not in row["flags"] and pdl["before_wait"] == 0 == pdl["dependents_before_wait"], (
            name, tma, persistent, on, pdl)
        if not on:
            assert pdl["wait"] == 0 == pdl["dependents"], (name, tma, persistent, pdl)
            continue
        assert pdl["wait"] == 1 and pdl["dependents"] >= 1, (name, tma, persistent, pdl)
        if not persistent:  # every main-loop copy (cp.async, TMA: the epilogue's loads are plain) before it
            copies = sum(row["cp_async"].values()) + row["tma"]
            assert pdl["dependents"] == 1 and pdl["loads_before_dependents"] >= copies > 0, (name, tma, pdl)
        else:  # not at once after the wait (the loop's loads first in address order too)
            assert pdl["loads_before_dependents"] > 0, (name, tma, pdl)
        assert (row["tma"] > 0) is bool(tma), (name, tma, persistent, row["tma"])
        assert (row["cp_async"], row["tma"], row["spill_bytes"]) == (off["cp_async"], off["tma"], off["spill_bytes"]), (
            name, tma, persistent)
