"""Tiles of decode's skinny fp8 GEMM (`ops/triton_fp8_skinny.py`, issue 39) as data: measured tables, validated.

A table is one JSON file per GPU in `rapidserve/ops/fp8_configs/`, written by `bench/decode_profile.py --quantization
fp8 --sweep` on the GPU it names, named ``device_name={torch.cuda.get_device_name(), spaces as _}.json``::

    {"device_name": "NVIDIA H200", "source": "free text: what measured it, when",
     "shapes": {"6144x4096": {"1": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4,
                                    "num_stages": 4, "SWAP": true, "split_k": 4},
                              "16": {...the same fields...},
                              "64": "scaled_mm"}, ...}}

A shape is a weight's "NxK" (output features x input features, one rank's slice). A key is a row count the sweep
measured (1..MAX_ROWS); a call of r rows takes the entry of the smallest key >= r, and one past the largest key is not
covered (`lookup` returns None: the caller's untuned rule). An entry is the kernel's tiles (`Fp8Tiles`: BLOCK_M rows,
at least the key's, so every call it covers fits in one row tile; BLOCK_N output columns a program; K steps of
BLOCK_K; warps; pipeline stages; SWAP: the weight tile as the product's first operand; split_k, optional (files
without it read as 1, one program a column tile): the K slices a column tile is cut into, summed by a second kernel;
see triton_fp8_skinny) or "scaled_mm": those rows go to `torch._scaled_mm` (cuBLASLt), measured faster there. Every
file is validated when the tables load (`load_tables`, at the import of triton_fp8_skinny): a bad one raises
`Fp8TableError` naming the file and the field. Plain data, no Triton: tested on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from rapidserve.config_base import ConfigError
from rapidserve.jsonfile import unknown_key, unknown_key_problem
from rapidserve.ops.table_files import read_table, read_tables

CONFIG_DIR = Path(__file__).resolve().parent / "fp8_configs"
MAX_ROWS = 64  # the most rows the skinny fp8 kernel takes (one row tile: BLOCK_M <= 64)
BLOCKS_M = (16, 32, 64)  # tl.dot needs >= 16; wgmma's instruction is 64 tall
BLOCKS_N = (16, 32, 64, 128, 256)
BLOCKS_K = (32, 64, 128, 256, 512, 1024)  # fp8 wgmma steps K by 32
WARPS = (1, 2, 4, 8, 16)
MAX_STAGES = 8
SPLITS_K = (1, 2, 3, 4, 6, 8, 12, 16)  # K slices a launch may take (1: one program a column tile, no reduce)
SCALED_MM = "scaled_mm"  # an entry that sends its rows to torch._scaled_mm
TILE_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SWAP")
OPTIONAL_FIELDS = {"split_k": 1}  # tile fields a file may leave out, with their defaults (files before split-K)
TOP_FIELDS = ("device_name", "source", "shapes")


class Fp8TableError(ConfigError):
    """A tuned fp8 tile table is malformed; the message names the file and the field."""


class Fp8Tiles(NamedTuple):
    """One launch of the skinny fp8 kernel: row tile, column tile, K step, warps, stages, operand order, and the K
    slices (`split_k` > 1: that many programs a column tile, each summing a slice of K into a float32 workspace that
    a second kernel adds up; triton_fp8_skinny)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap: bool = False
    split_k: int = 1

    def smem_bytes(self) -> int:
        """Shared memory of its pipelined fp8 operand tiles: stages x (BLOCK_M + BLOCK_N) x BLOCK_K bytes (Triton's
        own buffers on top are small)."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k

    def label(self) -> str:
        return (f"m{self.block_m} {self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"
                f"{' swap' if self.swap else ''}{f' split{self.split_k}' if self.split_k > 1 else ''}")


Entry = Fp8Tiles | str  # tiles, or SCALED_MM


@dataclass(frozen=True)
class Fp8Table:
    """One validated file: the device it was measured on and, per (N, K), its (rows, entry) in increasing rows."""

    device_name: str
    source: str
    shapes: Mapping[tuple[int, int], tuple[tuple[int, Entry], ...]]


Fp8Tables = Mapping[str, Fp8Table]  # by device name


def lookup(tables: Fp8Tables, device_name: str, n: int, k: int, rows: int) -> Entry | None:
    """The entry for `rows` rows of an [n, k] weight on `device_name`: the smallest key >= rows of its shape's table,
    None where no table covers it (no file for the device, no such shape, or more rows than its largest key)."""
    table = tables.get(device_name)
    entries = table.shapes.get((n, k)) if table is not None else None
    for key, entry in entries or ():
        if rows <= key:
            return entry
    return None


def file_name(device_name: str) -> str:
    return f"device_name={device_name.replace(' ', '_')}.json"


def _fail(path: str, field: str, problem: str) -> Fp8TableError:
    return Fp8TableError(f"{path}: {field}: {problem}")


def _only(d: object, fields: tuple[str, ...], path: str, where: str,
          optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    if not isinstance(d, dict):
        raise _fail(path, where.rstrip(".") or "the file", f"must be a JSON object, got {type(d).__name__}")
    extra = unknown_key(d, (*fields, *optional))
    if extra is not None:
        raise _fail(path, f"{where}{extra}", unknown_key_problem(extra, (*fields, *optional), where))
    missing = [f for f in fields if f not in d]
    if missing:
        raise _fail(path, f"{where}{missing[0]}", "missing")
    return d


def _int(d: Mapping[str, Any], name: str, path: str, where: str, allowed: tuple[int, ...]) -> int:
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, int) or v not in allowed:
        raise _fail(path, f"{where}{name}", f"must be one of {list(allowed)}, got {v!r}")
    return v


def parse_tiles(d: object, path: str, where: str) -> Fp8Tiles:
    d = {**OPTIONAL_FIELDS, **_only(d, TILE_FIELDS, path, where, tuple(OPTIONAL_FIELDS))}
    if not isinstance(d["SWAP"], bool):
        raise _fail(path, f"{where}SWAP", f"must be true or false, got {d['SWAP']!r}")
    return Fp8Tiles(_int(d, "BLOCK_M", path, where, BLOCKS_M), _int(d, "BLOCK_N", path, where, BLOCKS_N),
                    _int(d, "BLOCK_K", path, where, BLOCKS_K), _int(d, "num_warps", path, where, WARPS),
                    _int(d, "num_stages", path, where, tuple(range(1, MAX_STAGES + 1))), d["SWAP"],
                    _int(d, "split_k", path, where, SPLITS_K))


def _shape_key(name: str, path: str) -> tuple[int, int]:
    parts = name.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise _fail(path, f"shapes.{name}", "the key must be the weight's 'NxK' (two positive integers)")
    return int(parts[0]), int(parts[1])


def parse_table(d: object, path: str) -> Fp8Table:
    """A table from a file's parsed JSON (module docstring), every field checked; `path` names it in errors."""
    d = _only(d, TOP_FIELDS, path, "")
    dev, source, shapes = d["device_name"], d["source"], d["shapes"]
    if not isinstance(dev, str) or not dev.strip():
        raise _fail(path, "device_name", f"must be a non-empty string (torch.cuda.get_device_name), got {dev!r}")
    if Path(path).name != file_name(dev):
        raise _fail(path, "the file name", f"must be {file_name(dev)!r} (from its device_name)")
    if not isinstance(source, str):
        raise _fail(path, "source", f"must be a string, got {source!r}")
    if not isinstance(shapes, dict) or not shapes:
        raise _fail(path, "shapes", "must be a non-empty object of 'NxK' -> {rows: entry}")
    out: dict[tuple[int, int], tuple[tuple[int, Entry], ...]] = {}
    for name, by_rows in shapes.items():
        shape = _shape_key(name, path)
        if not isinstance(by_rows, dict) or not by_rows:
            raise _fail(path, f"shapes.{name}", "must be a non-empty object of rows -> entry")
        entries: list[tuple[int, Entry]] = []
        for key, entry in by_rows.items():
            where = f"shapes.{name}.{key}"
            if not (key.isdigit() and 1 <= int(key) <= MAX_ROWS):
                raise _fail(path, where, f"the key must be a row count in 1..{MAX_ROWS}")
            rows = int(key)
            if entry == SCALED_MM:
                entries.append((rows, SCALED_MM))
                continue
            if isinstance(entry, str):
                raise _fail(path, where, f"must be tiles or {SCALED_MM!r}, got {entry!r}")
            tiles = parse_tiles(entry, path, where + ".")
            if tiles.block_m < rows:
                raise _fail(path, where + ".BLOCK_M", f"must hold the key's {rows} rows, got {tiles.block_m}")
            entries.append((rows, tiles))
        out[shape] = tuple(sorted(entries, key=lambda e: e[0]))
    return Fp8Table(dev, source, MappingProxyType(out))


