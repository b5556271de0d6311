"""Where a decode step's fp8 projections run as W8A16 (ops/triton_w8a16.py: fp8 weights widened to fp16, the rows in
fp16 with no per-token scale): a measured table per GPU and the pure decision from it. Plain data, no torch or Triton:
tested on CPU.

Why a table, and why no GPU takes it: W8A16 takes the per-token activation quantization off the decode step (the
RMSNorm, the attention's reduce and SiLU-and-mul are then the bf16 path's kernels, and SiLU-and-mul moves into the
gate|up GEMM's epilogue: bench/results/issue39.md, 2026-12-01, route (c)), but widens every weight tile to fp16 in
registers. Whether that is faster than W8A8 at a given batch, on a given GPU, is for a GPU to say: on the H200
(2026-12-01, bench/results/h200_1201/w8a16_ab.md) it lost at every batch 1-64 (+8% to +34% a step: its GEMMs 1.2-3x
slower than W8A8's), so the H200's entry is 0 rows and the engine runs W8A8 everywhere. A GPU without an entry never
takes W8A16 (no default device: unlike ops/pdl_table.py, nothing was measured to default to).

The file, `rapidserve/ops/w8a16_table.json` (`TABLE_PATH`), maps `torch.cuda.get_device_name()` to an entry::

    {"NVIDIA H200": {"max_rows": 16, "source": "free text: what measured it, when"}}

- ``max_rows``: the largest step (in rows: a decode graph's batch bucket, an eager step's tokens) whose fp8
  projections run W8A16 where the kernel can take them (`triton_w8a16.plan`); 0: never.

`bench/decode_profile.py --quantization fp8 --variants fused,w8a16 --write-w8a16-table` measures an entry on the GPU
it runs on (`measured_entry`: the two variants' step times) and writes it into this checkout's file (`with_entry`,
`write_table`); commit it from there. The file is validated when it loads (`load_table`, at this module's import): a
bad one raises `W8a16TableError` naming the field.

`w8a16_for_step(rows, device, table)` is the decision: never on ROCm (its fp8 GEMMs are `torch._scaled_mm`; no skinny
kernel runs there) or off a GPU, else the device's entry by rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from rapidserve.config_base import ConfigError
from rapidserve.ops.fp8_tiles import MAX_ROWS
from rapidserve.ops.table_files import (
    device_table_json,
    entry_fields,
    parse_device_table,
    read_table,
    with_device_entry,
    write_device_table,
)

TABLE_PATH = Path(__file__).resolve().parent / "w8a16_table.json"
FIELDS = ("max_rows", "source")
WIN_MARGIN = 0.01  # a measured batch counts as a win where W8A16's step is faster than W8A8's by more than this


class W8a16TableError(ConfigError):
    """The W8A16 table is malformed; the message names the file and the field."""


class W8a16Entry(NamedTuple):
    """One GPU's measurement (module docstring)."""

    max_rows: int  # the largest step, in rows, whose fp8 projections run W8A16 (0: never)
    source: str  # what measured it, when


class W8a16Device(NamedTuple):
    """The facts about a device the decision reads."""

    name: str  # torch.cuda.get_device_name(), the table's key; the device type elsewhere
    nvidia: bool  # a CUDA GPU of NVIDIA (not ROCm, not the CPU): where the skinny fp8 kernel runs


W8a16Table = Mapping[str, W8a16Entry]  # by device name
EMPTY: W8a16Table = MappingProxyType({})


def w8a16_for_step(rows: int, device: W8a16Device, table: W8a16Table) -> bool:
    """Whether a step of `rows` rows runs its fp8 projections W8A16 on `device` (where the kernel takes them): an
    NVIDIA GPU whose entry's `max_rows` >= rows. ValueError for rows < 1."""
    if rows < 1:
        raise ValueError(f"a step has at least one row; got {rows}")
    entry = table.get(device.name)
    return device.nvidia and entry is not None and rows <= entry.max_rows


