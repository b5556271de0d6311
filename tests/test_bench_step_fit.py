"""bench/step_fit.py: the cost models fitted to traced steps (pure on synthetic traces) and its command line."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import numpy as np
import pytest

from rapidserve.engine.step_trace import StepRecord
from tests.bench_module import load_bench

fit = load_bench("step_fit")


def synthetic(path: Path, n: int = 400, seed: int = 0) -> None:
    """Fused steps whose true time is 5 + 0.02 ms a row + 2e-5 ms a context token + 0.025 ms a chunk token (plus 1%
    noise), predicted by a model that rounds the decode part up by 1.6x (as a profile read at the bucket above does)
    and holding a correction of 0.8."""
    rng = np.random.default_rng(seed)
    enc = msgspec.json.Encoder()
    with open(path, "wb") as f:
        for i in range(n):
            rows = int(rng.integers(50, 300))
            ctx = rows * int(rng.integers(800, 4000))
            chunk = int(rng.integers(0, 1600))
            decode = 5 + 0.02 * rows + 2e-5 * ctx
            true = (decode + 0.025 * chunk) * (1 + 0.01 * rng.standard_normal())
            predicted = 1.6 * decode + 0.025 * chunk
            rec = StepRecord(float(i), "fused", "Fused()", rows, ctx, [(chunk, 0)] if chunk else [], true, predicted,
                             correction={"fused": 0.8})
            f.write(enc.encode(rec) + b"\n")


def test_linear_model_recovers_the_steps_and_the_ratio_does_not(tmp_path: Path) -> None:
    synthetic(tmp_path / "a.steps.jsonl")
    [f] = fit.fit_traces([str(tmp_path / "a.steps.jsonl")], 50.0, 0.9)
    assert f.kind == "fused" and f.fitted == 200 and f.steps == 200
    c = f.coefficients
    assert c["rows"] == pytest.approx(0.02, rel=0.1) and c["chunk_tokens"] == pytest.approx(0.025, rel=0.05)
    assert c["context_sum"] == pytest.approx(2e-5, rel=0.1)
    assert f.errors["linear"][1] < 0.03  # p95 within the noise
    assert f.errors["ratio"][1] > 0.1 and f.errors["policy"][1] > f.errors["ratio"][1] * 0.5  # one ratio cannot
    assert 0.0 <= f.overruns["ratio"] <= 1.0


def test_gaps_by_launch(tmp_path: Path) -> None:
    p = tmp_path / "c.steps.jsonl"
    enc = msgspec.json.Encoder()
    recs = [StepRecord(1.0, "fused", "Fused()", 8, 800, [], 40.0, 40.0, 58.0, 12.0, 9.0, launch="quiet-pool"),
            StepRecord(2.0, "fused", "Fused()", 8, 800, [], 52.0, 40.0, 53.0, 0.0, 5.0, launch="ahead"),
            StepRecord(3.0, "fused", "Fused()", 8, 800, [], 40.0, 40.0, 41.0, 0.2, 5.0, launch="ahead")]
    p.write_bytes(b"".join(enc.encode(r) + b"\n" for r in recs))
    assert fit.gaps_by_launch([str(p)], 50.0) == [("ahead", 2, 1, 1, 0.1), ("quiet-pool", 1, 1, 0, 12.0)]


def test_steps_without_a_prediction_are_left_out_and_small_kinds_skipped(tmp_path: Path) -> None:
    p = tmp_path / "b.steps.jsonl"
    enc = msgspec.json.Encoder()
    with open(p, "wb") as f:
        for i in range(10):
            f.write(enc.encode(StepRecord(float(i), "alone", "DecodeAlone()", 8, 800, [], 5.0)) + b"\n")  # none
        for i in range(6):
            f.write(enc.encode(StepRecord(float(i), "split", "Split()", 8, 800, [], 5.0, 6.0)) + b"\n")
    assert fit.fit_traces([str(p)], 50.0, 0.9) == []  # alone: no predictions; split: 3 + 3 steps, under 4 each


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synthetic(tmp_path / "a.steps.jsonl")
    synthetic(tmp_path / "b.steps.jsonl", seed=1)
    out = tmp_path / "fit"
    assert fit.main([str(tmp_path / "a.steps.jsonl"), str(tmp_path / "b.steps.jsonl"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| fused | 400 | linear |" in text and text.rstrip().splitlines()[-1].startswith("| fused | 400 | linear |")
    assert "\n| - | 800 | 0 | " in text  # synthetic steps: no launch recorded, no gap
    assert os.path.isfile(out / "step_fit.json") and "step_fit.py" in (out / "step_fit.md").read_text()
    with pytest.raises(SystemExit):
        fit.main([str(tmp_path / "none.jsonl")])
    assert "no such trace file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fit.main([str(tmp_path / "a.steps.jsonl"), "--margin", "1.5"])


def test_the_policy_prediction_is_what_it_planned_where_the_trace_says() -> None:
    base = StepRecord(0.0, "fused", "Fused()", 64, 64 * 1000, [(512, 0)], 40.0, 30.0, correction={"fused": 1.2})
    assert fit.policy_ms(base) == pytest.approx(36.0)  # an older trace: raw x the kind's ratio then
    planned = msgspec.structs.replace(base, planned_ms=33.0)  # the size class's ratio, 1.1, as the policy used it
    assert fit.policy_ms(planned) == 33.0
    assert fit.policy_ms(msgspec.structs.replace(base, predicted_ms=None)) is None
