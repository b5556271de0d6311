"""bench/correction_replay.py: the fused correction replayed over a synthetic trace of small and large steps."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from rapidserve.engine.step_trace import StepRecord
from tests.bench_module import load_bench

rp = load_bench("correction_replay")


def steps(n: int = 60) -> list[StepRecord]:
    """Small fused steps (64 rows + 200 prompt tokens) running 1.4x their prediction, large ones (64 + 1400) 1.0x, and
    decode-alone steps between, as multi-turn ran on the H200."""
    out = []
    for i in range(n):
        out.append(StepRecord(3 * i, "fused", "Fused()", 64, 64_000, [(200, 0)], 14.0, 10.0))
        out.append(StepRecord(3 * i + 1, "fused", "Fused()", 64, 64_000, [(1400, 0)], 40.0, 40.0))
        out.append(StepRecord(3 * i + 2, "alone", "DecodeAlone()", 64, 64_000, [], 9.0, 10.0))
    return out


def test_by_size_prices_the_large_steps_right_where_one_ratio_does_not(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    res = rp.replay(steps(), 1152)
    assert len(res["one ratio"]) == len(res["by size"]) == 60
    late = slice(30, None)  # after both settled
    assert min(res["one ratio"][late]) > 1.1  # the small steps' 1.4 drags the one ratio up
    assert all(x == pytest.approx(1.0, abs=0.01) for x in res["by size"][late])
    path = tmp_path / "t.jsonl"
    enc = msgspec.json.Encoder()
    path.write_bytes(b"".join(enc.encode(r) + b"\n" for r in steps()))
    assert rp.main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| trace | large fused steps |") and out[-1].startswith(f"| {path} | 60 | by size | 1.00")
    with pytest.raises(SystemExit):
        rp.main([str(tmp_path / "missing.jsonl")])
