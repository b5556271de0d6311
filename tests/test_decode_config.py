"""Decode attention's launch configuration (rapidserve/attention/decode_config.py): the table, the split rule, the
reduce kernel's split tile and warps as pure functions (tables of cases), and what
`triton_paged_decode.decode_attention` launches with them (the kernels recorded instead of run, on meta tensors: no
GPU, no interpreter)."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

from rapidserve.attention import decode_config as dc
from rapidserve.attention.decode_config import DecodeConfig

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (batch, kv heads, table width in blocks, block_size, block_n, SMs, waves) -> splits
SPLIT_CASES = [
    ((1, 8, 128, 16, 64, 132, 2), 32),  # 2 x 132 / 8 = 33 wanted, capped by the table's 32 tiles
    ((1, 8, 512, 16, 64, 132, 2), 33),  # an 8192-token table: 33
    ((16, 8, 512, 16, 64, 132, 2), 3),  # Qwen3-8B at batch 16 on an H100 / H200: 264 / 128 -> 3
    ((64, 8, 512, 16, 64, 132, 2), 1),  # 512 programs already: one split, no reduce
    ((256, 8, 512, 16, 64, 132, 2), 1),
    ((16, 8, 512, 16, 64, 132, 4), 5),  # 4 waves: 528 / 128 -> 5
    ((16, 8, 512, 16, 64, 132, 1), 2),
    ((1, 8, 512, 16, 128, 132, 8), 64),  # 1056 / 8 = 132 wanted, 64 tiles of 128 in 8192 tokens
    ((1, 1, 1, 16, 64, 132, 2), 1),  # one block: one tile
    ((1, 1, 3, 16, 16, 132, 2), 3),  # 48 tokens in 16-key tiles
    ((4, 4, 512, 16, 32, 304, 2), 38),  # MI300X: 608 / 16
    ((3, 5, 7, 8, 16, 7, 3), 2),  # odd everything: 21 / 15 -> 2
    ((0, 8, 512, 16, 64, 132, 2), 128),  # batch 0 (never launched): as one (row, kv head), capped by 128 tiles
]


@pytest.mark.parametrize(("args", "want"), SPLIT_CASES, ids=[str(a) for a, _ in SPLIT_CASES])
def test_decode_num_splits(args: tuple[int, ...], want: int) -> None:
    assert dc.decode_num_splits(*args) == want


# (batch, kv heads, width, block_size, head_dim, config, SMs, hip) -> splits
LAUNCH_CASES = [
    ((1, 1, 4096, 16, 128, DecodeConfig(64, 4, 1, 2, False), 304, True), 512),  # 608 -> ROCm's cap
    ((1, 1, 4096, 16, 256, DecodeConfig(32, 4, 1, 2, False), 304, True), 128),  # head_dim 256: 512 * 64 / 256
    ((1, 1, 4096, 16, 128, DecodeConfig(64, 4, 3, 2, False), 304, False), 608),  # no cap on NVIDIA
    ((16, 8, 512, 16, 128, DecodeConfig(64, 4, 3, 4, True), 132, False), 5),  # the configuration's waves
    ((2, 8, 512, 16, 128, DecodeConfig(128, 4, 3, 2, False), 132, False), 17),
]


@pytest.mark.parametrize(("args", "want"), LAUNCH_CASES, ids=[f"case{i}" for i in range(len(LAUNCH_CASES))])
def test_launch_splits(args: tuple[Any, ...], want: int) -> None:
    assert dc.launch_splits(*args) == want


# (num_splits, kv heads, SMs, waves) -> the reduce kernel's BLOCK_S
BLOCK_S_CASES = [
    ((3, 8, 132, 2), 64),  # the batch-1 count (33) rounded up: one variant for every batch
    ((33, 8, 132, 2), 64),
    ((1, 1, 132, 2), 64),  # capped at 64 for a single kv head
    ((200, 1, 132, 2), 256),  # unless the split count itself is larger (an override)
    ((5, 8, 132, 4), 64),  # 4 waves: 66 wanted at batch 1, capped at 64
    ((3, 8, 132, 1), 32),  # 1 wave: 17 at batch 1 -> 32
    ((2, 4, 132, 2), 64),
]


@pytest.mark.parametrize(("args", "want"), BLOCK_S_CASES, ids=[str(a) for a, _ in BLOCK_S_CASES])
def test_decode_block_s(args: tuple[int, ...], want: int) -> None:
    assert dc.decode_block_s(*args) == want


def test_block_s_is_one_variant_for_every_batch_up_to_its_cap() -> None:
    """Decode graphs of every batch bucket share one reduce variant while waves x SMs / kv heads <= 64; past that
    (4 waves on 132 SMs: 66 splits at batch 1) the smallest batches get their own, compiled at graph capture."""
    want = {1: {32}, 2: {64}, 3: {64}, 4: {64, 128}}
    for waves, tiles in want.items():
        got = {dc.decode_block_s(dc.decode_num_splits(b, 8, 512, 16, 64, 132, waves), 8, 132, waves)
               for b in range(1, 257)}
        assert got == tiles, waves


@pytest.mark.parametrize(("args", "want"), [((64, 128, False), 4), ((1024, 128, False), 4), ((64, 128, True), 4),
                                            ((256, 128, True), 8), ((512, 128, True), 16), ((1024, 256, True), 16)])
def test_reduce_warps(args: tuple[int, int, bool], want: int) -> None:
    assert dc.reduce_warps(*args) == want


def test_table_covers_every_key_and_keeps_the_measured_defaults() -> None:
    keys = {(p, q, kv, h) for p in ("cuda", "rocm") for q in ("16-bit", "fp32") for kv in ("model", "fp8")
            for h in ("<=128", ">128")}
    assert set(dc.DECODE_TABLE) == keys
    assert all(c.waves >= 1 and c.block_n >= 16 and c.block_n & (c.block_n - 1) == 0 for c in dc.DECODE_TABLE.values())
    # NVIDIA bf16 / fp16 as tuned on an H200 (bench/results/decode_attn_tune_h200/), fp32 as measured before the
    # table (tests/test_rocm_paths.py checks the tuples too)
    assert dc.decode_config(False, BF16, False, 128) == DecodeConfig(32, 2, 5, 2, False)
    assert dc.decode_config(False, FP16, False, 128) == DecodeConfig(32, 2, 5, 2, False)
    assert dc.decode_config(False, FP32, False, 128) == DecodeConfig(32, 4, 2, 2, False)
    assert dc.decode_config(False, BF16, False, 256) == DecodeConfig(32, 4, 2, 2, False)
    assert dc.decode_config(True, BF16, False, 128) == DecodeConfig(64, 4, 1, 2, False)
    assert dc.decode_config(True, FP32, False, 256) == DecodeConfig(16, 4, 1, 2, False)
    # an fp8 cache: NVIDIA's tiles in fp16, ROCm's as before
    assert dc.decode_config(False, BF16, True, 128) == DecodeConfig(64, 2, 5, 3, True)
    assert dc.decode_config(True, BF16, True, 128) == DecodeConfig(64, 4, 1, 2, False)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        dc.decode_config(False, torch.int8, False, 128)


@pytest.mark.parametrize(("fp16_dots", "dtype", "kv_fp8", "want"), [
    (True, BF16, True, True), (True, FP16, True, False), (True, FP32, True, False), (True, BF16, False, False),
    (False, BF16, True, False)])
def test_uses_fp16_dots(fp16_dots: bool, dtype: torch.dtype, kv_fp8: bool, want: bool) -> None:
    assert dc.uses_fp16_dots(DecodeConfig(64, 4, 3, 2, fp16_dots), dtype, kv_fp8) is want


# ------------------------------------------------------------------------------ launches, recorded
class _Recorder:
    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((tuple(grid), kwargs))
        return launch


def _launch(batch: int, dtype: torch.dtype, cache: torch.dtype, hip: bool, sms: int = 132,
            **kw: Any) -> tuple[list[tuple[tuple[int, ...], dict[str, Any]]], list[tuple[tuple[int, ...], dict]]]:
    """decode_attention of Qwen3-8B's shape (32 q heads, 8 kv heads, head_dim 128, block 16, a 512-block table) on
    meta tensors: the split and reduce kernels' (grid, kwargs)."""
    pytest.importorskip("triton")
    from rapidserve.attention import triton_paged_decode as tp

    meta = torch.device("meta")
    q = torch.empty(batch, 32, 128, dtype=dtype, device=meta)
    kc = torch.empty(4096, 8, 16, 128, dtype=cache, device=meta)
    bt = torch.empty(batch, 512, dtype=torch.int32, device=meta)
    ctx = torch.empty(batch, dtype=torch.int32, device=meta)
    scales = (torch.empty(1, device=meta), torch.empty(1, device=meta)) if cache != dtype else ()
    split, red = _Recorder(), _Recorder()
    with (mock.patch.object(tp, "_decode_split_kernel", split), mock.patch.object(tp, "_decode_reduce_kernel", red),
          mock.patch.object(tp, "_num_sms", lambda device: sms),
          mock.patch.object(torch.version, "hip", "6.4.0" if hip else None)):
        tp.decode_attention(q, kc, kc, bt, ctx, 0.1, *scales, **kw)
    return split.launches, red.launches


