"""Launch configuration of the Triton split-K decode attention (rapidserve/attention/triton_paged_decode.py): the tile
table, the split rule and the reduce kernel's split tile. Pure functions of shapes, dtypes and the platform; no
Triton import, so they are table-tested on any machine (tests/test_decode_config.py).

The table (`DECODE_TABLE`) is keyed by (platform, q dtype, KV cache, head_dim) and gives a `DecodeConfig`:

- ``block_n``, ``num_warps``, ``num_stages``: the split kernel's key tile and launch options;
- ``waves``: the split rule aims for ``waves`` x SMs programs (`decode_num_splits`);
- ``fp16_dots``: over an fp8 cache with a bf16 q, the kernel converts the tiles (and q, once) to fp16 rather than
  bf16 for its two dots. Every e4m3 value is an fp16 and a bf16 value, so the tiles convert exactly either way, but
  on sm_90 e4m3 -> fp16 is one instruction per element pair (SASS ``F2FP.F16.E4M3.UNPACK_B``) and e4m3 -> bf16 is
  that plus one ``F2F.BF16.F16`` per element: the kernel's loop (64-key tile, 4 warps, compiled for sm_90) is 884
  instructions a thread with bf16 dots, 128 of them F2F and 64 PRMT, and 684 with fp16 dots. F2F runs on the
  conversion pipe (the CUDA guide's throughput table: 16 conversions per clock per SM at compute capability 9.0),
  so bf16 tiles cost ~1024 clocks of it per 16 KiB fp8 tile: at most ~4.2 TB/s over 132 SMs at 1.98 GHz, ~2.8
  TB/s if F2FP shares that rate, against a 4.16 TB/s copy ceiling on an H200. The price: 143 registers instead of
  128 (3 programs an SM instead of 4). On gfx942 the fp16 variant takes more conversions (262 v_cvt against 82 in
  the AMDGCN), so ROCm keeps bf16. Both variants are candidates of the tuning sweep.
- ``prefetch``: the kernel loads the next tile's block-table entries one iteration early (a loop-carried value), so
  a tile's K/V addresses never wait on a load of the same iteration. What the stages buy depends on it (sm_90,
  Triton 3.6, 64-key bf16 tiles at head_dim 128; bench/decode_attn_compile.py): without it the pipeliner stages the
  table load before the K/V loads, so num_stages 2 loads the table synchronously each tile and keeps one K/V
  buffer, 3 and 4 one buffer (39 KiB a program, 5 an SM), 5 two (72 KiB, 3 an SM); with it num_stages s keeps s - 1
  K/V buffers (2: one, without the table's wait; 3: two, 72 KiB; 4: three, 104 KiB). On gfx942 (num_stages 1, no
  pipelining) it takes the table's latency off each tile's K/V loads at the same VGPRs.

NVIDIA's 16-bit head_dim <= 128 entries were measured by `bench/decode_attn_tune.py` on an H200 (2026-11-29 16:02,
after the tl.multiple_of fix in triton_paged_decode.py that ended one-element loads under the GPU's Triton 3.6;
bench/results/decode_attn_tune_h200/): over Qwen3-8B's attention at 1x2048, 16x2048, 64x2048 and 16x8192 the bf16
entry is each shape's best (the earlier 64-key entry 1.119x) at 82-101% of the copy ceiling from 16x2048 up, the fp8
entry 1.026x each shape's best (the earlier one 1.162x) at 53-79%. The rest are rules (ROCm's from the gfx942 compile
check, bench/results/amd_compile/).
`python bench/decode_attn_tune.py` times the candidates on a GPU and prints the entries to put here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch


class DecodeConfig(NamedTuple):
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    waves: int  # programs per SM the split rule aims for
    fp16_dots: bool  # an fp8 cache under a bf16 q: tiles and q converted to fp16 for the dots
    prefetch: bool = False  # the next tile's block-table entries loaded one iteration early (False: the same one)


# (platform, q dtype, KV cache, head_dim) -> DecodeConfig. platform: "cuda" | "rocm" (torch.version.hip set);
# q dtype: "16-bit" (bf16, fp16) | "fp32"; KV cache: "model" (q's dtype) | "fp8"; head_dim: "<=128" | ">128".
# ROCm: num_stages 1 (the ROCm Triton guides' choice for loops with two dots: 32 KiB of LDS less a workgroup) and
# for head_dim 256 (Gemma 3) half the key tile, or its registers cap gfx942 at 1 wave. NVIDIA head_dim 256: half
# the key tiles and a stage less keep K and V's stages in shared memory.
DECODE_TABLE: Mapping[tuple[str, str, str, str], DecodeConfig] = MappingProxyType({
    ("cuda", "16-bit", "model", "<=128"): DecodeConfig(32, 2, 5, 2, False),
    ("cuda", "16-bit", "fp8", "<=128"): DecodeConfig(64, 2, 5, 3, True),
    ("cuda", "16-bit", "model", ">128"): DecodeConfig(32, 4, 2, 2, False),
    ("cuda", "16-bit", "fp8", ">128"): DecodeConfig(32, 4, 2, 2, True),
    ("cuda", "fp32", "model", "<=128"): DecodeConfig(32, 4, 2, 2, False),
    ("cuda", "fp32", "fp8", "<=128"): DecodeConfig(32, 4, 2, 2, False),
    ("cuda", "fp32", "model", ">128"): DecodeConfig(32, 4, 2, 2, False),
    ("cuda", "fp32", "fp8", ">128"): DecodeConfig(32, 4, 2, 2, False),
    ("rocm", "16-bit", "model", "<=128"): DecodeConfig(64, 4, 1, 2, False),
    ("rocm", "16-bit", "fp8", "<=128"): DecodeConfig(64, 4, 1, 2, False),
    ("rocm", "16-bit", "model", ">128"): DecodeConfig(32, 4, 1, 2, False),
    ("rocm", "16-bit", "fp8", ">128"): DecodeConfig(32, 4, 1, 2, False),
    ("rocm", "fp32", "model", "<=128"): DecodeConfig(32, 4, 1, 2, False),
    ("rocm", "fp32", "fp8", "<=128"): DecodeConfig(32, 4, 1, 2, False),
    ("rocm", "fp32", "model", ">128"): DecodeConfig(16, 4, 1, 2, False),
    ("rocm", "fp32", "fp8", ">128"): DecodeConfig(16, 4, 1, 2, False),
})

# ROCm: the reduce kernel holds its [BLOCK_S, BLOCK_D] fp32 partials in registers: with 4 warps, BLOCK_S 512 (a rank
# of one kv head at batch 2 on 304 CUs) allows 1 wave and 1024 (batch 1) spills; so on ROCm it takes up to 16 warps
# (<= 64 partials a thread, `reduce_warps`) and at most ROCM_MAX_SPLITS splits (1024 x 128 spills even at 16 warps,
# whose 1024 threads cap a wave at 128 VGPRs); head_dim 256 proportionally fewer.
ROCM_MAX_SPLITS = 512


def table_key(hip: bool, dtype: torch.dtype, kv_fp8: bool, head_dim: int) -> tuple[str, str, str, str]:
    """The DECODE_TABLE key of a launch."""
    return ("rocm" if hip else "cuda", "fp32" if dtype == torch.float32 else "16-bit", "fp8" if kv_fp8 else "model",
            "<=128" if head_dim <= 128 else ">128")


def decode_config(hip: bool, dtype: torch.dtype, kv_fp8: bool, head_dim: int) -> DecodeConfig:
    """The table's configuration for a launch (ValueError for a q dtype the kernels do not take)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"decode attention takes bf16, fp16 or fp32 queries; got {dtype}")
    return DECODE_TABLE[table_key(hip, dtype, kv_fp8, head_dim)]


