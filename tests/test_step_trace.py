"""--step-trace: the decode worker's landed steps, a JSON line each (engine/step_trace.py): the file's records on a
CPU engine, the path per data-parallel engine, the flag's refusals, a record cut short."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rapidserve import SamplingParams
from rapidserve.config_base import ConfigError
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.step_trace import StepRecord, check_trace_path, read_trace, trace_path
from tests.test_engine import chat_prompts, collect, engine_config, wait_blocks_free

NEW = 6


@pytest.mark.parametrize(("path", "rank", "want"), [
    ("steps.jsonl", None, "steps.jsonl"), ("out/steps.jsonl", 0, "out/steps.dp0.jsonl"),
    ("out/steps.jsonl", 3, "out/steps.dp3.jsonl"), ("trace", 1, "trace.dp1"),
])
def test_trace_path(path: str, rank: int | None, want: str) -> None:
    assert trace_path(path, rank) == want


def test_check_trace_path(tmp_path: Path) -> None:
    check_trace_path(str(tmp_path / "steps.jsonl"))  # a new file in a folder that exists
    (tmp_path / "old.jsonl").write_text("")
    check_trace_path(str(tmp_path / "old.jsonl"))  # an existing file: appended to
    for bad, match in ((str(tmp_path / "no" / "steps.jsonl"), "does not exist"), (str(tmp_path), "give a file"),
                       ("", "give a file")):
        with pytest.raises(ConfigError, match=f"--step-trace .*{match}"):
            check_trace_path(bad)


def test_serve_refuses_a_trace_path_it_cannot_write(capsys: pytest.CaptureFixture[str]) -> None:
    from rapidserve.cli import main

    assert main(["serve", "--device", "cpu", "--step-trace", "/nonexistent-folder/steps.jsonl"]) == 2
    assert "--step-trace /nonexistent-folder/steps.jsonl: folder" in capsys.readouterr().err


def test_read_trace_leaves_out_a_line_cut_short(tmp_path: Path) -> None:
    good = b'{"t":1.0,"kind":"fused","shape":"Fused()","rows":2,"context_sum":40,"chunks":[[16,0]],"measured_ms":3.5}\n'
    p = tmp_path / "steps.jsonl"
    p.write_bytes(good + good[:30])  # the worker was killed mid-write
    assert read_trace(p) == [StepRecord(1.0, "fused", "Fused()", 2, 40, [(16, 0)], 3.5)]
    p.write_bytes(b"not json\n" + good)
    with pytest.raises(ValueError, match="steps.jsonl:1: not a step record"):
        read_trace(p)


def test_a_cpu_engine_traces_every_landed_step(tmp_path: Path) -> None:
    """duet without an SLO fuses every step in the decode worker: the trace has a record per landed step, each
    request's decode rows in the steps after its prompt's last chunk, the chunks within the prompts, and a
    measured time for each; a second engine appends to the file."""
    from rapidserve import LLM

    prompts = chat_prompts(LLM(dtype="float32", device="cpu", show_progress=False), 3)
    path = tmp_path / "steps.jsonl"

    async def main() -> None:
        engine = await AsyncEngine.start(engine_config(policy="duet", slo_itl_ms=None, step_trace=str(path)))  # type: ignore[arg-type]
        try:
            params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
            got = await asyncio.gather(*(collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts)))
            assert all(len(g) == NEW for g in got)
            await wait_blocks_free(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())
    recs = read_trace(path)
    assert recs and {r.kind for r in recs} <= {"fused", "fused_decode"}
    assert [r.t for r in recs] == sorted(r.t for r in recs)
    assert all(r.measured_ms >= 0 and r.predicted_ms is None for r in recs)  # duet without an SLO predicts nothing
    chunks = [c for r in recs for c in r.chunks]
    assert chunks and all(n >= 1 and start + n <= max(len(p) for p in prompts) for n, start in chunks)
    assert sum(r.rows for r in recs) <= 3 * (NEW - 1)  # each request's tokens after its first, in decode rows
    assert sum(r.rows for r in recs) >= NEW - 1
    assert all(r.context_sum >= r.rows for r in recs)
    n = len(recs)
    asyncio.run(main())  # a second engine (a restarted worker, a new server) appends
    assert len(read_trace(path)) > n
