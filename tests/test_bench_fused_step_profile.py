"""bench/fused_step_profile.py on CPU: the items it builds are a fused step the runner takes, its fit recovers a known
line, and its table says what it measured."""

from __future__ import annotations

import pytest
import torch
from bench_module import load_bench

fsp = load_bench("fused_step_profile")
model_runner = load_bench("model_runner")


def test_the_items_are_a_fused_step_the_runner_runs() -> None:
    from rapidserve.loader.presets import preset_config
    from rapidserve.runner import ModelRunner

    mcfg = preset_config("tiny-llama")
    ecfg = model_runner.engine_config("tiny-llama", mcfg, "float32", (1,), 256, 0.9, num_blocks=64, device="cpu")
    runner = ModelRunner(ecfg, model_runner.preset_source("tiny-llama", mcfg, "cpu", torch.float32),
                         show_progress=False)
    shape = fsp.Shape(rows=3, context=40, chunk=24, prefix=16)
    items = fsp.step_items(shape, runner.block_size, runner.kv_pool.num_blocks, mcfg.vocab_size)
    assert [len(i.token_ids) for i in items] == [1, 1, 1, 24] and [i.start_pos for i in items] == [39, 39, 39, 16]
    bs = runner.block_size
    assert all(len(i.block_table) * bs >= i.start_pos + len(i.token_ids) for i in items)
    tables = [b for i in items for b in i.block_table]
    assert len(tables) == len(set(tables))  # no two sequences share a block
    logits = runner.prefill(items)
    assert logits.shape == (4, mcfg.vocab_size) and torch.isfinite(logits).all()  # a row each, the chunk's last
    with pytest.raises(ValueError, match="needs .* KV blocks; the pool has 4"):
        fsp.step_items(shape, bs, 4, mcfg.vocab_size)


def test_the_fit_recovers_a_known_step_cost() -> None:
    shapes = [fsp.Shape(0, 0, c, p) for c, p in ((512, 0), (1024, 0), (2048, 0), (1024, 3072), (4096, 0))]
    points = [(s, 7.5 + 0.018 * s.tokens + 1.3 * fsp.pairs(s) / 1e6) for s in shapes]
    f = fsp.fit(points)
    assert f["fixed_ms"] == pytest.approx(7.5) and f["per_token_us"] == pytest.approx(18.0)
    assert f["per_mpair_ms"] == pytest.approx(1.3) and f["median_abs_err"] < 1e-9
    with pytest.raises(ValueError, match="at least three"):
        fsp.fit(points[:2])


def test_the_table_gives_each_shape_against_the_best_chunk_alone() -> None:
    rows = [{"label": "rows 0, chunk 4096", "rows": 0, "ms": 96.6, "min_ms": 96.0, "max_ms": 97.0,
             "chunk_tokens_per_s": 42400.0, "categories_ms": {"gemm": 80.0, "attention": 10.0}, "gaps_ms": 1.5},
            {"label": "rows 1 x 4097, chunk 1616", "rows": 1, "ms": 42.3, "min_ms": 42.0, "max_ms": 43.0,
             "chunk_tokens_per_s": 38200.0, "categories_ms": {"gemm": 33.0}, "gaps_ms": 2.25}]
    text = fsp.table(rows, ["gemm", "attention"], {"fixed_ms": 7.8, "per_token_us": 18.2, "per_mpair_ms": 1.3,
                                                   "median_abs_err": 0.015})
    assert "| rows 1 x 4097, chunk 1616 | 42.30 (42.00-43.00) | 38,200 | 0.90 | 33.00 | 0.00 | 2.25 |" in text
    assert "**7.80 ms a step** + 18.20 us a token" in text and "(median abs error 1.5%)" in text


def test_the_ladder_says_where_a_larger_chunk_buys_fewer_tokens_a_second() -> None:
    rungs = [{"tokens": 1024, "ms": 25.0, "tokens_per_s": 40960.0},
             {"tokens": 1152, "ms": 30.0, "tokens_per_s": 38400.0},
             {"tokens": 1280, "ms": 30.5, "tokens_per_s": 41967.0}]
    rows = fsp.ladder_table(rungs).splitlines()
    assert rows[2:] == ["| 1024 | 25.00 | 40,960 | 1.00 |", "| 1152 | 30.00 | 38,400 | 0.94 |",
                        "| 1280 | 30.50 | 41,967 | 1.00 |"]
    assert tuple(range(256, 4097, 128)) == fsp.LADDER


def test_the_heading_says_how_the_steps_were_timed() -> None:
    assert fsp.timing_note(0.0) == "Steps back to back (the device's work only)"
    assert fsp.timing_note(40.0) == "Each step after 40 ms idle, timed alone (its host's lead-in in `gaps`)"


@pytest.mark.parametrize("flags, said", [(["--idle-ms", "-5"], "--idle-ms must be >= 0"),
                                         (["--idle-ms", "nan"], "--idle-ms must be >= 0"),
                                         (["--steps", "0"], "--steps must be >= 1")])
def test_bad_flags_are_refused_by_name(flags: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        fsp.main(flags)
    assert e.value.code == 2 and said in capsys.readouterr().err