def uses_fp16_dots(cfg: DecodeConfig, dtype: torch.dtype, kv_fp8: bool) -> bool:
    """Whether the kernel converts the tiles to fp16 (F16_DOTS): an fp8 cache under a bf16 q, where `cfg` says so
    (an fp16 q takes fp16 dots anyway, an fp32 q IEEE fp32 ones)."""
    return cfg.fp16_dots and kv_fp8 and dtype == torch.bfloat16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def decode_num_splits(batch: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int,
                      block_n: int, num_sms: int, waves: int = 2) -> int:
    """Splits per (sequence, kv head): enough programs for ``waves`` x the SMs, at most one split per
    key tile of the longest sequence the block table can hold. Depends on shapes only."""
    max_tiles = max(1, _cdiv(max_blocks_per_seq * block_size, block_n))
    want = _cdiv(waves * num_sms, max(1, batch * num_kv_heads))
    return max(1, min(want, max_tiles))


def launch_splits(batch: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int, head_dim: int,
                  cfg: DecodeConfig, num_sms: int, hip: bool) -> int:
    """The split count a launch takes: decode_num_splits with the configuration's tile and waves, on ROCm at most
    ROCM_MAX_SPLITS (head_dim 256, Gemma 3: proportionally fewer, the reduce kernel's 8-warp partials of 256 x 128)."""
    splits = decode_num_splits(batch, num_kv_heads, max_blocks_per_seq, block_size, cfg.block_n, num_sms, cfg.waves)
    if hip:
        splits = min(splits, ROCM_MAX_SPLITS if head_dim <= 128 else ROCM_MAX_SPLITS * 64 // head_dim)
    return splits


def decode_block_s(num_splits: int, num_kv_heads: int, num_sms: int, waves: int = 2, cap: int = 64) -> int:
    """The reduce kernel's split tile: the largest split count decode_num_splits gives on this device and model
    (batch 1) rounded up to a power of two, at most `cap` (a larger tile costs registers), unless `num_splits`
    itself is larger. One compiled variant serves every step where waves x SMs / num_kv_heads <= cap; with fewer kv
    heads per rank (4 or fewer on an H100 at 2 waves: Qwen3-8B at -tp 2) the smallest batches get their own, which
    decode graph capture compiles before serving."""
    most = min(cap, _cdiv(waves * num_sms, max(1, num_kv_heads)))
    return _next_power_of_2(max(num_splits, most))


def reduce_warps(block_s: int, block_d: int, hip: bool) -> int:
    """The reduce kernel's num_warps: 4 on NVIDIA; on ROCm enough wave64 warps for <= 64 partials a thread."""
    if not hip:
        return 4
    return min(16, max(4, block_s * block_d // (64 * 64)))


__all__ = ["DECODE_TABLE", "ROCM_MAX_SPLITS", "DecodeConfig", "decode_block_s", "decode_config", "decode_num_splits",
           "launch_splits", "reduce_warps", "table_key", "uses_fp16_dots"]
