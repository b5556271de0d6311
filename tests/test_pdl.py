"""Programmatic dependent launch (rapidserve/ops/pdl.py) on CPU: when it is on (`use_pdl`), the weight prefetch's
sizes (`triton_skinny.prefetch_bytes`), the switch that turns it off for a whole bundle (`ops.no_pdl`,
`attention.no_pdl`), and which kernels a decode step launches with it, recorded on meta tensors for an sm_90 and a
gfx942 target (bench/amd_launches.py: the engine's own launch code, nothing runs). Where the engine turns it on: the
measured table and the per-step decision (`ops/pdl_table.py`: `pdl_for_step`, the file's checks, the entry
bench/decode_profile.py derives from an A/B and writes), the bundles bound to a step's choice (`ops.with_launch`,
`attention.with_pdl`) and the runner's use of them (decode steps as the table says, everything else off), on a tiny
model with launchers that record what they were given. Where the griddepcontrol
instructions land in the compiled code: tests/test_kernel_compile_audit.py (under Triton 3.6); that graph replays with
PDL give the eager bits without it: tests/test_pdl_gpu.py. The interpreter runs every kernel with PDL off (the CPU has
none), so the kernels' interpreter checks (tests/test_ops.py, test_fp8_*.py, test_attention_decode.py, ...) are the
PDL-off results."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidserve.ops.pdl import bind_launch, bind_pdl, launch_options, pdl_kwargs, takes_pdl, takes_prefetch, use_pdl
from rapidserve.ops.pdl_table import (
    DEFAULT_DEVICE,
    DEFAULT_ENTRY,
    DEFAULT_PREFETCH_BYTES,
    OFF,
    PDL_TABLE,
    TABLE_PATH,
    LaunchChoice,
    PdlDevice,
    PdlEntry,
    PdlRow,
    PdlTable,
    PdlTableError,
    load_table,
    measured_entry,
    pdl_for_step,
    with_entry,
    write_table,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# the kernels of a decode step, every one launched with PDL on sm_90 (`ops.pdl`)
DECODE_KERNELS = frozenset({
    "_rms_norm_kernel", "_rope_write_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_silu_and_mul_kernel",
    "_skinny_kernel", "_fp8_skinny_kernel", "_fp8_split_reduce_kernel", "_rms_norm_fp8_kernel",
    "_silu_and_mul_fp8_kernel", "_quantize_tokens_kernel", "_gate_up_kernel", "_down_kernel",
    "_sums_rms_norm_fp8_kernel"})
# launched without it: prefill's and the unfused fallbacks' (no kernel of the same step waits on them with PDL), and
# the MoE routing/alignment (after the router's cuBLAS GEMM)
PLAIN_KERNELS = frozenset({"_prefill_kernel", "_write_kv_kernel", "_qk_norm_rope_kernel", "_rope_kernel",
                           "_fp8_block_kernel", "_route_align_kernel", "_route_kernel", "_align_one_kernel",
                           "_align_count_kernel", "_align_scatter_kernel"})


@needs_triton
def test_programmatic_dependent_launch_only_where_the_gpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`use_pdl`: by default on for NVIDIA compute capability 9.0 and later (H100/H200), off for older GPUs, the CPU's
    interpreter and ROCm; True forces it where this Triton has it (the compile check on meta tensors), False turns it
    off. (Moved here from tests/test_moe_launches.py with the helpers, from ops/moe_plan.py.)"""
    from rapidserve.ops.pdl import pdl_available

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    have = pdl_available()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert use_pdl(None, cuda) is have and use_pdl(True, torch.device("meta")) is have
    assert not use_pdl(False, cuda) and not use_pdl(None, cpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not use_pdl(None, cuda)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert not use_pdl(True, cuda)


def test_launch_arguments() -> None:
    assert launch_options(True) == {"USE_GDC": True, "launch_pdl": True}
    assert launch_options(False) == {"USE_GDC": False}  # no launch_pdl option at all: ROCm's backend has none
    assert pdl_kwargs(None) == {} and pdl_kwargs(False) == {"pdl": False}


def test_bind_pdl_keeps_the_name() -> None:
    def launcher(x: int, pdl: bool | None = None) -> tuple[int, bool | None]:
        """doc"""
        return x, pdl

    def plain(x: int) -> int:
        return x

    bound = bind_pdl(launcher, False)
    assert bound(3) == (3, False) and bound.__name__ == "launcher" and bound.__doc__ == "doc"
    assert takes_pdl(launcher) and not takes_pdl(plain) and bind_pdl(plain, False) is plain
    assert not takes_pdl(len)  # a builtin


@needs_triton
@pytest.mark.parametrize(("rows", "span", "budget", "want"), [
    (96 * 64, 4096, 8 << 20, 1360),  # fp8 q|k|v at one row: 96 programs of 64 rows, a third of each row
    (256 * 64, 1024, 8 << 20, 512),  # fp8 o at split 4: 256 programs of 64 rows over 1024-byte slices
    (96 * 64, 4096, 1 << 30, 4096),  # at most the program's span
    (384 * 64 * 8, 4096, 8 << 20, 0),  # under one L2 line a row: none
    (96 * 64, 4096, 0, 0),  # budget 0: off
    (0, 4096, 8 << 20, 0),
])
def test_prefetch_bytes(rows: int, span: int, budget: int, want: int) -> None:
    from rapidserve.ops.triton_skinny import PREFETCH_ALIGN, prefetch_bytes

    w = torch.empty(6144, 4096, dtype=torch.float8_e4m3fn)
    got = prefetch_bytes(w, rows, span, budget)
    assert got == want and got % PREFETCH_ALIGN == 0 and got * rows <= budget


@needs_triton
def test_prefetch_only_where_aligned() -> None:
    """The bulk prefetch needs 16-byte aligned starts: a row stride, a weight start or a slice span that is not a
    multiple of 16 bytes gives none."""
    from rapidserve.ops.triton_skinny import prefetch_bytes

    w = torch.empty(64, 4104, dtype=torch.float8_e4m3fn)
    assert prefetch_bytes(w, 64, 4104, 8 << 20) == 0  # rows 4104 bytes apart
    assert prefetch_bytes(w[:, :4096], 64, 4096, 8 << 20) == 0  # the same rows, a view of 4096
    w = torch.empty(64 * 4096 + 8, dtype=torch.float8_e4m3fn)
    assert prefetch_bytes(w[8:].view(64, 4096), 64, 4096, 8 << 20) == 0  # starts 8 bytes in
    assert prefetch_bytes(w[:-8].view(64, 4096), 64, 4104 // 2, 8 << 20) == 0  # slices of 2052 bytes
    assert prefetch_bytes(w[:-8].view(64, 4096), 64, 4096, 8 << 20) == 4096
    assert prefetch_bytes(torch.empty(64, 4096, dtype=torch.bfloat16), 64, 4096, 8 << 20) == 8192  # two bytes each


@needs_triton
def test_no_pdl_binds_every_launcher() -> None:
    """`ops.no_pdl` binds pdl=False in every function of the Triton bundle that launches a decode kernel (and leaves
    the torch bundle alone); `attention.no_pdl` in the Triton decode attention."""
    from rapidserve.attention import get_attention_backend
    from rapidserve.attention import no_pdl as no_pdl_attention
    from rapidserve.ops import cublas_linears, no_pdl, torch_ops_bundle, triton_ops_bundle

    ops = triton_ops_bundle(skinny=True)
    launchers = ("rms_norm", "add_rms_norm", "silu_and_mul", "rope_write", "linear", "linear_silu_and_mul",
                 "fp8_linear", "fp8_linear_rows", "rms_norm_fp8", "add_rms_norm_fp8", "silu_and_mul_fp8",
                 "moe_experts", "moe_layer")
    assert all(takes_pdl(getattr(ops, f)) for f in launchers)
    off = no_pdl(ops)
    assert off.name == "triton-nopdl"
    for f in launchers:
        fn: Any = getattr(off, f)
        assert fn.keywords == {"pdl": False}, f
    assert off.fp8_linear.__name__ == "gpu_linear"  # the runner logs it
    assert off.apply_rope is ops.apply_rope  # the unfused fallbacks launch without PDL
    cublas: Any = no_pdl(cublas_linears(ops)).linear_silu_and_mul
    assert cublas.keywords == {"pdl": False}
    torch_ops = torch_ops_bundle()
    assert no_pdl(torch_ops) is torch_ops
    ref = get_attention_backend("torch", "cpu")
    assert no_pdl_attention(ref) is ref
    from rapidserve.attention import AttentionBackend, triton_paged_decode, triton_paged_prefill
    from rapidserve.ops import triton_kv

    attn = AttentionBackend("triton", triton_kv.write_kv, triton_paged_prefill.prefill_attention,
                            triton_paged_decode.decode_attention, graph_safe=True)
    got: Any = no_pdl_attention(attn).decode_attention
    assert got.keywords == {"pdl": False} and no_pdl_attention(attn).prefill_attention is attn.prefill_attention


def _decode_launches(target_name: str, pdl_off: bool) -> list[Any]:
    """The launches of a Qwen3-8B decoder layer's decode step at batch 1 and 16 on `target_name` (meta tensors), of
    the kernels meta tensors do not route there (the skinny GEMMs, which ask for a CUDA tensor: gated bf16, and fp8
    with its quantizer and at split K with its reduce), of the fp8 projections' fused producers, and of a
    Qwen3-30B-A3B MoE block, with the bundles' (and the direct calls') PDL switch off when `pdl_off`."""
    from bench.amd_launches import TARGETS, _decode_meta, _layer_forward, recording
    from rapidserve.attention import get_attention_backend
    from rapidserve.attention import no_pdl as no_pdl_attention
    from rapidserve.kv_pool import KVPool
    from rapidserve.loader.preset_table import preset_table
    from rapidserve.models.decoder_layer import DecoderLayer
    from rapidserve.models.moe import MoeBlock
    from rapidserve.moe_config import MoeConfig
    from rapidserve.ops import get_ops, no_pdl, triton_skinny
    from rapidserve.ops import triton_fp8_skinny as fsk
    from rapidserve.ops.fp8 import SplitSums

    target = TARGETS[target_name]
    meta = torch.device("meta")
    cfg = preset_table()["qwen3-8b"]
    h, inter, bf16 = cfg.hidden_size, cfg.intermediate_size, torch.bfloat16
    pdl = False if pdl_off else None
    sink: list[Any] = []
    with recording(target, sink, lambda: ""):
        ops = get_ops(torch.device("cuda"))
        attn = get_attention_backend("triton", torch.device("cuda"))
        if pdl_off:
            ops, attn = no_pdl(ops), no_pdl_attention(attn)
        pool = KVPool(torch.empty(1, 2, 4096, cfg.num_kv_heads, 16, cfg.head_dim, dtype=bf16, device=meta), 16)
        cos_sin = torch.empty(8192, cfg.head_dim, dtype=torch.float32, device=meta)
        layer = DecoderLayer(cfg, bf16, meta)
        for b in (1, 16):
            _layer_forward(layer, cfg, bf16, pool, cos_sin, _decode_meta(b, 128, meta), ops, attn, meta)
        x = torch.empty(1, h, dtype=bf16, device=meta)
        if not target.hip:
            triton_skinny.skinny_linear(x, layer.gate_up_proj, gated=True, pdl=pdl)
            w8 = torch.empty(h, h, dtype=torch.float8_e4m3fn, device=meta)
            sw = torch.empty(h, dtype=torch.float32, device=meta)
            fsk.skinny_fp8_linear(x, w8, sw, config=fsk.rule_tiles(1, h, h), pdl=pdl)
            fsk.skinny_fp8_linear(x, w8, sw, config=fsk.rule_tiles(1, h, h)._replace(split_k=4), pdl=pdl)
        if target.fp8 is not None:
            ops.rms_norm_fp8(x, layer.input_layernorm, 1e-6, target.fp8)
            ops.add_rms_norm_fp8(x, x, layer.input_layernorm, 1e-6, target.fp8)
            ops.silu_and_mul_fp8(torch.empty(1, 2 * inter, dtype=bf16, device=meta), target.fp8)
            if not target.hip:  # a split-K GEMM's sums folded into the next norm (NVIDIA's skinny kernel only)
                sums = SplitSums(torch.empty(8, 1, h, device=meta), torch.empty(1, 1, device=meta),
                                 torch.empty(h, device=meta), None, bf16)
                ops.add_rms_norm_fp8_sums(sums, x, layer.input_layernorm, 1e-6, target.fp8)
        block = MoeBlock(MoeConfig(num_experts=128, top_k=8, intermediate_size=768, renormalize=True), 2048, bf16,
                         meta)
        block(torch.empty(1, 2048, dtype=bf16, device=meta), ops)
    return sink


@needs_triton
def test_decode_kernels_launch_with_pdl_on_sm90() -> None:
    """On sm_90 every kernel of a decode step (dense bf16 and fp8 layers, the skinny GEMMs, split-K and its reduce,
    the MoE experts) launches with PDL (`launch_pdl` and the kernel's USE_GDC) and nothing else does; `no_pdl`
    bundles launch none with it; on gfx942 (ROCm) none is, and no launch carries the option (its backend has none)."""
    on = _decode_launches("sm_90", pdl_off=False)
    kernels = {launch.kernel for launch in on}
    assert kernels >= DECODE_KERNELS, DECODE_KERNELS - kernels
    for launch in on:
        assert launch.kernel in DECODE_KERNELS | PLAIN_KERNELS, launch.kernel
        want = launch.kernel in DECODE_KERNELS
        assert launch.kwargs.get("USE_GDC", False) is want and launch.kwargs.get("launch_pdl", False) is want, \
            launch.kernel
    for target, off in (("sm_90", True), ("gfx942", False)):
        for launch in _decode_launches(target, pdl_off=off):
            assert not launch.kwargs.get("USE_GDC", False) and "launch_pdl" not in launch.kwargs, (target,
                                                                                                   launch.kernel)


# ---- where the engine turns it on: ops/pdl_table.py and the runner ------------------------------------------------

H200 = PdlDevice("NVIDIA H200", True)
MIB8 = 8 << 20


MEASURED = {"NVIDIA H200": PdlEntry(16, MIB8, "t")}  # a table of the committed file's shape, fixed here


@pytest.mark.parametrize(("rows", "device", "table", "want"), [
    (1, H200, MEASURED, LaunchChoice(True, MIB8)),  # the H200's entry: on up to 16 rows
    (16, H200, MEASURED, LaunchChoice(True, MIB8)),
    (17, H200, MEASURED, OFF),
    (64, H200, MEASURED, OFF),
    (1, PdlDevice("NVIDIA H100 80GB HBM3", True), MEASURED, LaunchChoice(True, MIB8)),  # no entry: the H200's
    (17, PdlDevice("NVIDIA H100 80GB HBM3", True), MEASURED, OFF),
    (1, PdlDevice("NVIDIA H200", False), MEASURED, OFF),  # a Triton without PDL
    (1, PdlDevice("NVIDIA A100-SXM4-80GB", False), MEASURED, OFF),  # before sm_90
    (1, PdlDevice("cpu", False), MEASURED, OFF),
    (4, PdlDevice("GPU X", True), {"GPU X": PdlEntry(4, 1024, "t")}, LaunchChoice(True, 1024)),
    (5, PdlDevice("GPU X", True), {"GPU X": PdlEntry(4, 1024, "t")}, OFF),
    (1, PdlDevice("GPU X", True), {"GPU X": PdlEntry(0, 1024, "t")}, OFF),  # never
    (8, PdlDevice("GPU X", True), {"GPU X": PdlEntry(8, 0, "t")}, LaunchChoice(True, 0)),  # PDL without the prefetch
    (9, PdlDevice("GPU Y", True), {"NVIDIA H200": PdlEntry(12, 4096, "t")}, LaunchChoice(True, 4096)),  # H200's
    (2, PdlDevice("GPU Y", True), {}, OFF),  # no table at all: DEFAULT_ENTRY, the H200's figures (1 row)
    (1, PdlDevice("GPU Y", True), {}, LaunchChoice(True, MIB8)),
])
def test_pdl_for_step(rows: int, device: PdlDevice, table: PdlTable, want: LaunchChoice) -> None:
    assert pdl_for_step(rows, device, table) == want


def test_pdl_for_step_takes_a_step() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        pdl_for_step(0, H200, PDL_TABLE)


@needs_triton
def test_the_packaged_table() -> None:
    """The H200's measured entry (on at 1 row, the 8 MiB prefetch it was measured with) is the file's and the
    default's; the default's prefetch is the kernels' own default budget."""
    from rapidserve.ops.triton_skinny import PREFETCH_BYTES

    assert load_table(TABLE_PATH) == PDL_TABLE
    h200 = PDL_TABLE["NVIDIA H200"]
    assert h200[:2] == (1, MIB8) and "bf16" in h200.source and "2026-11-29" in h200.source
    assert DEFAULT_ENTRY[:2] == h200[:2] and DEFAULT_DEVICE == "NVIDIA H200"
    assert DEFAULT_PREFETCH_BYTES == PREFETCH_BYTES


@pytest.mark.parametrize(("rows", "want"), [
    # the H200's run (fp8, Qwen3-8B shape): wins at 1 and 16, loses at 64
    ([(1, 3.215, 3.520, 3.319), (16, 4.774, 4.850, 4.855), (64, 8.865, 8.339, 8.774)], (16, MIB8)),
    ([(64, 8.865, 8.339, 8.774), (1, 3.215, 3.520, 3.319)], (1, MIB8)),  # any order; 16 not measured: off
    ([(1, 3.0, 3.5, 3.2), (16, 4.8, 4.85, 4.9), (32, 5.0, 5.2, 5.3)], (32, MIB8)),  # wins everywhere
    ([(1, 3.0, 3.5, 3.2), (16, 5.0, 4.9, 5.1), (64, 8.0, 9.0, 8.5)], (1, MIB8)),  # a loss at 16 caps it below
    ([(1, 3.6, 3.5, 3.7), (16, 4.0, 4.5, 4.1)], (0, MIB8)),  # no win at the smallest: never
    ([(1, 3.465, 3.5, 3.5)], (0, MIB8)),  # exactly 1% faster: not more than the margin
    ([(1, 3.46, 3.5, 3.5)], (1, MIB8)),
    ([(1, 3.2, 3.5, 3.1), (16, 4.7, 4.9, 4.75)], (16, 0)),  # the prefetch loses at 1 (3.1 beats 3.2 by >1%)
    ([(1, 3.2, 3.5, 3.3), (16, 4.7, 4.9, 4.66), (64, 9.0, 8.0, 8.0)], (16, MIB8)),  # within the margin at 16: kept
    ([(1, 3.2, 3.5, 3.3), (64, 9.0, 8.0, 7.0)], (1, MIB8)),  # a prefetch loss where PDL is off: irrelevant
])
def test_measured_entry(rows: list[tuple[int, float, float, float]], want: tuple[int, int]) -> None:
    entry = measured_entry([PdlRow(*r) for r in rows], MIB8, "a run")
    assert entry == PdlEntry(*want, "a run")


def test_measured_entry_needs_each_batch_once() -> None:
    for rows in ([], [PdlRow(1, 1.0, 2.0, 2.0), PdlRow(1, 1.0, 2.0, 2.0)]):
        with pytest.raises(ValueError, match="each batch once"):
            measured_entry(rows, MIB8, "x")


@pytest.mark.parametrize(("content", "field"), [
    ([], "the file"),
    ({"GPU": []}, "GPU"),
    ({"GPU": {"max_rows": 1, "prefetch_bytes": 0}}, "GPU.source"),
    ({"GPU": {"max_rows": 1, "prefetch_bytes": 0, "source": "", "rows": 2}}, "GPU.rows"),
    ({"GPU": {"max_rows": -1, "prefetch_bytes": 0, "source": ""}}, "GPU.max_rows"),
    ({"GPU": {"max_rows": True, "prefetch_bytes": 0, "source": ""}}, "GPU.max_rows"),
    ({"GPU": {"max_rows": 1, "prefetch_bytes": 1.5, "source": ""}}, "GPU.prefetch_bytes"),
    ({"GPU": {"max_rows": 1, "prefetch_bytes": 0, "source": 3}}, "GPU.source"),
    ({" ": {"max_rows": 1, "prefetch_bytes": 0, "source": ""}}, "' '"),
])
def test_a_bad_table_names_the_field(tmp_path: Path, content: object, field: str) -> None:
    path = tmp_path / "pdl_table.json"
    path.write_text(json.dumps(content))
    with pytest.raises(PdlTableError, match=f"pdl_table.json: {re.escape(field)}: "):
        load_table(path)
    path.write_text("{")
    with pytest.raises(PdlTableError, match="is not JSON"):
        load_table(path)


def test_the_table_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "pdl_table.json"
    assert load_table(path) == {}  # no file: no entries (every GPU takes the default)
    table = with_entry(PDL_TABLE, "GPU X", PdlEntry(8, 0, "a run"))
    assert write_table(path, table) == table == {**PDL_TABLE, "GPU X": PdlEntry(8, 0, "a run")}
    assert with_entry(table, "GPU X", PdlEntry(1, 16, "again"))["GPU X"] == PdlEntry(1, 16, "again")
    with pytest.raises(ValueError, match="device name"):
        with_entry(table, "", PdlEntry(1, 16, "x"))


def test_bench_writes_the_measured_entry(tmp_path: Path) -> None:
    """bench/decode_profile.py: the `fused` rows' A/B gives this GPU's entry, written with the packaged table's other
    entries to <out> and, with --write-pdl-table, the checkout's file (here a copy); the forced choices it A/Bs."""
    from bench.decode_profile import forced_launches, write_pdl_table

    rows: list[dict[str, Any]] = [
        {"batch": b, "variant": v, "pdl_ms": p, "nopdl_ms": n, "noprefetch_ms": f}
        for v in ("fused", "unfused")
        for b, p, n, f in ((1, 3.215, 3.520, 3.319), (16, 4.774, 4.850, 4.855), (32, 6.0, 5.9, 6.0),
                           (64, 8.865, 8.339, 8.774))]
    rows[4]["pdl_ms"] = 1.0  # the unfused variant's rows are not the engine's: ignored
    packaged = {"NVIDIA H200": PdlEntry(16, MIB8, "old"), "GPU Z": PdlEntry(2, 64, "z")}
    notes = write_pdl_table(rows, "NVIDIA H200", MIB8, "this run", tmp_path / "out", tmp_path / "repo.json", packaged)
    for path in (tmp_path / "out" / "pdl_table.json", tmp_path / "repo.json"):
        assert load_table(path) == {"NVIDIA H200": PdlEntry(16, MIB8, "this run"), "GPU Z": PdlEntry(2, 64, "z")}
    assert notes[0] == "batch 1: PDL -8.7% against none, the prefetch -3.1% against none", notes
    assert notes[-1].startswith("PDL table written: ") and "repo.json" in notes[-1]
    assert write_pdl_table(rows[4:], "NVIDIA H200", MIB8, "x", tmp_path / "none", None, packaged) == [
        "no PDL table written: no `fused` variant measured with the PDL A/B"]
    assert not (tmp_path / "none").exists()
    assert forced_launches("GPU X", {"GPU X": PdlEntry(4, 0, "t")}) == {
        "pdl": LaunchChoice(True, MIB8), "nopdl": OFF, "noprefetch": LaunchChoice(True, 0)}  # bytes where none
    assert forced_launches("GPU X", {"GPU X": PdlEntry(4, 4096, "t")})["pdl"] == LaunchChoice(True, 4096)


def test_bind_launch() -> None:
    def gemm(x: int, pdl: bool | None = None, prefetch: int | None = None) -> tuple[int, bool | None, int | None]:
        """doc"""
        return x, pdl, prefetch

    def norm(x: int, pdl: bool | None = None) -> tuple[int, bool | None]:
        return x, pdl

    def plain(x: int) -> int:
        return x

    assert bind_launch(gemm, True, 4096)(1) == (1, True, 4096) and bind_launch(gemm, True, 0)(1) == (1, True, 0)
    assert bind_launch(gemm, False, 4096)(1) == (1, False, 0)  # the prefetch needs PDL
    assert bind_launch(norm, True, 4096)(1) == (1, True) and bind_launch(plain, True, 4096) is plain
    assert bind_launch(gemm, True, 1).__name__ == "gemm" and bind_launch(gemm, True, 1).__doc__ == "doc"
    again = bind_launch(bind_launch(gemm, False, 0), True, 64)  # a bound launcher bound again: the last choice
    assert again(1) == (1, True, 64) and takes_prefetch(again) and not takes_prefetch(norm)


@needs_triton
def test_with_launch_binds_every_launcher() -> None:
    """`ops.with_launch` binds a step's choice in every launcher of the Triton bundle (the GEMMs' prefetch bytes too:
    0 with PDL off), over a bundle already bound; the torch bundle is left alone; `attention.with_pdl` likewise."""
    from rapidserve.attention import (
        AttentionBackend,
        get_attention_backend,
        triton_paged_decode,
        triton_paged_prefill,
        with_pdl,
    )
    from rapidserve.ops import torch_ops_bundle, triton_kv, triton_ops_bundle, with_launch

    ops = triton_ops_bundle(skinny=True)
    gemms = ("linear", "linear_silu_and_mul", "fp8_linear", "fp8_linear_rows", "fp8_linear_sums",
             "fp8_linear_silu_and_mul", "fp8_linear_half")
    for choice in (LaunchChoice(True, MIB8), LaunchChoice(True, 0), OFF):
        for bundle in (ops, with_launch(ops, OFF), with_launch(ops, LaunchChoice(True, 64))):
            bound = with_launch(bundle, choice)
            assert bound.name == "triton"
            for f in dataclasses.fields(bound):
                fn: Any = getattr(bound, f.name)
                if f.name in gemms:
                    assert fn.keywords == {"pdl": choice.pdl, "prefetch": choice.prefetch_bytes}, f.name
                elif callable(fn) and takes_pdl(fn):
                    assert fn.keywords == {"pdl": choice.pdl}, f.name
    assert all(takes_prefetch(getattr(ops, f)) for f in gemms)
    torch_ops = torch_ops_bundle()
    assert with_launch(torch_ops, LaunchChoice(True, MIB8)) is torch_ops
    ref = get_attention_backend("torch", "cpu")
    assert with_pdl(ref, True) is ref
    attn = AttentionBackend("triton", triton_kv.write_kv, triton_paged_prefill.prefill_attention,
                            triton_paged_decode.decode_attention, graph_safe=True)
    on: Any = with_pdl(with_pdl(attn, False), True).decode_attention
    assert on.keywords == {"pdl": True} and with_pdl(attn, True).name == "triton"


def _recording_runner(monkeypatch: pytest.MonkeyPatch, log: list[tuple[str, Any, Any]]) -> Any:
    """A tiny CPU ModelRunner whose norms, linear layers and decode attention take `pdl` (and the linears `prefetch`)
    and log what each call was given: the torch bundle's numbers, a GPU bundle's launch arguments."""
    from rapidserve.attention import get_attention_backend
    from rapidserve.config_builder import build_engine_config
    from rapidserve.ops import torch_ops_bundle
    from rapidserve.runner import ModelRunner, model_runner

    base = torch_ops_bundle()
    attn = get_attention_backend("torch", "cpu")

    def add_rms_norm(x: Any, res: Any, w: Any, eps: float, pdl: bool | None = None) -> Any:
        log.append(("add_rms_norm", pdl, None))
        return base.add_rms_norm(x, res, w, eps)

    def linear(x: Any, w: Any, bias: Any = None, pdl: bool | None = None, prefetch: int | None = None) -> Any:
        log.append(("linear", pdl, prefetch))
        return base.linear(x, w, bias)

    def decode_attention(*args: Any, pdl: bool | None = None, **kw: Any) -> Any:
        log.append(("decode_attention", pdl, None))
        return attn.decode_attention(*args, **kw)

    ops = dataclasses.replace(base, name="recording", add_rms_norm=add_rms_norm, linear=linear)
    monkeypatch.setattr(model_runner, "get_ops", lambda device: ops)
    monkeypatch.setattr(model_runner, "get_attention_backend",
                        lambda *a: dataclasses.replace(attn, decode_attention=decode_attention))
    cfg, source = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=40,
                                      max_model_len=64)
    return ModelRunner(cfg, source, show_progress=False)


def test_the_runner_launches_decode_steps_as_the_table_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill and mixed steps launch with PDL off (never measured with it); an eager decode step with the table's
    choice for its rows (the graphs' buckets take the same path: tests/test_pdl_gpu.py), and the model's own bundles
    are back after it."""
    from rapidserve.runner import DecodeItem, PrefillItem, decode_graphs

    log: list[tuple[str, Any, Any]] = []
    runner = _recording_runner(monkeypatch, log)
    assert runner.pdl_device == PdlDevice("cpu", False)
    own = runner.model.ops, runner.model.attn

    def launched(run: Any) -> set[tuple[str, Any, Any]]:
        log.clear()
        run()
        assert {name for name, _, _ in log} >= {"add_rms_norm", "linear"}, log
        return set(log)

    off = {("add_rms_norm", False, None), ("linear", False, 0)}
    assert launched(lambda: runner.prefill([PrefillItem(list(range(3, 40)), 0, [0, 1, 2])])) == off
    mixed = [PrefillItem([5], 36, [0, 1, 2]), PrefillItem(list(range(3, 20)), 0, [3, 4])]
    assert launched(lambda: runner.prefill(mixed)) == off | {("decode_attention", False, None)}  # its decode rows
    steps = [DecodeItem(7, 8, [5 + i]) for i in range(20)]
    assert launched(lambda: runner.decode(steps[:1])) == off | {("decode_attention", False, None)}  # the CPU: off
    runner.pdl_device = H200  # as on an H200: the packaged table's entry
    on = {("add_rms_norm", True, None), ("linear", True, MIB8), ("decode_attention", True, None)}
    for n, want in ((1, on), (2, OFF), (17, OFF), (20, OFF)):
        assert runner.decode_launch(n) == (want if want == OFF else LaunchChoice(True, MIB8))
        got = launched(lambda n=n: runner.decode(steps[:n]))
        assert got == (on if want is on else off | {("decode_attention", False, None)}), n
        assert (runner.model.ops, runner.model.attn) == own
    monkeypatch.setattr(decode_graphs, "PDL_TABLE", {"NVIDIA H200": PdlEntry(2, 4096, "t")})
    assert launched(lambda: runner.decode(steps[:2])) == {
        ("add_rms_norm", True, None), ("linear", True, 4096), ("decode_attention", True, None)}
    assert launched(lambda: runner.prefill(mixed)) == off | {("decode_attention", False, None)}
    assert runner.decode_launches() == {}  # no graphs on the CPU
