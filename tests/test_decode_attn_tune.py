"""bench/decode_attn_tune.py: its candidates and the choice of the table entry as pure functions (tables of made-up
timings), and the whole script end to end on the CPU under the Triton interpreter (--dry-run: tiny shapes, two tiles),
down to the entries it prints, which must be DecodeConfigs for DECODE_TABLE's keys."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from triton_interp import run_interpreted

from bench import decode_attn_tune as tune
from rapidserve.attention.decode_config import DECODE_TABLE, DecodeConfig

ROOT = Path(__file__).resolve().parent.parent


def test_tiles_hold_the_table_and_are_distinct() -> None:
    full, quick, dry = tune.tile_candidates(), tune.tile_candidates("quick"), tune.tile_candidates("dry")
    assert len(full) == 42 and len(set(full)) == 42 and set(quick) <= set(full) and len(dry) == 2
    for key, cfg in DECODE_TABLE.items():  # the sweep can find the table's own tile or better
        if key[:2] == ("cuda", "16-bit") and key[3] == "<=128":
            assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.prefetch) in full and (64, 4, 3, False) in quick
    for size in (full, quick, dry):  # both ways of loading the block table, in every list (the dry run's too)
        assert {pf for *_, pf in size} == {False, True}
    # with the prefetch, s stages keep s - 1 K/V buffers: 2-4; without it 4 compiles as 3 (one buffer), so 2, 3, 5
    assert {s for *_, s, pf in full if pf} == {2, 3, 4} and {s for *_, s, pf in full if not pf} == {2, 3, 5}


def test_fp8_candidates_time_both_dot_types() -> None:
    table = DecodeConfig(64, 4, 3, 2, True)
    model = tune.candidates(table, fp8=False, size="full")
    fp8 = tune.candidates(table, fp8=True, size="full")
    assert not any(c.fp16_dots for c in model) and len(model) == 42
    assert sum(c.fp16_dots for c in fp8) == 42
    assert {(c.block_n, c.num_warps, c.num_stages, c.prefetch) for c in fp8 if not c.fp16_dots} == {
        (64, 4, 3, False), (64, 8, 3, False), (128, 4, 3, False), (64, 4, 3, True)}
    assert all(c.waves == 2 for c in fp8) and len(set(fp8)) == len(fp8)


def _rows(times: dict[str, dict[str, float]]) -> list[dict[str, object]]:
    """Rows as the script writes them: key -> {shape: us}; a key's config is parsed back from the key's numbers."""
    out = []
    for key, per_shape in times.items():
        m = re.fullmatch(r"n(\d+) w(\d+) s(\d+) waves(\d+)( pf)?( f16)?", key)
        n, w, s, waves = (int(x) for x in m.groups()[:4]) if m else (64, 4, 3, 2)
        cfg = DecodeConfig(n, w, s, waves, key.endswith("f16"), " pf" in key)
        out += [{"key": key, "shape": shape, "us": us, "config": cfg._asdict()} for shape, us in per_shape.items()]
    return out


PICK_CASES = [
    # one configuration best everywhere
    ({"default": {"a": 10.0, "b": 20.0}, "n32 w4 s2 waves2": {"a": 8.0, "b": 16.0},
      "n64 w4 s3 waves4": {"a": 9.0, "b": 18.0}}, "n32 w4 s2 waves2", 1.0, 1.25),
    # a trade: 10% worse on a, 30% better on b wins on the geometric mean
    ({"default": {"a": 10.0, "b": 20.0}, "n128 w8 s3 waves2 pf f16": {"a": 11.0, "b": 14.0}},
     "n128 w8 s3 waves2 pf f16", math.sqrt(1.1), math.sqrt(20 / 14)),
    # a configuration that failed on a shape is not picked, however fast elsewhere (it still sets the shape's best);
    # the default never is
    ({"default": {"a": 5.0, "b": 5.0}, "n32 w2 s5 waves8": {"a": 1.0}, "n64 w2 s2 waves1": {"a": 6.0, "b": 6.0}},
     "n64 w2 s2 waves1", math.sqrt(6 * 1.2), math.sqrt(5)),
]


@pytest.mark.parametrize(("times", "key", "ratio", "default_ratio"), PICK_CASES, ids=["best", "trade", "partial"])
def test_pick_entry(times: dict[str, dict[str, float]], key: str, ratio: float, default_ratio: float) -> None:
    rows = _rows(times)
    picked = tune.pick_entry(rows, shapes=2)
    assert picked is not None
    cfg, got_ratio, got_default = picked
    assert cfg == DecodeConfig(**next(r["config"] for r in rows if r["key"] == key))  # type: ignore[arg-type]
    assert got_ratio == pytest.approx(ratio) and got_default == pytest.approx(default_ratio)


def test_pick_entry_needs_a_configuration_on_every_shape() -> None:
    assert tune.pick_entry(_rows({"default": {"a": 1.0, "b": 1.0}, "n32 w4 s2 waves2": {"a": 1.0}}), 2) is None


def test_dry_run_end_to_end(tmp_path: Path) -> None:
    """The script on the CPU: every row checked against the reference and timed, both caches, the page written,
    and each printed entry a DecodeConfig for its DECODE_TABLE key."""
    out = run_interpreted(str(ROOT / "bench" / "decode_attn_tune.py"), "--dry-run", "--out", str(tmp_path),
                          timeout=900)
    data = json.loads((tmp_path / "decode_attn_tune.json").read_text())
    assert {r["cache"] for r in data["rows"]} == {"float16", "float8_e4m3fn"}
    assert {r["stage"] for r in data["rows"]} == {"default", "tile", "waves"}
    assert all(r["us"] > 0 for r in data["rows"])
    entries = re.findall(r"    (\('cuda', [^)]*\)): (DecodeConfig\([^)]*\)),", out)
    assert len(entries) == 2 and out.endswith((tmp_path / "decode_attn_tune.md").read_text() + "\n")
    for key, cfg in entries:
        assert eval(key) in DECODE_TABLE and isinstance(eval(cfg, {"DecodeConfig": DecodeConfig}), DecodeConfig)