def forced(device_name: str, source: str = "forced: every row count the kernel takes (an A/B, not a measurement)"
           ) -> W8a16Table:
    """A table that sends every step of up to MAX_ROWS rows on `device_name` to W8A16 (bench/decode_profile.py's
    `w8a16` variant and the GPU tests: the path regardless of the packaged table)."""
    return with_entry(EMPTY, device_name, W8a16Entry(MAX_ROWS, source))


class W8a16Row(NamedTuple):
    """One measured batch of bench/decode_profile.py: the step's graph replay median with W8A8 (the `fused` variant)
    and with W8A16 forced (the `w8a16` variant), milliseconds."""

    batch: int
    w8a8_ms: float
    w8a16_ms: float


def measured_entry(rows: Sequence[W8a16Row], source: str, margin: float = WIN_MARGIN) -> W8a16Entry:
    """The entry the measured batches give: `max_rows` the largest batch at which W8A16 beats W8A8 by more than
    `margin` and does so at every smaller measured batch too (a loss caps it below the losing batch); a batch not
    measured that lies below max_rows runs W8A16 too (the entry is a threshold: measure the batches the engine
    captures near it); 0 where it does not win at the smallest. ValueError for no rows or a batch measured twice."""
    batches = [r.batch for r in rows]
    if not rows or len(set(batches)) != len(batches):
        raise ValueError(f"measured_entry needs each batch once; got {batches}")
    max_rows = 0
    for r in sorted(rows):
        if not r.w8a16_ms < r.w8a8_ms * (1 - margin):
            break
        max_rows = r.batch
    return W8a16Entry(max_rows, source)


def _fail(path: str, field: str, problem: str) -> W8a16TableError:
    return W8a16TableError(f"{path}: {field}: {problem}")


def parse_entry(d: object, path: str, where: str) -> W8a16Entry:
    """An entry from its parsed JSON, every field checked (`where` names it in errors)."""
    d = entry_fields(d, path, where, FIELDS, _fail)
    v = d["max_rows"]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_ROWS:
        raise _fail(path, f"{where}.max_rows", f"must be an integer in 0..{MAX_ROWS}, got {v!r}")
    if not isinstance(d["source"], str):
        raise _fail(path, f"{where}.source", f"must be a string, got {d['source']!r}")
    return W8a16Entry(v, d["source"])


def parse_table(d: object, path: str) -> W8a16Table:
    """The table from the file's parsed JSON (module docstring); `path` names it in errors."""
    return parse_device_table(d, path, parse_entry, _fail)


def table_json(table: W8a16Table) -> dict[str, Any]:
    """The file's content of `table` (what `parse_table` reads back), by device name."""
    return device_table_json(table)


def load_table(path: Path = TABLE_PATH) -> W8a16Table:
    """The table at `path`, validated (empty where there is no file); read-only."""
    if not path.is_file():
        return EMPTY
    return read_table(path, parse_table, _fail)


def with_entry(table: W8a16Table, device_name: str, entry: W8a16Entry) -> W8a16Table:
    """`table` with `entry` as `device_name`'s (the other devices' entries kept)."""
    return with_device_entry(table, device_name, entry)


def write_table(path: Path, table: W8a16Table) -> W8a16Table:
    """`table` written as the file at `path`, checked by reading it back (what the engine will load, or raise here);
    returns what was read."""
    return write_device_table(path, table, load_table)


W8A16_TABLE: W8a16Table = load_table()  # the packaged table, validated once at import (read-only)

__all__ = ["EMPTY", "TABLE_PATH", "W8A16_TABLE", "WIN_MARGIN", "W8a16Device", "W8a16Entry", "W8a16Row", "W8a16Table",
           "W8a16TableError", "forced", "load_table", "measured_entry", "parse_entry", "parse_table", "table_json",
           "w8a16_for_step", "with_entry", "write_table"]
