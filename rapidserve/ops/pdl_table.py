"""Where a decode step launches with programmatic dependent launch (`ops/pdl.py`) and its GEMMs' L2 weight prefetch:
a measured table per GPU and the pure decision from it. Plain data, no torch or Triton: tested on CPU.

Why a table: PDL and the prefetch pay at small decode batches and cost at large ones. Measured on one NVIDIA H200
(2026-11-29, `python bench/decode_profile.py --quantization fp8 --batches 1,16,64 --variants fused`, Qwen3-8B shape,
2048-token contexts, CUDA-graph replay medians; with PDL and the prefetch / no PDL / PDL without the prefetch):

| batch | PDL + prefetch | no PDL | no prefetch |
|---|---|---|---|
| 1 | 3.215 ms | 3.520 (PDL -8.7%) | 3.319 (prefetch -3.1%) |
| 16 | 4.774 | 4.850 (-1.6%) | 4.855 (-1.7%) |
| 64 | 8.865 | 8.339 (+6.3%: slower) | 8.774 (+1.0%: slower) |

A second run on 2 x H200 (2026-11-29T22:45Z, `... --batches 1,8,16,24,32,48,64 --write-pdl-table`, and bf16 at
1/16/64 in the same call), PDL / no PDL:

| batch | fp8 | bf16 |
|---|---|---|
| 1 | 3.421 / 3.563 ms (-4.0%) | 4.728 / 4.563 (+3.6%: slower) |
| 8 | 4.135 / 4.121 (+0.3%) | - |
| 16 | 4.794 / 4.696 (+2.1%) | 6.270 / 5.733 (+9.4%) |
| 32 / 48 / 64 | +8.4% / +1.9% / +4.9% | 9.633 / 9.284 at 64 (+3.8%) |

Batches 8-16 swing by about 2% from run to run, and bf16 loses at every batch, so the H200's entry keeps PDL and
the prefetch on at 1 row only (fp8 gained there twice) and off from 2. The table is per GPU, not per weight dtype:
at one row bf16 pays ~3% for fp8's ~4-9%. A GPU without an entry takes the H200's (`DEFAULT_DEVICE`'s entry of
the table, as measured there; `DEFAULT_ENTRY`, the same figures, where the table has none either): a guess for
every other GPU, the H100 included, until it is measured.

The file, `rapidserve/ops/pdl_table.json` (`TABLE_PATH`), maps `torch.cuda.get_device_name()` to an entry::

    {"NVIDIA H200": {"max_rows": 1, "prefetch_bytes": 8388608, "source": "free text: what measured it, when"}}

- ``max_rows``: the largest step (in rows: a decode graph's batch bucket, an eager step's sequences) at which PDL
  and the prefetch are on; 0: never;
- ``prefetch_bytes``: the weight bytes each skinny GEMM launch pulls into L2 before its PDL wait where on
  (`triton_skinny.prefetch_bytes`' budget); 0: PDL without the prefetch.

`bench/decode_profile.py --write-pdl-table` measures an entry on the GPU it runs on (`measured_entry`) and writes it
into this checkout's file (`with_entry`, `write_table`); commit it from there. The file is validated when it loads
(`load_table`, at this module's import): a bad one raises `PdlTableError` naming the field.

`pdl_for_step(rows, device, table)` is the decision: off where the device cannot launch with PDL (before sm_90,
ROCm, the CPU, a Triton without it: `PdlDevice.capable`), else the device's entry (or the default) by rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from rapidserve.config_base import ConfigError
from rapidserve.ops.table_files import (
    device_table_json,
    entry_fields,
    parse_device_table,
    read_table,
    with_device_entry,
    write_device_table,
)

TABLE_PATH = Path(__file__).resolve().parent / "pdl_table.json"
FIELDS = ("max_rows", "prefetch_bytes", "source")
WIN_MARGIN = 0.01  # a measured batch counts as a win where PDL is faster than without it by more than this fraction
DEFAULT_PREFETCH_BYTES = 8 << 20  # triton_skinny.PREFETCH_BYTES (the budget the H200 was measured with)


class PdlTableError(ConfigError):
    """The PDL table is malformed; the message names the file and the field."""


class PdlEntry(NamedTuple):
    """One GPU's measurement (module docstring)."""

    max_rows: int  # the largest step, in rows, at which PDL and the prefetch are on (0: never)
    prefetch_bytes: int  # each skinny GEMM launch's L2 prefetch before its wait where on (0: none)
    source: str  # what measured it, when


class PdlDevice(NamedTuple):
    """The facts about a device the decision reads (`ops.pdl.pdl_device` gathers them)."""

    name: str  # torch.cuda.get_device_name(), the table's key; the device type elsewhere
    capable: bool  # whether kernels launch with PDL there at all (`ops.pdl.use_pdl(None, device)`)


class LaunchChoice(NamedTuple):
    """How a step's Triton kernels launch: with PDL or not, and the skinny GEMMs' prefetch bytes (0: none; always 0
    without PDL, which the prefetch needs)."""

    pdl: bool
    prefetch_bytes: int

    def label(self) -> str:
        if not self.pdl:
            return "PDL off"
        return f"PDL on, prefetch {self.prefetch_bytes >> 20} MiB" if self.prefetch_bytes else "PDL on, no prefetch"


