"""bench/decode_attn_compile.py: its readings of compiled code as pure functions (PTX and TTGIR snippets, the occupancy
rule), and the property it exists for: the decode split kernel's K/V tiles load as 16-byte cp.async, staged in
shared memory, with no one-element global loads. On the CPU the table's bf16 entry is compiled for sm_90 with the
installed Triton; with -m gpu, the table's entries and a prefetch variant for the GPU's own target with its Triton
(the GPU machines' Triton 3.6 lost a divisibility that 3.9 infers: rapidserve/attention/triton_paged_decode.py)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from bench import decode_attn_compile as dac
from rapidserve.attention.decode_config import DecodeConfig, decode_config

HAS_NVIDIA = importlib.util.find_spec("triton") is not None \
    and importlib.util.find_spec("triton.backends.nvidia") is not None


@pytest.mark.parametrize(("regs", "smem", "warps", "want"), [
    (92, 38928, 4, (5, "regs,smem")),  # 3072 registers a warp, 39 KiB (+1 reserved) a program
    (255, 22544, 2, (4, "regs")),  # the one-element-load kernel's fp8 tile
    (64, 71680, 4, (3, "smem")),  # two 64-key K/V buffers
    (32, 0, 1, (32, "blocks")),
    (16, 0, 4, (16, "warps")),
])
def test_programs_per_sm(regs: int, smem: int, warps: int, want: tuple[int, str]) -> None:
    assert dac.programs_per_sm(regs, smem, warps) == want


def test_reads_loads_and_buffers() -> None:
    ptx = """
        ld.global.b16 { %rs1 }, [ %rd1 + 0 ];
        @%p3 ld.global.b8 { %rs2 }, [ %rd2 + 0 ];
        ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd3 + 0 ];
        ld.global.b32 { %r5 }, [ %rd4 + 0 ];
        cp.async.cg.shared.global [ %r6 + 0 ], [ %rd5 + 0 ], 0x10, %r7;
        cp.async.ca.shared.global [ %r8 + 0 ], [ %rd6 + 0 ], 0x4, %r9;
    """
    assert len(dac.NARROW.findall(ptx)) == 2 and len(dac.CP16.findall(ptx)) == 1
    ttgir = ("%0 = ttg.local_alloc : () -> !ttg.memdesc<2x64x128xbf16, #shared, #smem, mutable>\n"
             "%1 = ttg.local_alloc : () -> !ttg.memdesc<2x4xi32, #shared1, #smem, mutable>\n"
             "%2 = ttg.local_alloc %x : (tensor<16x64xbf16, #mma>) -> !ttg.memdesc<16x64xbf16, #shared, #smem>\n")
    assert dac.kv_buffers(ttgir, 64) == 2 and dac.kv_buffers(ttgir, 32) == 0


def _assert_streams(row: dict[str, Any], buffers: int | None = None) -> None:
    """No one-element global load, 16-byte cp.async, no spills; `buffers` K/V buffers (None: at least one)."""
    assert row["narrow_loads"] == 0 and row["cp_async_16"] > 0 and row["spill_bytes"] == 0, row
    if buffers is None:
        assert row["buffers"] >= 1, row
    else:
        assert row["buffers"] == buffers, row


@pytest.mark.skipif(not HAS_NVIDIA, reason="triton's NVIDIA backend is not installed")
def test_table_entry_streams_its_tiles_on_sm90() -> None:
    """The bf16 entry (5 stages, no prefetch) compiles to 16-byte cp.async into two K/V buffers, nothing narrow."""
    cfg = decode_config(False, torch.bfloat16, False, 128)
    assert (cfg.num_stages, cfg.prefetch) == (5, False)
    _assert_streams(dac.analyse(dac.compile_split(cfg, "bf16"), cfg), buffers=2)


@pytest.mark.skipif(not HAS_NVIDIA, reason="triton's NVIDIA backend is not installed")
def test_reads_its_irs_past_a_binary_only_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache holding the kernel binary-only (as the GPU suite's packed seed does) is a hit without PTX or TTGIR;
    the compile helper compiles afresh anyway, so the analysis still reads them (the GPU suite failed on this)."""
    import triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    cfg = decode_config(False, torch.bfloat16, False, 128)
    with triton.knobs.compilation.scope():
        triton.knobs.compilation.store_binary_only = True
        dac.compile_split(cfg, "bf16")  # seeds the cache (binary-only under a helper that does not scope its knobs)
    for f in tmp_path.rglob("*.ptx"):
        f.unlink()  # and as bench/triton_cache.py's pack leaves it under one that does: no IRs
    kernel = dac.compile_split(cfg, "bf16")
    assert "ptx" in kernel.asm and "ttgir" in kernel.asm
    _assert_streams(dac.analyse(kernel, cfg), buffers=2)


@pytest.mark.gpu
def test_entries_stream_their_tiles_with_this_gpus_triton() -> None:
    """The same with the GPU machine's Triton, for its own target: the bf16 and fp8 entries and prefetch variants
    (with it, s stages keep s - 1 buffers)."""
    if not torch.cuda.is_available() or torch.version.hip:
        pytest.skip("needs an NVIDIA GPU")
    from triton.runtime import driver

    target = driver.active.get_current_target()
    where = (target.backend, target.arch, target.warp_size)
    for kv, cfg, buffers in (("bf16", decode_config(False, torch.bfloat16, False, 128), None),
                             ("fp8", decode_config(False, torch.bfloat16, True, 128), None),
                             ("bf16", DecodeConfig(64, 4, 3, 3, False, True), 2),
                             ("fp8", DecodeConfig(64, 2, 4, 3, True, True), 3)):
        _assert_streams(dac.analyse(dac.compile_split(cfg, kv, target=where), cfg), buffers)
