"""bench/kv_capacity.py on CPU: its rows and table say what the runner's pool and budget held, and its flags refuse
bad values by name (the measurement itself needs a GPU)."""

from __future__ import annotations

import pytest
from bench_module import load_bench

from rapidserve.runner.kv_budget import GIB, KVBudget

kvc = load_bench("kv_capacity")
G = int(GIB)


def test_rows_and_table() -> None:
    budget = KVBudget(140 * G, 0.8, 70 * G, 68 * G, 69 * G, 8192, 3 * G, 1 * G, baseline_used=G // 2,
                      step_processes=2)
    bf16 = kvc.row("auto", 1000, 16, 39 * G, budget)
    fp8 = kvc.row("fp8", 2000, 16, 39 * G, budget)
    assert bf16["tokens"] == 16000 and bf16["pool_gib"] == 39.0
    assert bf16["cache_gib"] == 1.0 and bf16["step_peak_gib"] == 3.0 and bf16["logits_floor_gib"] == 1.0
    assert bf16["in_use_gib"] == 69.5 and bf16["not_charged_gib"] == 0.5 and bf16["step_processes"] == 2
    assert bf16["outside_torch_gib"] == 0.5
    md = kvc.table([bf16, fp8])
    lines = md.splitlines()
    assert lines[0].startswith("| kv_dtype | blocks | tokens | vs first |")
    assert lines[2].startswith("| auto | 1,000 | 16,000 | 1.00x | 39.0 |")
    assert lines[3].startswith("| fp8 | 2,000 | 32,000 | 2.00x |")
    # a pool not sized from the GPU (given blocks): the budget columns say so
    assert kvc.table([kvc.row("auto", 8, 16, G, None)]).splitlines()[2].endswith("| - | - | - | - | - | - | - | - |")


@pytest.mark.parametrize(("argv", "says"), [
    (["--kv-dtypes", "fp16"], "--kv-dtypes"),
    (["--kv-dtypes", ","], "--kv-dtypes"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--model", "Qwen/Qwen3-8B"], "--model"),
    (["--quantization", "awq"], "--quantization"),
    (["--step-processes", "3"], "--step-processes"),
])
def test_bad_flags_are_refused_by_name(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        kvc.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
