"""The fused MoE kernels' tiles as data (issue 40, rapidserve/ops/moe_tiles.py): the bucket lookup as a pure function,
tuned tables against the rule, and the validation of table files (good, bad, missing), on CPU without Triton."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rapidserve.ops.moe_tiles import (
    ALL_M,
    CONFIG_DIR,
    GemmTiles,
    MoeKernelConfig,
    MoeTable,
    MoeTableError,
    TableKey,
    file_name,
    load_table,
    load_tables,
    lookup,
    pick_bucket,
    rule_config,
    table_json,
)

KEY = TableKey("NVIDIA H200", 128, 768, 2048, "bfloat16")
SMALL = MoeKernelConfig(16, GemmTiles(32, 128, 1, 4, 4), GemmTiles(64, 128, 1, 4, 4))
MID = MoeKernelConfig(32, GemmTiles(64, 64, 8, 4, 4), GemmTiles(128, 64, 8, 4, 3))
BIG = MoeKernelConfig(128, GemmTiles(128, 64, 32, 8, 3), GemmTiles(256, 64, ALL_M, 8, 4))
TABLE = MoeTable(KEY, "test", ((0.0625, SMALL), (4.0, MID), (512.0, BIG)))


@pytest.mark.parametrize(("keys", "per_expert", "want"), [
    ((1.0,), 0.001, 0), ((1.0,), 1e6, 0),  # one bucket serves everything
    ((0.0625, 4.0, 512.0), 0.01, 0),  # below the first: the first
    ((0.0625, 4.0, 512.0), 0.0625, 0),
    ((0.0625, 4.0, 512.0), 0.49, 0),  # log2: 0.49 is nearer 0.0625 (3 octaves) than 4 (3.03)
    ((0.0625, 4.0, 512.0), 0.51, 1),
    ((0.0625, 4.0, 512.0), 0.5, 0),  # exactly between on a log scale: the smaller
    ((0.0625, 4.0, 512.0), 45.0, 1), ((0.0625, 4.0, 512.0), 46.0, 2),  # sqrt(4 * 512) = 45.25
    ((0.0625, 4.0, 512.0), 1e5, 2),  # above the last: the last
    ((1.0, 2.0, 4.0, 8.0), 3.0, 2),  # 3 is nearer 4 than 2 on a log scale (0.415 vs 0.585)
    ((1.0, 2.0, 4.0, 8.0), 0.0, 0),  # no pairs (never called so, but defined)
])
def test_pick_bucket(keys: tuple[float, ...], per_expert: float, want: int) -> None:
    assert pick_bucket(keys, per_expert) == want


def test_pick_bucket_needs_keys() -> None:
    with pytest.raises(ValueError, match="no buckets"):
        pick_bucket((), 1.0)


@pytest.mark.parametrize(("key", "pairs", "hip", "want"), [
    (KEY, 8, False, SMALL),  # decode batch 1 of Qwen3-30B-A3B: 8 / 128 pairs per expert
    (KEY, 512, False, MID),  # 4 per expert
    (KEY, 65536, False, BIG),  # 512 per expert
    (KEY, 65536, True, BIG),  # a table is per device: ROCm's rule does not apply to it
    (KEY._replace(device_name="NVIDIA H100 80GB HBM3"), 8, False, rule_config(8, 128, False)),  # another GPU
    (KEY._replace(n=384), 512, True, rule_config(512, 128, True)),  # another TP slice, on ROCm
    (KEY._replace(dtype="float16"), 65536, False, rule_config(65536, 128, False)),
])
def test_lookup_takes_the_table_else_the_rule(key: TableKey, pairs: int, hip: bool, want: MoeKernelConfig) -> None:
    assert lookup({KEY: TABLE}, key, pairs, hip) == want


def write(folder: Path, d: dict[str, Any], name: str | None = None) -> Path:
    path = folder / (name or file_name(KEY))
    path.write_text(json.dumps(d))
    return path


def test_a_table_round_trips_through_its_file(tmp_path: Path) -> None:
    path = write(tmp_path, table_json(TABLE))
    assert path.name == "E=128,N=768,K=2048,device_name=NVIDIA_H200,dtype=bfloat16.json"
    assert load_table(path) == TABLE
    assert dict(load_tables(tmp_path)) == {KEY: TABLE}
    assert dict(load_tables(tmp_path / "absent")) == {}


def test_split_k_is_optional_and_written_only_where_set(tmp_path: Path) -> None:
    """SPLIT_K (issue 40: decode's short grids): absent means 1, so today's files mean what they meant; a table with
    splits round-trips, and only the split GEMMs' objects carry the field."""
    split = MoeKernelConfig(16, GemmTiles(64, 128, 1, 4, 4, 4), GemmTiles(128, 128, 8, 4, 4))
    table = MoeTable(KEY, "test", ((0.0625, split), (4.0, MID)))
    d = table_json(table)
    assert d["configs"]["0.0625"]["gate_up"]["SPLIT_K"] == 4 and "SPLIT_K" not in d["configs"]["0.0625"]["down"]
    assert load_table(write(tmp_path, d)) == table
    assert GemmTiles(64, 128, 1, 4, 4).split_k == 1


def test_tma_persistent_reduce_n_are_optional_and_written_only_where_set(tmp_path: Path) -> None:
    """TMA, PERSISTENT and REDUCE_N (ops/triton_moe_gemm.py's prefill variants): absent means 0 (pointer loads, one
    program a tile, the top-k sum's rule), so today's files mean what they meant; set, they round-trip, written only
    on the GEMMs that set them."""
    pre = MoeKernelConfig(64, GemmTiles(128, 64, 8, 4, 4, 1, 1, 1), GemmTiles(256, 64, 1, 8, 4, 1, 0, 2, 128))
    table = MoeTable(KEY, "test", ((4.0, MID), (64.0, pre)))
    d = table_json(table)
    gate_up, down = d["configs"]["64"]["gate_up"], d["configs"]["64"]["down"]
    assert (gate_up["TMA"], gate_up["PERSISTENT"], down["PERSISTENT"], down["REDUCE_N"]) == (1, 1, 2, 128)
    assert "TMA" not in down and "REDUCE_N" not in gate_up
    assert not {"TMA", "PERSISTENT", "SPLIT_K", "REDUCE_N"} & set(d["configs"]["4"]["gate_up"])
    assert load_table(write(tmp_path, d)) == table
    assert GemmTiles(64, 128, 1, 4, 4)[6:] == (0, 0, 0)


def test_tail_block_m_is_optional_and_written_only_where_set(tmp_path: Path) -> None:
    """TAIL_BLOCK_M (the tail blocks' second launch, `ops.moe.TailBlocks`): absent means none (0, the alignment at
    BLOCK_M), so today's files mean what they meant; set, it round-trips next to BLOCK_M, on that bucket only."""
    tail = BIG._replace(tail_m=16)
    table = MoeTable(KEY, "test", ((4.0, MID), (512.0, tail)))
    d = table_json(table)
    assert d["configs"]["512"]["TAIL_BLOCK_M"] == 16 and "TAIL_BLOCK_M" not in d["configs"]["4"]
    assert list(d["configs"]["512"])[:2] == ["BLOCK_M", "TAIL_BLOCK_M"]
    assert load_table(write(tmp_path, d)) == table
    assert (MID.tail_m, MID.align_m, tail.align_m) == (0, 32, 16)
    d["configs"]["4"]["TAIL_BLOCK_M"] = 0  # the default written out means none, as TMA / PERSISTENT / REDUCE_N 0 do
    assert load_table(write(tmp_path, d)) == table


def test_the_packaged_tables_load() -> None:
    """Whatever tables ship (bench/moe_tune.py --write-repo) validate, each named for its key."""
    tables = load_tables(CONFIG_DIR)
    for key, table in tables.items():
        assert (CONFIG_DIR / file_name(key)).is_file() and table.buckets


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """A mutation of the table's JSON: `path` (dot-separated) set to `value`, or deleted when value is DEL."""
    def apply(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        if value is DEL:
            del d[last]
        else:
            d[last] = value
    return apply


DEL = object()


@pytest.mark.parametrize(("mutate", "match"), [
    (_set("configs.4.gate_up.BLOCK_N", 48), r"configs\.4\.gate_up\.BLOCK_N: must be one of \[16, 32, 64, 128, 256\]"),
    (_set("configs.4.down.num_warps", 3), r"configs\.4\.down\.num_warps: must be one of \[1, 2, 4, 8, 16\]"),
    (_set("configs.4.down.num_stages", 0), r"configs\.4\.down\.num_stages: must be in \[1, 8\], got 0"),
    (_set("configs.4.gate_up.GROUP_M", 1.5), r"configs\.4\.gate_up\.GROUP_M: must be an integer, got 1\.5"),
    (_set("configs.4.gate_up.GROUP_M", True), r"GROUP_M: must be an integer, got True"),
    (_set("configs.4.BLOCK_M", 8), r"configs\.4\.BLOCK_M: must be one of"),
    (_set("configs.4.down.BLOCK_K", DEL), r"configs\.4\.down\.BLOCK_K: missing"),
    (_set("configs.4.down", DEL), r"configs\.4\.down: missing"),
    (_set("configs.4.gate_up.split_k", 2), r"configs\.4\.gate_up\.split_k: unknown field \"split_k\" in the object "
                                           r"at `configs\.4\.gate_up` \(allowed: BLOCK_N, .*\); did you mean "
                                           r"\"SPLIT_K\"\?"),
    (_set("configs.4.gate_up.SPLIT_K", 0), r"configs\.4\.gate_up\.SPLIT_K: must be in \[1, 16\], got 0"),
    (_set("configs.4.gate_up.SPLIT_K", 2.0), r"configs\.4\.gate_up\.SPLIT_K: must be an integer, got 2\.0"),
    (_set("configs.4.gate_up.SPLIT_K", 17), r"configs\.4\.gate_up\.SPLIT_K: must be in \[1, 16\], got 17"),
    # gate|up's K is the file's K (2048: 32 steps of MID's BLOCK_K 64), down's its N (768: 12 steps of 64)
    (_set("configs.4.down.SPLIT_K", 13), r"configs\.4\.down\.SPLIT_K: must be at most 12 \(K = 768 is 12 steps of "
                                         r"BLOCK_K 64; each split takes at least one\), got 13"),
    (_set("configs.4.gate_up.TMA", 2), r"configs\.4\.gate_up\.TMA: must be one of \[0, 1\], got 2"),
    (_set("configs.4.gate_up.TMA", True), r"configs\.4\.gate_up\.TMA: must be an integer, got True"),
    (_set("configs.4.down.PERSISTENT", -1), r"configs\.4\.down\.PERSISTENT: must be in \[0, 8\], got -1"),
    (_set("configs.4.down.PERSISTENT", 9), r"configs\.4\.down\.PERSISTENT: must be in \[0, 8\], got 9"),
    (lambda d: d["configs"]["4"]["down"].update(SPLIT_K=2, PERSISTENT=1),
     r"configs\.4\.down\.PERSISTENT: a persistent grid takes whole tiles: SPLIT_K must be 1 with it, got SPLIT_K 2"),
    (_set("configs.4.down.REDUCE_N", 48), r"configs\.4\.down\.REDUCE_N: must be one of \[0, 16, 32, 64, 128, 256\]"),
    (_set("configs.4.down.REDUCE_N", 256), r"configs\.4\.down\.REDUCE_N: must be at most BLOCK_N 128 \(0: the rule\)"),
    (_set("configs.4.gate_up.REDUCE_N", 32), r"configs\.4\.gate_up\.REDUCE_N: is down's \(its top-k sum\)"),
    (_set("configs.4.TAIL_BLOCK_M", 8), r"configs\.4\.TAIL_BLOCK_M: must be one of \[0, 16, 32, 64\], got 8"),
    (_set("configs.4.TAIL_BLOCK_M", 24), r"configs\.4\.TAIL_BLOCK_M: must be one of \[0, 16, 32, 64\], got 24"),
    (_set("configs.4.TAIL_BLOCK_M", 32), r"configs\.4\.TAIL_BLOCK_M: must be below BLOCK_M 32 .*got 32"),
    (_set("configs.4.TAIL_BLOCK_M", 64), r"configs\.4\.TAIL_BLOCK_M: must be below BLOCK_M 32 .*got 64"),
    (_set("configs.4.TAIL_BLOCK_M", "16"), r"configs\.4\.TAIL_BLOCK_M: must be an integer, got '16'"),
    (_set("configs.4.TAIL_BLOCK_M", True), r"configs\.4\.TAIL_BLOCK_M: must be an integer, got True"),
    (_set("configs.4.gate_up.TAIL_BLOCK_M", 16), r"configs\.4\.gate_up\.TAIL_BLOCK_M: unknown field"),
    (_set("configs.4.gate_up", [64, 64]), r"configs\.4\.gate_up: must be a JSON object, got list"),
    (_set("configs.4.extra", 1), r"configs\.4\.extra: unknown field"),
    (_set("configs.-1", table_json(TABLE)["configs"]["4"]), r"configs\.-1: the key must be a positive number"),
    (_set("configs.many", table_json(TABLE)["configs"]["4"]), r"configs\.many: the key must be a positive number"),
    (_set("configs.4e0", table_json(TABLE)["configs"]["4"]), r"configs: two keys name 4\.0 pairs per expert"),
    (_set("configs", {}), r"configs: must be a non-empty object"),
    (_set("dtype", "fp8"), r"dtype: must be one of \['bfloat16', 'float16', 'float32'\], got 'fp8'"),
    (_set("device_name", ""), r"device_name: must be a non-empty string"),
    (_set("E", "128"), r"E: must be an integer"),
    (_set("K", DEL), r"K: missing"),
    (_set("source", 3), r"source: must be a string"),
    (_set("tuned_on", "x"), r"tuned_on: unknown field"),
    (_set("N", 384), r"the file name: must be 'E=128,N=384,K=2048,device_name=NVIDIA_H200,dtype=bfloat16\.json'"),
])
def test_a_bad_table_names_its_file_and_field(tmp_path: Path, mutate: Callable[[dict[str, Any]], None],
                                              match: str) -> None:
    d = table_json(TABLE)
    mutate(d)
    path = write(tmp_path, d)
    with pytest.raises(MoeTableError, match=match) as err:
        load_tables(tmp_path)
    assert str(err.value).startswith(str(path) + ": ")


@pytest.mark.parametrize(("text", "match"), [("{", "the file: is not JSON"), ("[]", "the file: must be a JSON object")])
def test_a_file_that_is_no_table(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / file_name(KEY)).write_text(text)
    with pytest.raises(MoeTableError, match=match):
        load_tables(tmp_path)
