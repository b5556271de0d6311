"""bench/correction_replay.py: the fused correction replayed over a synthetic trace of small and large steps."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from rapidserve.engine.step_trace import StepRecord
from tests.bench_module import load_bench

rp = load_bench("correction_replay")


def steps(n: int) -> list[StepRecord]:
    """Small fused steps (64 rows + 200 prompt tokens) running 1.4x their prediction, large ones (64 + 1400) 1.0x, and
    decode on split16 at 0.3x between, as multi-turn ran on the H200."""
    out = []
    for i in range(n):
        out.append(StepRecord(3 * i, "fused", "Fused()", 64, 64_000, [(200, 0)], 14.0, 10.0))
        out.append(StepRecord(3 * i + 1, "fused", "Fused()", 64, 64_000, [(1400, 0)], 40.0, 40.0))
        out.append(StepRecord(3 * i + 2, "split", "Split(config='split16', prefill_batch_tokens=256, lookahead=4)",
                              64, 64_000, [], 3.0, 10.0))
    return out


def test_by_size_prices_the_large_steps_right_where_one_ratio_does_not(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    res = rp.replay(steps(120), 1152)
    before, now, split_before, split_now = (res[s] for s in rp.SCHEMES)
    assert len(before) == len(now) == 120 and len(split_before) == len(split_now) == 120
    late = slice(90, None)  # after every ratio settled (0.3 from 1.0 takes ~60 steps at alpha 0.1)
    assert min(before[late]) > 1.1  # the small steps' 1.4 drags the one ratio up
    assert all(x == pytest.approx(1.0, abs=0.01) for x in now[late])
    # decode on split16 running at 0.3 of its prediction: the old clamp held the ratio at 0.5, 1.67x slow
    assert all(x == pytest.approx(0.5 / 0.3) for x in split_before[late])
    assert all(x == pytest.approx(1.0, abs=0.01) for x in split_now[late])
    path = tmp_path / "t.jsonl"
    enc = msgspec.json.Encoder()
    path.write_bytes(b"".join(enc.encode(r) + b"\n" for r in steps(120)))
    assert rp.main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| trace | steps judged |")
    assert out[-1].startswith(f"| {path} | 120 | split: by configuration, clamp 0.25 (now) | 1.0")
    with pytest.raises(SystemExit):
        rp.main([str(tmp_path / "missing.jsonl")])