def test_launch_takes_the_table_entry() -> None:
    (grid, kw), = _launch(64, BF16, BF16, hip=False)[0]
    assert grid == (64, 8, 1) and (kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]) == (32, 2, 5)
    assert kw["F16_DOTS"] is False and kw["DIRECT"] is True
    split, red = _launch(16, BF16, BF16, hip=False)
    assert split[0][0] == (16, 8, 3) and red[0][0] == (16 * 32,) and red[0][1]["BLOCK_S"] == 64


def test_fp8_cache_under_bf16_takes_fp16_dots_on_nvidia_only() -> None:
    (_, kw), = _launch(64, BF16, torch.float8_e4m3fn, hip=False)[0]
    assert kw["F16_DOTS"] is True and kw["KV_FP8"] is True
    (_, kw), = _launch(64, FP16, torch.float8_e4m3fn, hip=False)[0]
    assert kw["F16_DOTS"] is False  # an fp16 q takes fp16 dots anyway
    (_, kw), = _launch(64, BF16, torch.float8_e4m3fnuz, hip=True, sms=304)[0]
    assert kw["F16_DOTS"] is False and kw["num_stages"] == 1


def test_overrides_replace_the_entry_then_its_fields() -> None:
    cfg = DecodeConfig(128, 8, 2, 4, False)
    split, red = _launch(16, BF16, torch.float8_e4m3fn, hip=False, config=cfg)
    (grid, kw), = split
    assert grid == (16, 8, 5)  # 4 waves
    assert (kw["BLOCK_N"], kw["num_warps"], kw["num_stages"], kw["F16_DOTS"]) == (128, 8, 2, False)
    assert red[0][1]["BLOCK_S"] == 64
    (grid, kw), = _launch(16, BF16, BF16, hip=False, config=cfg, block_n=32, num_stages=3, num_splits=7)[0]
    assert grid == (16, 8, 7) and (kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]) == (32, 8, 3)


def test_block_table_prefetch_follows_the_configuration() -> None:
    """PREFETCH is the configuration's (a field defaulting to False: every table entry launches as before it
    existed), on both platforms."""
    assert DecodeConfig(64, 2, 5, 3, False).prefetch is False
    assert not any(c.prefetch for c in dc.DECODE_TABLE.values())
    (_, kw), = _launch(64, BF16, BF16, hip=False)[0]
    assert kw["PREFETCH"] is False
    for hip, cache in ((False, BF16), (False, torch.float8_e4m3fn), (True, torch.float8_e4m3fnuz)):
        (_, kw), = _launch(16, BF16, cache, hip=hip, config=DecodeConfig(32, 4, 3, 2, True, True))[0]
        assert kw["PREFETCH"] is True and kw["BLOCK_N"] == 32