def tiles_json(t: Fp8Tiles) -> dict[str, Any]:
    """The file's fields of `t`; split_k only where it is not 1 (so a table without split-K reads as before)."""
    return {**dict(zip(TILE_FIELDS, t[:len(TILE_FIELDS)], strict=True)),
            **({"split_k": t.split_k} if t.split_k != 1 else {})}


def table_json(table: Fp8Table) -> dict[str, Any]:
    """The file's content of `table` (what `parse_table` reads back)."""
    return {"device_name": table.device_name, "source": table.source,
            "shapes": {f"{n}x{k}": {str(r): e if isinstance(e, str) else tiles_json(e) for r, e in entries}
                       for (n, k), entries in table.shapes.items()}}


def load_table(path: Path) -> Fp8Table:
    return read_table(path, parse_table, _fail)


def load_tables(directory: Path = CONFIG_DIR) -> Fp8Tables:
    """Every `*.json` table under `directory` (none if it does not exist), validated, by device name; read-only."""
    return read_tables(directory, load_table, lambda t: t.device_name)


__all__ = ["CONFIG_DIR", "MAX_ROWS", "SCALED_MM", "SPLITS_K", "Entry", "Fp8Table", "Fp8TableError", "Fp8Tables",
           "Fp8Tiles", "file_name", "load_table", "load_tables", "lookup", "parse_table", "parse_tiles", "table_json",
           "tiles_json"]
