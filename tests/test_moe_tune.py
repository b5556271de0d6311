"""bench/moe_tune.py (issue 40): its pruned tile space and the choice of the winner as pure functions, and the whole
script end to end on the CPU under the Triton interpreter (--dry-run: a tiny shape, two tiles a GEMM), down to
the tables it writes (read back as the engine reads them) and bench/moe_gemm.py's table printed last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from triton_interp import run_interpreted

from bench import moe_tune_space as space
from rapidserve.ops.moe_tiles import ALL_M, GemmTiles, MoeKernelConfig, TableKey, load_tables, rule_config

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [space.Shape("mixtral-8x7b", 1, 8, 14336, 4096, 2), space.Shape("mixtral-8x7b", 2, 8, 7168, 4096, 2),
          space.Shape("qwen3-30b-a3b", 1, 128, 768, 2048, 8), space.Shape("qwen3-30b-a3b", 2, 128, 384, 2048, 8)]


@pytest.mark.parametrize(("p", "want"), [(0.0625, (16,)), (4, (16,)), (4.5, (16, 32)), (12, (16, 32)),
                                         (16, (16, 32, 64)), (64, (32, 64, 128)), (512, (64, 128)),
                                         (2048, (64, 128))])
def test_block_m_candidates(p: float, want: tuple[int, ...]) -> None:
    assert space.block_m_candidates(p) == want
    assert space.block_m_candidates(p, quick=True) == (16,)


def test_the_space_fits_shared_memory_and_holds_the_rule() -> None:
    """Every candidate's stages fit one Hopper block's shared memory; the rule's own tiles are candidates at its
    BLOCK_M (so the sweep can only find the rule or better on the kernels' own timings)."""
    for bm in (16, 32, 64, 128):
        for tiles, products in ((space.gate_up_candidates(bm), 2), (space.down_candidates(bm), 1)):
            assert tiles and len(set(tiles)) == len(tiles)
            assert all(t.group_m == space.FIRST_GROUP for t in tiles)
            assert all(space.smem_bytes(bm, t.block_n, t.block_k, t.num_stages, products) <= space.SMEM_BYTES
                       for t in tiles)
    assert space.smem_bytes(64, 128, 128, 3, 2) > space.SMEM_BYTES  # such a tile is left out
    for pairs in (8, 256, 16384):
        rule = rule_config(pairs, 8, hip=False)
        assert space.with_group(rule.gate_up, space.FIRST_GROUP) in space.gate_up_candidates(rule.block_m)
        assert space.with_group(rule.down, space.FIRST_GROUP) in space.down_candidates(rule.block_m)


def test_the_sweep_size_stated_in_the_docstring() -> None:
    """bench/moe_tune.py's docstring: about 1000-1100 timed configurations a shape, 245 launch variants in all, 100 of
    them the tail candidates' (BLOCK_M 64 / 128 with TAIL_BLOCK_M: 720 / 688 and 145 before them; the split-K
    candidates at BLOCK_M 16, the down kernel's TOP_K, which its top-k sum made a constexpr, and 36 compiles of the
    TMA / persistent / REDUCE_N prefill candidates: 602 / 598 and 109 before those, 522 / 498 and 73 before split K)."""
    assert [space.space_size(s) for s in SHAPES] == [1128, 1128, 960, 960]
    assert len(space.compile_set(SHAPES)) == 245
    assert sum(1 for c in space.compile_set(SHAPES) if c[5]) == 100
    assert sum(1 for c in space.compile_set(SHAPES) if not c[5] and (c[3].tma or c[3].persistent or c[3].reduce_n)) \
        == 36
    assert sorted(space.TOKENS) == [2**i for i in range(14)]  # 1..8192


@pytest.mark.parametrize(("programs", "per_sm", "want"), [
    (132, 1, 1.0), (96, 2, 96 / 132), (192, 2, 192 / 264), (384, 2, 384 / 528), (384, 4, 384 / 396),
    (264, 2, 1.0), (265, 2, 265 / 528), (1000, 8, 1000 / 1056),
])
def test_grid_balance(programs: int, per_sm: int, want: float) -> None:
    """All resident: the SM with the most programs sets the time; else full waves of per_sm * 132."""
    assert space.grid_balance(programs, per_sm) == pytest.approx(want)


def test_decode_tiles_spread_over_the_sms() -> None:
    """At decode batches 1-8 of every tuned shape, BLOCK_M 16's candidates include a gate|up and a down tile whose
    programs spread over the SMs (`moe_tune_space.decode_balance`, K splits counted): at least 0.96 everywhere. Without
    the split-K candidates two grids stay short even at the smallest tiles: Qwen3 at tp 2 has 192 gate|up programs at
    batch 1 at BLOCK_N 16 (the least tl.dot takes), Mixtral at tp 2 112 column blocks of 128 at batch 1; and Qwen3 at
    tp 1, batch 1 had 0.73 before (16, 128, 4, 4) joined the list."""
    for s in SHAPES:
        for t in (1, 2, 4, 8):
            for gemm, cands in (("gate_up", space.gate_up_candidates(16)), ("down", space.down_candidates(16))):
                assert max(space.decode_balance(s, t, gemm, c) for c in cands) >= 0.96, (s, t, gemm)
    unsplit = [c for c in space.gate_up_candidates(16) if c.split_k == 1]
    assert max(space.decode_balance(SHAPES[3], 1, "gate_up", c) for c in unsplit) == pytest.approx(192 / 264)
    assert max(space.decode_balance(SHAPES[1], 1, "gate_up", c) for c in unsplit) == pytest.approx(112 / 132)
    qwen = SHAPES[2]
    old = [c for c in unsplit if (c.block_n, c.block_k, c.num_stages) != (16, 128, 4)]
    assert max(space.decode_balance(qwen, 1, "gate_up", c) for c in old) == pytest.approx(96 / 132)
    assert space.resident(16, GemmTiles(16, 128, 8, 4, 4), 2) == 4 and space.resident(16, old[0], 2) == 2
    # a split tile's programs: Qwen3's down (K 768, 6 steps of 128) in 4 parts takes 3 of 2 steps each
    assert space.splits(768, GemmTiles(128, 128, 1, 4, 4, 4)) == 3
    assert space.decode_balance(qwen, 1, "down", GemmTiles(128, 128, 1, 4, 4, 4)) == pytest.approx(384 / 396)


def test_prefill_candidates_tma_and_persistent() -> None:
    """From BLOCK_M 32 up each GEMM's list holds the H200 tables' prefill winners with the weights by TMA and on a
    persistent grid (ops/triton_moe_grid.py); decode's BLOCK_M 16 none (its split-K grids are not persistent); a
    persistent tile never splits K (the tables refuse it); the JIT compiles a persistent grid once whatever its
    programs an SM (a runtime grid size), a TMA tile apart from its pointer twin."""
    for bm in (32, 64, 128):
        for cands in (space.gate_up_candidates(bm), space.down_candidates(bm)):
            assert any(c.tma for c in cands) and any(c.persistent for c in cands), bm
    for cands in (space.gate_up_candidates(16), space.down_candidates(16)):
        assert not any(c.tma or c.persistent for c in cands)
    assert all(c.split_k == 1 for bm in (32, 64, 128) for c in (*space.gate_up_candidates(bm),
                                                               *space.down_candidates(bm)) if c.persistent)
    two = GemmTiles(128, 64, 8, 4, 3, 1, 1, 2)
    assert space.compile_key(two, 768) == GemmTiles(128, 64, 1, 4, 3, 1, 1, 1)
    assert space.compile_key(two._replace(tma=0), 768) != space.compile_key(two, 768)
    assert GemmTiles(128, 64, 8, 4, 3, 1, 1, 2) in space.down_candidates(64)  # two programs an SM: 72 KiB each
    assert GemmTiles(256, 64, 8, 8, 4, 1, 0, 0, 64) in space.down_candidates(128)  # top-k sum in quarters
    assert not any(c.reduce_n for c in space.gate_up_candidates(64))


@pytest.mark.parametrize(("p", "want"), [
    (4, ((16, 0),)), (48, ((16, 0), (32, 0), (64, 0))),  # decode and short prefills: no tail
    (64, ((32, 0), (64, 0), (128, 0), (64, 16), (128, 16), (128, 32))),
    (256, ((64, 0), (128, 0), (64, 16), (128, 16), (128, 32))),  # Qwen3-30B-A3B at 4096 tokens
])
def test_m_candidates_add_tails_at_prefill(p: float, want: tuple[tuple[int, int], ...]) -> None:
    """The tail blocks (TAIL_BLOCK_M) are timed above TAIL_MIN_P pairs an expert, on BLOCK_M 64 and 128, on their
    BLOCK_M's tiles; the dry run times one (BLOCK_M 32, tail 16) on the quick tiles."""
    assert space.m_candidates(p) == want
    assert space.m_candidates(p, quick=True) == ((16, 0), (32, 16))
    for bm, tail in want:
        assert not tail or (tail < bm and bm % tail == 0)
    assert space.gate_up_candidates(32, quick=True) and space.down_candidates(32, quick=True)


def test_choose_takes_the_fastest_sum() -> None:
    a, b, c = GemmTiles(32, 128, 8, 4, 4), GemmTiles(64, 64, 1, 4, 4), GemmTiles(128, 64, ALL_M, 8, 3)
    assert space.fastest({a: 2.0, b: 1.0, c: 1.0}) == b  # the first listed on a tie
    assert space.choose({16: (a, 1.0, b, 3.0), 32: (b, 2.0, c, 1.0)}) == MoeKernelConfig(32, b, c)
    assert space.choose({64: (a, 1.0, b, 1.0), 32: (b, 1.0, c, 1.0)}) == MoeKernelConfig(32, b, c)  # tie: smaller
    assert space.choose({16: (a, 1.0, b, 3.0), 32: (b, float("inf"), c, 0.1)}) == MoeKernelConfig(16, a, b)
    assert space.choose({16: (a, float("inf"), b, 1.0)}) is None  # nothing ran: the caller keeps the rule
    # (BLOCK_M, TAIL_BLOCK_M) keys: the tail's config when it is faster; on a tie no tail, then the smaller tail
    assert space.choose({(128, 0): (a, 2.0, b, 2.0), (128, 16): (a, 1.5, c, 2.0)}) == MoeKernelConfig(128, a, c, 16)
    assert space.choose({(128, 32): (a, 1.0, b, 1.0), (128, 16): (a, 1.0, b, 1.0), (128, 0): (a, 1.0, b, 1.0)}) \
        == MoeKernelConfig(128, a, b)
    assert space.choose({(128, 32): (a, 1.0, b, 1.0), (128, 16): (a, 1.0, b, 1.0)}) == MoeKernelConfig(128, a, b, 16)
    assert space.other_groups(space.GROUPS) == (1, 32, ALL_M)


def test_dry_run_end_to_end(tmp_path: Path) -> None:
    """The whole script on the CPU: sweep, tables written and validated, the summary and moe_gemm's table last."""
    out = run_interpreted(str(ROOT / "bench" / "moe_tune.py"), "--dry-run", "--out", str(tmp_path), timeout=300)
    tables = load_tables(tmp_path / "moe_configs")
    key = TableKey("cpu", 16, 32, 64, "float16")  # tiny-qwen3-moe: E 16, I 32, hidden 64
    assert set(tables) == {key} and "dry run" in tables[key].source
    ((per_expert, cfg),) = tables[key].buckets
    assert per_expert == 1.0 and (cfg.block_m, cfg.tail_m) in ((16, 0), (32, 16))  # T = 4, top_k 4, 16 experts
    report = json.loads((tmp_path / "moe_tune.json").read_text())
    (point,) = report["points"]
    assert point["tokens"] == 4 and point["kept"] in ("tuned", "rule") and report["failed"] == []
    rows = json.loads((tmp_path / "moe_gemm.json").read_text())["rows"]
    assert [(r["phase"], r["tokens"]) for r in rows] == [("prefill", 4), ("decode", 1)]
    assert rows[0]["block_m"] == cfg.block_m and rows[0]["tail_m"] == cfg.tail_m
    assert not any("tail" in f for f in report["failed"])  # the tail candidate (BLOCK_M 32, tail 16) ran
    assert out.rstrip().splitlines()[-1].startswith("| tiny-qwen3-moe | 1 | 1 | ")  # the decode table last


def test_moe_gemm_align_us_times_the_path_a_tail_config_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/moe_gemm.py's "align us" under a TAIL_BLOCK_M: `fused_moe` then always takes the two launches, which
    also write the block lists (`align_tails`), whatever the pairs: that is the path timed and starred, the one
    program (which has no lists) not at all; without a tail both paths as before, at BLOCK_M."""
    import torch

    from bench import moe_gemm

    TILES = GemmTiles(64, 64, 1, 4, 3)  # noqa: N806
    calls: list[tuple[str, tuple[object, ...]]] = []
    monkeypatch.setattr(moe_gemm, "graph_ms", lambda fn, reps, device: (fn(), 1.0)[1])
    monkeypatch.setattr(moe_gemm, "align", lambda *a: calls.append(("align", a[1:])))
    monkeypatch.setattr(moe_gemm, "align_tails", lambda *a: calls.append(("align_tails", a[1:])))
    ids = torch.zeros(8, 2, dtype=torch.int32)  # 16 pairs: the one-program path without a tail
    got = moe_gemm.align_us(ids, 4, MoeKernelConfig(64, TILES, TILES, 16), 1, "cpu")
    assert got["align_path"] == "two" and got["align_one_us"] is None and got["align_two_us"] is not None
    assert set(calls) == {("align_tails", (4, 64, 16))}
    calls.clear()
    got = moe_gemm.align_us(ids, 4, MoeKernelConfig(64, TILES, TILES), 1, "cpu")
    assert got["align_path"] == "one" and got["align_one_us"] is not None and got["align_two_us"] is not None
    assert set(calls) == {("align", (4, 64, True)), ("align", (4, 64, False))}


@pytest.mark.parametrize(("argv", "says"), [
    (["--models", "llama-3.1-8b"], "llama-3.1-8b not a mixture-of-experts preset; allowed"),
    (["--models", "mixtral-8x7b,mixtral-8x7b"], "empty or repeated"),
    (["--tp", "two"], "comma-separated whole numbers"),
    (["--tp", "0"], "each once"),
    (["--models", "mixtral-8x7b", "--tp", "3"], "14336 does not split 3 ways"),
])
@pytest.mark.parametrize("script", ["moe_gemm", "moe_tune"])
def test_bad_flags_are_refused_by_name_before_any_gpu_work(script: str, argv: list[str], says: str,
                                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both scripts refuse a model that is not an MoE preset, a TP size that is not a whole number >= 1 or does not
    split a model's experts, on any machine, before they look for a GPU; before, moe_gemm raised a KeyError deep in
    `layer` or int() failed in a traceback."""
    import importlib

    mod = importlib.import_module(f"bench.{script}")
    extra = ["--out", str(tmp_path)] if script == "moe_tune" else []
    with pytest.raises(SystemExit) as e:
        mod.main(argv + extra)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_moe_gemm_refuses_a_tables_folder_that_holds_no_table(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--tables naming a missing or empty folder is refused: before, it loaded no table and timed the untuned rule
    under the name of tuned tables (2026-11-30: a --tables path absent on the GPU machine gave a TP 2 table of rule
    times, caught only because the tile columns did not match the tuning's)."""
    from bench import moe_gemm

    for folder, says in ((tmp_path / "absent", "no such folder"), (tmp_path, "holds no table")):
        with pytest.raises(SystemExit) as e:
            moe_gemm.main(["--tables", str(folder)])
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert moe_gemm.read_tables_dir(ROOT / "rapidserve" / "ops" / "moe_configs")  # the packaged folder passes
    assert moe_gemm.parse_tps("1,2", ["mixtral-8x7b", "qwen3-30b-a3b"]) == [1, 2]


@pytest.mark.parametrize(("argv", "says"), [
    (["--models", "mixtral-8x7b"], "drop --models"),
    (["--tp", "2", "--dtype", "bfloat16"], "drop --tp, --dtype"),
    (["--write-repo"], "drop --write-repo"),
    (["--jobs", "4"], "drop --jobs"),
])
def test_moe_tune_dry_run_refuses_the_flags_it_would_ignore(argv: list[str], says: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run tunes tiny-qwen3-moe at TP 1 in float16 whatever --models, --tp, --dtype say, compiles as it goes
    and never writes the repository's tables: those flags are refused with it, on any machine; before, they were
    silently ignored (a `--dry-run --models mixtral-8x7b` check ran the tiny shape and said nothing)."""
    from bench import moe_tune

    with pytest.raises(SystemExit) as e:
        moe_tune.main(["--dry-run", "--out", str(tmp_path), *argv])
    assert e.value.code == 2 and "--dry-run tunes tiny-qwen3-moe" in (err := capsys.readouterr().err) and says in err


def test_moe_gemm_rows_say_whether_their_tiles_were_tuned() -> None:
    """A row timed on the rule says so: a --tables folder of other shapes or devices (or none packaged for this GPU)
    times the untuned rule, which before 2026-11-30 the table printed under the name of tuned tiles."""
    import torch

    from bench import moe_gemm
    from rapidserve.ops.moe_tiles import load_tables

    packaged = load_tables(ROOT / "rapidserve" / "ops" / "moe_configs")
    h200 = next(k for k in packaged if k.device_name == "NVIDIA H200")
    dev = torch.device("cpu")  # the interpreter's device name, which no packaged table names
    assert moe_gemm.tiles_source(packaged, h200.num_experts, h200.n, h200.k, torch.bfloat16, dev) == "rule"
    here = {TableKey("cpu", h200.num_experts, h200.n, h200.k, "bfloat16"): packaged[h200]}
    assert moe_gemm.tiles_source(here, h200.num_experts, h200.n, h200.k, torch.bfloat16, dev) == "tuned"
    assert moe_gemm.tiles_source(here, h200.num_experts, h200.n, h200.k, torch.float16, dev) == "rule"
    assert moe_gemm.rule_mark({"tiles": "rule"}) == " (rule)" and moe_gemm.rule_mark({"tiles": "tuned"}) == ""
