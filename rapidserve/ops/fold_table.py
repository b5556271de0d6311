"""Where a decode step folds a split-K fp8 GEMM's reduce into the RMSNorm after it (issue 39): a table per GPU and
the pure decision from it. Plain data, no torch or Triton: tested on CPU.

What the fold is (`ops/triton_fp8_fold.py`): where the skinny fp8 GEMM splits K (`Fp8Tiles.split_k` > 1: at one row
on the H200, o_proj in 4 slices and down_proj in 8; at 2-16 rows down_proj in 4), its slices' float32 sums are added
by a second, small kernel (`triton_fp8_skinny._fp8_split_reduce_kernel`) before the RMSNorm that reads the output
(o_proj's: the post-attention norm; down_proj's: the next layer's input norm). Folded, that RMSNorm adds the slices
itself, in the same order with the same epilogue, and the reduce launch is gone: at one row two launches a layer (72
a step on Qwen3-8B), at 2-16 rows one. Each such launch costs its ramp, a global round trip of its output and, with
programmatic dependent launch, a link in the chain of waits (bench/results/decode_profile_fp8/: 1.8 us each at one
row, 131 us a step, besides the launch); what the fold adds is the norm's programs reading S float32 slices of their
row from L2 instead of one bf16 row (at one row and S = 8: 128 KiB a program, 4 programs).

Why a table and the H200's entry: NOT MEASURED YET. The entry (`max_rows` 16) is reasoning: the launches saved are
what PDL's measurements show pays at up to 16 rows (ops/pdl_table.py: the chain of small kernels is what costs there),
and at 17-64 rows PDL is off and the reduce's launch hides behind the GEMM before it, while the norm's extra L2 reads
grow with the rows. `bench/decode_profile.py --quantization fp8` times each batch with the fold off too (its
"unfused small kernels ms" column); put the measured threshold here. A GPU without an entry takes the H200's
(`DEFAULT_DEVICE`), as ops/pdl_table.py does. Only NVIDIA runs the skinny fp8 kernel (ROCm's fp8 GEMMs are
`torch._scaled_mm`, which never splits), so only there can a fold happen at all.

`fold_for_step(rows, device_name, table)`: whether a step of `rows` rows folds (where a GEMM of it splits K).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple


class FoldEntry(NamedTuple):
    """One GPU's rule: fold the split-K reduce into the next RMSNorm at 1..max_rows rows (0: never)."""

    max_rows: int
    source: str  # what decided it: a measurement (command, date) or the reasoning


FoldTable = Mapping[str, FoldEntry]  # by torch.cuda.get_device_name()
DEFAULT_DEVICE = "NVIDIA H200"  # whose entry a GPU without its own takes
FOLD_TABLE: FoldTable = MappingProxyType({
    "NVIDIA H200": FoldEntry(16, "reasoning, not measured (module docstring): the rows where PDL pays "
                                 "(ops/pdl_table.json), where the chain of small kernels is what costs"),
})


def entry_for(table: FoldTable, device_name: str) -> FoldEntry:
    """The device's entry; where the table has none, `DEFAULT_DEVICE`'s (none there either: never fold)."""
    return table.get(device_name) or table.get(DEFAULT_DEVICE) or FoldEntry(0, "no entry")


def fold_for_step(rows: int, device_name: str, table: FoldTable = FOLD_TABLE) -> bool:
    """Whether a call of `rows` rows on `device_name` hands its split-K sums to the next RMSNorm instead of launching
    the reduce kernel: 1 <= rows <= the device's entry's `max_rows`. ValueError for rows < 1 (no GEMM of no rows
    runs the skinny kernel)."""
    if rows < 1:
        raise ValueError(f"a GEMM call has at least one row; got {rows}")
    return rows <= entry_for(table, device_name).max_rows


__all__ = ["DEFAULT_DEVICE", "FOLD_TABLE", "FoldEntry", "FoldTable", "entry_for", "fold_for_step"]
