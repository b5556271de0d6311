"""Tiles of the fused MoE grouped GEMMs (`ops/triton_moe.py`, issue 40): the untuned rule, and tuned tables as data.

A tuned table is one JSON file per (device, E, N, K, dtype) in `rapidserve/ops/moe_configs/` (written by
`bench/moe_tune.py` on the device it names; vLLM's fused_moe config files are the model), named
``E={E},N={N},K={K},device_name={device, spaces as _},dtype={dtype}.json`` and holding::

    {"device_name": "NVIDIA H200", "E": 128, "N": 768, "K": 2048, "dtype": "bfloat16",
     "source": "free text: what measured it, when",
     "configs": {"<pairs per expert>": {"BLOCK_M": 16, ["TAIL_BLOCK_M": 16,]
                                        "gate_up": {"BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1,
                                                    "num_warps": 4, "num_stages": 4},
                                        "down": {...the same fields, "SPLIT_K": 2}}, ...}}

E: experts; N: one rank's intermediate size I (w13 [E, 2N, K], w2 [E, K, N]); K: the hidden size; dtype: the
activations' and weights' torch dtype name. `gate_up` tiles the [pairs, K] x [K, N] gate and up products (two
accumulators of BLOCK_N), `down` the [pairs, N] x [N, K] one; BLOCK_M (the alignment's run padding) is shared.
GROUP_M: how many m blocks a group of programs walks before the next n block (`_program_tile`'s L2 swizzle); at least
the m-block count means m blocks fastest. SPLIT_K (optional, default 1: one program a tile, as before the field):
the most programs a tile's K range is cut into, for decode's short grids (8 experts x a few N blocks leave most SMs
idle); each split takes whole BLOCK_K steps, so fewer run where K has fewer steps (`split_plan` in triton_moe.py), and
the table may not ask for more splits than the GEMM has K steps (gate_up's K is the file's K, down's is its N). TMA
(optional, default 0): 1 reads the expert weights (the B operand, dense per expert) through a TMA tensor descriptor
on NVIDIA GPUs of compute capability 9.0 and later, where the rows allow it (16-byte aligned; else, and on ROCm, the
pointer loads). PERSISTENT (optional, default 0: one program a tile): n > 0 launches n programs an SM (at most the
tiles), each looping over the tiles the alignment filled (`triton_moe_grid.py`); it needs SPLIT_K 1. REDUCE_N
(optional, down only, default 0: the rule `triton_moe_gemm.reduce_width`): the columns of the tile the top-k sum
loads at a time, a power of two up to BLOCK_N (fewer registers, one more round of loads a chunk). TAIL_BLOCK_M
(optional, next to BLOCK_M, shared by both GEMMs; default 0: none): the alignment pads each expert's run to this
smaller block only, and each GEMM runs in two launches on its tiles, every expert's full BLOCK_M tiles, then the
rest of its rows (fewer than BLOCK_M) in blocks of TAIL_BLOCK_M (`ops.moe.TailBlocks`): an expert pads at most
TAIL_BLOCK_M - 1 rows instead of BLOCK_M - 1 (prefill, where BLOCK_M 64-128 tiles leave a mostly empty last tile an
expert); one of `TAIL_BLOCKS`, below BLOCK_M (0 written out: none, as the other optional fields' defaults). A file
writes these five fields only where they are not their defaults. A key is the pairs per expert it was tuned at (T *
top_k / E, a decimal number, fractions at decode); a call takes the key nearest its own pairs per expert on a log scale
(`pick_bucket`), the smaller on a tie. Every file is validated when the tables load (`load_tables`, at the import of
`triton_moe`): a bad one raises `MoeTableError` naming the file and the field. A shape no table covers gets
`rule_config`, the rule the kernels had before any tuning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from rapidserve.config_base import ConfigError
from rapidserve.jsonfile import unknown_key, unknown_key_problem
from rapidserve.ops.table_files import read_table, read_tables

CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"
BLOCKS = (16, 32, 64, 128, 256)  # allowed BLOCK_M, BLOCK_N, BLOCK_K (tl.dot needs >= 16; powers of two)
WARPS = (1, 2, 4, 8, 16)
MAX_STAGES = 8
MAX_GROUP_M = 1 << 16
ALL_M = MAX_GROUP_M  # GROUP_M that puts every m block in one group: m blocks fastest (the order before tuning)
DTYPES = ("bfloat16", "float16", "float32")
MAX_SPLIT_K = 16
MAX_PERSISTENT = 8  # programs an SM of a persistent grid (PERSISTENT)
TAIL_BLOCKS = (16, 32, 64)  # allowed TAIL_BLOCK_M (below BLOCK_M: it divides it)
TILE_FIELDS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SPLIT_K", "TMA", "PERSISTENT", "REDUCE_N")
OPTIONAL_FIELDS = MappingProxyType({"SPLIT_K": 1, "TMA": 0, "PERSISTENT": 0, "REDUCE_N": 0})  # written where not these
TOP_FIELDS = ("device_name", "E", "N", "K", "dtype", "source", "configs")


class MoeTableError(ConfigError):
    """A tuned MoE table is malformed; the message names the file and the field."""


class GemmTiles(NamedTuple):
    """One grouped GEMM's launch: its N and K tiles, the swizzle group, warps and pipeline stages, the most
    programs one tile's K range is split into (1: none), whether the expert weights come by TMA (1) or by pointer
    loads (0), the programs an SM of a persistent grid (0: one program a tile), and (down) the columns its top-k sum
    takes at a time (0: the rule, `triton_moe_gemm.reduce_width`)."""

    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    tma: int = 0
    persistent: int = 0
    reduce_n: int = 0


class MoeKernelConfig(NamedTuple):
    """BLOCK_M (shared: the alignment pads each expert's run to it) and each GEMM's tiles; `tail_m` (TAIL_BLOCK_M,
    0: none) the block the alignment pads to instead, the rows past an expert's full BLOCK_M tiles run by a second
    launch of each GEMM (module docstring)."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles
    tail_m: int = 0

    @property
    def align_m(self) -> int:
        """The block each expert's run is padded to: TAIL_BLOCK_M where set, else BLOCK_M."""
        return self.tail_m or self.block_m

    @classmethod
    def same(cls, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
             group_m: int = ALL_M) -> MoeKernelConfig:
        """Both GEMMs on the same tiles."""
        tiles = GemmTiles(block_n, block_k, group_m, num_warps, num_stages)
        return cls(block_m, tiles, tiles)


class TableKey(NamedTuple):
    device_name: str
    num_experts: int
    n: int
    k: int
    dtype: str


@dataclass(frozen=True)
class MoeTable:
    """One validated file: its key and (pairs per expert, config) buckets in increasing order."""

    key: TableKey
    source: str
    buckets: tuple[tuple[float, MoeKernelConfig], ...]


MoeTables = Mapping[TableKey, MoeTable]


def rule_config(pairs: int, num_experts: int, hip: bool) -> MoeKernelConfig:
    """The untuned rule: BLOCK_M near the pairs an expert gets on average (decode's runs are a few rows, prefill's
    fill 64-row tiles), both GEMMs on the same tiles, m blocks fastest."""
    per_expert = pairs / num_experts
    stages = 2 if hip else 3
    if per_expert <= 16:
        # ROCm: K steps of 64, as the larger tiles'; 128 took 36 KiB of LDS (the gate and up tiles, two stages), one
        # 4-wave workgroup a gfx942 CU: 1 wave a SIMD (bench/amd_compile_check.py); 64 halves it
        return MoeKernelConfig.same(16, 64, 64 if hip else 128, 4, stages)
    if per_expert <= 48:
        return MoeKernelConfig.same(32, 64, 64, 4, stages)
    return MoeKernelConfig.same(64, 128, 64, 8, stages)


def pick_bucket(keys: Sequence[float], per_expert: float) -> int:
    """Index of the key (increasing, positive) nearest `per_expert` on a log scale, the smaller on a tie; below
    the first key the first, above the last the last."""
    if not keys:
        raise ValueError("no buckets to pick from")
    x = math.log2(max(per_expert, 1e-9))
    best = 0
    for i, key in enumerate(keys):
        if abs(math.log2(key) - x) < abs(math.log2(keys[best]) - x):
            best = i
    return best


def lookup(tables: MoeTables, key: TableKey, pairs: int, hip: bool) -> MoeKernelConfig:
    """The tuned config of `pairs` pairs for `key`'s shape, or `rule_config` where no table covers it."""
    table = tables.get(key)
    if table is None:
        return rule_config(pairs, key.num_experts, hip)
    keys = [b for b, _ in table.buckets]
    return table.buckets[pick_bucket(keys, pairs / key.num_experts)][1]


def file_name(key: TableKey) -> str:
    dev = key.device_name.replace(" ", "_")
    return f"E={key.num_experts},N={key.n},K={key.k},device_name={dev},dtype={key.dtype}.json"


def _fail(path: str, field: str, problem: str) -> MoeTableError:
    return MoeTableError(f"{path}: {field}: {problem}")


def _int(d: Mapping[str, Any], name: str, path: str, where: str, allowed: Sequence[int] | None = None,
         lo: int = 1, hi: int = 1 << 31) -> int:
    if name not in d:
        raise _fail(path, f"{where}{name}", "missing")
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(path, f"{where}{name}", f"must be an integer, got {v!r}")
    if allowed is not None and v not in allowed:
        raise _fail(path, f"{where}{name}", f"must be one of {list(allowed)}, got {v}")
    if not lo <= v <= hi:
        raise _fail(path, f"{where}{name}", f"must be in [{lo}, {hi}], got {v}")
    return v


def _only(d: object, fields: Sequence[str], path: str, where: str) -> Mapping[str, Any]:
    if not isinstance(d, dict):
        raise _fail(path, where.rstrip(".") or "the file", f"must be a JSON object, got {type(d).__name__}")
    extra = unknown_key(d, fields)
    if extra is not None:
        raise _fail(path, f"{where}{extra}", unknown_key_problem(extra, fields, where))
    return d


def parse_tiles(d: object, path: str, where: str, k: int) -> GemmTiles:
    """One GEMM's tiles; `k`: the GEMM's K (its SPLIT_K may not exceed its K steps)."""
    d = _only(d, TILE_FIELDS, path, where)
    tiles = GemmTiles(_int(d, "BLOCK_N", path, where, BLOCKS), _int(d, "BLOCK_K", path, where, BLOCKS),
                      _int(d, "GROUP_M", path, where, hi=MAX_GROUP_M), _int(d, "num_warps", path, where, WARPS),
                      _int(d, "num_stages", path, where, hi=MAX_STAGES),
                      _int(d, "SPLIT_K", path, where, hi=MAX_SPLIT_K) if "SPLIT_K" in d else 1,
                      _int(d, "TMA", path, where, (0, 1), lo=0) if "TMA" in d else 0,
                      _int(d, "PERSISTENT", path, where, lo=0, hi=MAX_PERSISTENT) if "PERSISTENT" in d else 0,
                      _int(d, "REDUCE_N", path, where, (0, *BLOCKS), lo=0) if "REDUCE_N" in d else 0)
    steps = -(-k // tiles.block_k)
    if tiles.split_k > steps:
        raise _fail(path, f"{where}SPLIT_K", f"must be at most {steps} (K = {k} is {steps} steps of BLOCK_K "
                    f"{tiles.block_k}; each split takes at least one), got {tiles.split_k}")
    if tiles.reduce_n > tiles.block_n:
        raise _fail(path, f"{where}REDUCE_N", f"must be at most BLOCK_N {tiles.block_n} (0: the rule), got "
                    f"{tiles.reduce_n}")
    if tiles.persistent and tiles.split_k > 1:
        raise _fail(path, f"{where}PERSISTENT", f"a persistent grid takes whole tiles: SPLIT_K must be 1 with it, "
                    f"got SPLIT_K {tiles.split_k} (drop one of the two fields)")
    return tiles


def parse_table(d: object, path: str) -> MoeTable:
    """A table from a file's parsed JSON (module docstring), every field checked; `path` names it in errors."""
    d = _only(d, TOP_FIELDS, path, "")
    for name in TOP_FIELDS:
        if name not in d:
            raise _fail(path, name, "missing")
    dev, dtype, source = d["device_name"], d["dtype"], d["source"]
    if not isinstance(dev, str) or not dev.strip():
        raise _fail(path, "device_name", f"must be a non-empty string (torch.cuda.get_device_name), got {dev!r}")
    if dtype not in DTYPES:
        raise _fail(path, "dtype", f"must be one of {list(DTYPES)}, got {dtype!r}")
    if not isinstance(source, str):
        raise _fail(path, "source", f"must be a string, got {source!r}")
    key = TableKey(dev, _int(d, "E", path, ""), _int(d, "N", path, ""), _int(d, "K", path, ""), dtype)
    if Path(path).name != file_name(key):
        raise _fail(path, "the file name", f"must be {file_name(key)!r} (from its device_name, E, N, K and dtype)")
    configs = d["configs"]
    if not isinstance(configs, dict) or not configs:
        raise _fail(path, "configs", "must be a non-empty object of pairs per expert -> config")
    buckets: list[tuple[float, MoeKernelConfig]] = []
    for name, c in configs.items():
        try:
            per_expert = float(name)
        except ValueError:
            per_expert = math.nan
        if not (math.isfinite(per_expert) and per_expert > 0):
            raise _fail(path, f"configs.{name}", "the key must be a positive number (pairs per expert)")
        where = f"configs.{name}."
        c = _only(c, ("BLOCK_M", "TAIL_BLOCK_M", "gate_up", "down"), path, where)
        for part in ("gate_up", "down"):
            if part not in c:
                raise _fail(path, where + part, "missing")
        gate_up = parse_tiles(c["gate_up"], path, where + "gate_up.", key.k)
        if gate_up.reduce_n:
            raise _fail(path, where + "gate_up.REDUCE_N", "is down's (its top-k sum): leave it out of gate_up")
        block_m = _int(c, "BLOCK_M", path, where, BLOCKS)
        tail_m = _int(c, "TAIL_BLOCK_M", path, where, (0, *TAIL_BLOCKS), lo=0) if "TAIL_BLOCK_M" in c else 0
        if tail_m >= block_m:
            raise _fail(path, where + "TAIL_BLOCK_M", f"must be below BLOCK_M {block_m} (the block of the rows past "
                        f"an expert's full BLOCK_M tiles; leave it out or 0 for none), got {tail_m}")
        buckets.append((per_expert, MoeKernelConfig(block_m, gate_up, parse_tiles(c["down"], path, where + "down.",
                                                                                   key.n), tail_m)))
    buckets.sort(key=lambda b: b[0])
    for (a, _), (b, _) in zip(buckets, buckets[1:], strict=False):
        if a == b:
            raise _fail(path, "configs", f"two keys name {a} pairs per expert")
    return MoeTable(key, source, tuple(buckets))


def tiles_json(t: GemmTiles) -> dict[str, int]:
    """One GEMM's tiles as a file holds them: SPLIT_K, TMA and PERSISTENT only where they are not their defaults
    (`OPTIONAL_FIELDS`: a file without them means those)."""
    return {f: v for f, v in zip(TILE_FIELDS, t, strict=True) if OPTIONAL_FIELDS.get(f) != v}


def config_json(c: MoeKernelConfig) -> dict[str, Any]:
    """One bucket's config as a file holds it (TAIL_BLOCK_M only where set)."""
    tail = {"TAIL_BLOCK_M": c.tail_m} if c.tail_m else {}
    return {"BLOCK_M": c.block_m, **tail, "gate_up": tiles_json(c.gate_up), "down": tiles_json(c.down)}


def table_json(table: MoeTable) -> dict[str, Any]:
    """The file's content of `table` (what `parse_table` reads back)."""
    k = table.key
    return {"device_name": k.device_name, "E": k.num_experts, "N": k.n, "K": k.k, "dtype": k.dtype,
            "source": table.source, "configs": {f"{b:g}": config_json(c) for b, c in table.buckets}}


def load_table(path: Path) -> MoeTable:
    return read_table(path, parse_table, _fail)


def load_tables(directory: Path = CONFIG_DIR) -> MoeTables:
    """Every `*.json` table under `directory` (none if it does not exist), validated, by key; read-only."""
    return read_tables(directory, load_table, lambda t: t.key)