PdlTable = Mapping[str, PdlEntry]  # by device name
OFF = LaunchChoice(False, 0)
DEFAULT_DEVICE = "NVIDIA H200"  # whose entry a GPU without its own takes
DEFAULT_ENTRY = PdlEntry(1, DEFAULT_PREFETCH_BYTES, "the NVIDIA H200's figures of 2026-11-29 (module docstring)")


def entry_for(table: PdlTable, device_name: str) -> PdlEntry:
    """The device's entry; where the table has none, the H200's (`DEFAULT_DEVICE`'s, else `DEFAULT_ENTRY`)."""
    return table.get(device_name) or table.get(DEFAULT_DEVICE) or DEFAULT_ENTRY


def pdl_for_step(rows: int, device: PdlDevice, table: PdlTable) -> LaunchChoice:
    """How a decode step of `rows` rows launches on `device`: `OFF` where the device cannot launch with PDL or
    `rows` is past its entry's `max_rows`, else PDL on with the entry's prefetch. ValueError for rows < 1."""
    if rows < 1:
        raise ValueError(f"a step has at least one row; got {rows}")
    if not device.capable:
        return OFF
    entry = entry_for(table, device.name)
    return LaunchChoice(True, entry.prefetch_bytes) if rows <= entry.max_rows else OFF


class PdlRow(NamedTuple):
    """One measured batch of bench/decode_profile.py: its graph replay's median with PDL and the prefetch forced on,
    with PDL off, and with PDL on without the prefetch (milliseconds)."""

    batch: int
    pdl_ms: float
    no_pdl_ms: float
    no_prefetch_ms: float


def wins(faster_ms: float, slower_ms: float, margin: float = WIN_MARGIN) -> bool:
    """Whether `faster_ms` beats `slower_ms` by more than `margin` of it."""
    return faster_ms < slower_ms * (1 - margin)


def measured_entry(rows: Sequence[PdlRow], prefetch_bytes: int, source: str,
                   margin: float = WIN_MARGIN) -> PdlEntry:
    """The entry the measured batches give: `max_rows` the largest batch at which PDL (with the prefetch) beats no PDL
    by more than `margin`, and does so at every smaller measured batch too (a loss below it caps it there; none
    measured between two batches is assumed to lose, so off); 0 where it does not win at the smallest. The
    `prefetch_bytes` measured stay on unless the prefetch loses (PDL without it faster by more than `margin`) at some
    measured batch up to `max_rows`. ValueError for no rows or a batch measured twice."""
    batches = [r.batch for r in rows]
    if not rows or len(set(batches)) != len(batches):
        raise ValueError(f"measured_entry needs each batch once; got {batches}")
    max_rows = 0
    on: list[PdlRow] = []
    for r in sorted(rows):
        if not wins(r.pdl_ms, r.no_pdl_ms, margin):
            break
        max_rows = r.batch
        on.append(r)
    prefetch_loses = any(wins(r.no_prefetch_ms, r.pdl_ms, margin) for r in on)
    return PdlEntry(max_rows, 0 if prefetch_loses else prefetch_bytes, source)


def _fail(path: str, field: str, problem: str) -> PdlTableError:
    return PdlTableError(f"{path}: {field}: {problem}")


def parse_entry(d: object, path: str, where: str) -> PdlEntry:
    """An entry from its parsed JSON, every field checked (`where` names it in errors)."""
    d = entry_fields(d, path, where, FIELDS, _fail)
    for name in ("max_rows", "prefetch_bytes"):
        v = d[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _fail(path, f"{where}.{name}", f"must be an integer >= 0, got {v!r}")
    if not isinstance(d["source"], str):
        raise _fail(path, f"{where}.source", f"must be a string, got {d['source']!r}")
    return PdlEntry(d["max_rows"], d["prefetch_bytes"], d["source"])


def parse_table(d: object, path: str) -> PdlTable:
    """The table from the file's parsed JSON (module docstring); `path` names it in errors."""
    return parse_device_table(d, path, parse_entry, _fail)


def table_json(table: PdlTable) -> dict[str, Any]:
    """The file's content of `table` (what `parse_table` reads back), by device name."""
    return device_table_json(table)


def load_table(path: Path = TABLE_PATH) -> PdlTable:
    """The table at `path`, validated (empty where there is no file); read-only."""
    if not path.is_file():
        return MappingProxyType({})
    return read_table(path, parse_table, _fail)


def with_entry(table: PdlTable, device_name: str, entry: PdlEntry) -> PdlTable:
    """`table` with `entry` as `device_name`'s (the other devices' entries kept)."""
    return with_device_entry(table, device_name, entry)


def write_table(path: Path, table: PdlTable) -> PdlTable:
    """`table` written as the file at `path`, checked by reading it back (what the engine will load, or raise here);
    returns what was read."""
    return write_device_table(path, table, load_table)


PDL_TABLE: PdlTable = load_table()  # the packaged table, validated once at import (read-only)

__all__ = ["DEFAULT_DEVICE", "DEFAULT_ENTRY", "DEFAULT_PREFETCH_BYTES", "OFF", "PDL_TABLE", "TABLE_PATH", "WIN_MARGIN",
           "LaunchChoice", "PdlDevice", "PdlEntry", "PdlRow", "PdlTable", "PdlTableError", "entry_for", "load_table",
           "measured_entry", "parse_entry", "parse_table", "pdl_for_step", "table_json", "wins", "with_entry",
           "write_table"]
