"""--step-trace: the decode worker's landed steps, a JSON line each (engine/step_trace.py): the file's records on a
CPU engine, the path per data-parallel engine, the flag's refusals, a record cut short."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.config_base import ConfigError
from rapidserve.engine import messages as m
from rapidserve.engine import step_cycle
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.decode_request import StepBatch
from rapidserve.engine.decode_worker import DecodeWorker
from rapidserve.engine.prefill_worker import PrefillWorker
from rapidserve.engine.step_trace import (
    StepRecord,
    StepTrace,
    check_trace_path,
    read_trace,
    trace_path,
    whole_lines,
)
from rapidserve.partition.profile import OVERALLOCATED
from rapidserve.partition.shape import DecodeAlone, ShapeState, StepShape, StepTiming
from rapidserve.partition.step_policies import ScriptedPolicy
from tests.test_engine import chat_prompts, collect, engine_config, wait_blocks_free
from tests.test_step_shapes import MODEL, NEW, model_and_reference, phases, serve, workers
from tests.test_worker_faults import FakeIO

NEW_TOKENS = 6
Tiny = tuple[LLM, list[list[int]], list[list[int]]]


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
            params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
            got = await asyncio.gather(*(collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts)))
            assert all(len(g) == NEW_TOKENS for g in got)
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
    assert sum(r.rows for r in recs) <= 3 * (NEW_TOKENS - 1)  # each request's tokens after its first, in decode rows
    assert sum(r.rows for r in recs) >= NEW_TOKENS - 1
    assert all(r.context_sum >= r.rows for r in recs)
    # the first step of the run had nothing in flight; on a CPU no step lands before the next is planned (no events)
    assert recs[0].launch == "idle" and {r.launch for r in recs} <= {"idle", "ahead", "quiet-pool"}
    n = len(recs)
    asyncio.run(main())  # a second engine (a restarted worker, a new server) appends
    assert len(read_trace(path)) > n


# ---- the decode worker's trace, in this process (tests/test_step_shapes.py's harness) ------------------------------
@pytest.fixture(scope="module")
def tiny() -> Tiny:
    return model_and_reference(MODEL)


def _traced_worker(tiny: Tiny, path: Path) -> tuple[DecodeWorker, PrefillWorker, FakeIO]:
    def script(k: int, st: ShapeState) -> StepShape:
        return phases(k, st, OVERALLOCATED)

    d, p, io = workers(tiny[0], ScriptedPolicy(script), False)
    d.trace = StepTrace(str(path))
    return d, p, io


def test_context_sum_is_the_contexts_the_step_attended_to(
        tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record's context_sum is the sum of its decode rows' contexts as the step ran them (row i's token at
    position tokens_needed - 1, so tokens_needed tokens attended), not their token counts once the step's own
    tokens (and the step before's) were recorded: one more per row."""
    path = tmp_path / "steps.jsonl"
    d, p, io = _traced_worker(tiny, path)
    launched: list[tuple[int, int]] = []  # per launch: decode rows, the contexts they attend to
    launch = step_cycle.launch_step

    def noted(*a: Any, **k: Any) -> Any:
        batch = a[4]
        launched.append((len(batch.decode), sum(r.tokens_needed for r in batch.decode)))
        return launch(*a, **k)

    monkeypatch.setattr(step_cycle, "launch_step", noted)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    serve(d, p, io, [m.NewRequest(f"q{i}", pr, greedy, float(i)) for i, pr in enumerate(tiny[1][:4])])
    assert d.trace is not None
    d.trace.close()
    recs = read_trace(path)
    assert len(recs) == len(launched) and any(rows for rows, _ in launched)
    assert [(r.rows, r.context_sum) for r in recs] == launched


def test_the_trace_is_written_out_however_the_worker_ends(
        tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lines buffered since the last Stats reach the file when the worker's loop ends because a peer died (it
    returns) or because it raised, not only at a Shutdown."""
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for how in ("peer died", "raised"):
        path = tmp_path / f"{how.replace(' ', '_')}.jsonl"
        d, _, io = _traced_worker(tiny, path)
        io.inbox.append(m.NewRequest("q", tiny[1][1], greedy, 0.0))
        for _ in range(4):
            d.turn()
        assert d.trace is not None
        buffered = len(d.trace._lines)
        assert buffered > 0
        if how == "peer died":
            monkeypatch.setattr(io, "others_alive", lambda every_s=0.25: False)
            d.run()
        else:
            def boom() -> None:
                raise RuntimeError("a device fault")

            monkeypatch.setattr(d, "turn", boom)
            with pytest.raises(RuntimeError, match="a device fault"):
                d.run()
        assert len(read_trace(path)) >= buffered, how


def test_a_restarted_worker_appends_after_a_line_cut_short(tmp_path: Path) -> None:
    """A worker killed mid-write leaves a line cut short; the restarted worker's first record starts a line of its
    own (the cut one dropped), so the file still reads."""
    good = b'{"t":1.0,"kind":"fused","shape":"Fused()","rows":2,"context_sum":40,"chunks":[[16,0]],"measured_ms":3.5}\n'
    p = tmp_path / "steps.jsonl"
    p.write_bytes(good + good + good[:30])
    assert whole_lines(str(p), tail=8) == whole_lines(str(p)) == 2 * len(good)  # read back from the end in pieces
    for before in (good + good[:30], good[:30], good, b""):
        p.write_bytes(before)
        trace = StepTrace(str(p))
        timing = StepTiming(DecodeAlone("overallocated"), 0, 0, None, 1.0, None, None, None)
        trace.add(StepBatch(), 0, "idle", timing, {}, 2.0)
        trace.close()
        recs = read_trace(p)
        assert [r.t for r in recs] == [1.0] * before.count(b"\n") + [2.0], before


def test_a_step_records_what_the_policy_planned_it_at(tiny: Tiny, tmp_path: Path) -> None:
    """The policy's raw prediction and its corrected one (the decision's `model_ms` and `predicted_ms`: what it
    compared with the SLO) reach the step's timing and its trace record, so bench/step_fit.py judges the prediction
    the policy used (with a correction by size class, not the one fused ratio the record also holds)."""
    from types import SimpleNamespace

    class Planned(ScriptedPolicy):
        def decide(self, state: ShapeState) -> StepShape:
            self.last = SimpleNamespace(model_ms=10.0 + self.calls, predicted_ms=12.5 + self.calls)
            return super().decide(state)

    path = tmp_path / "steps.jsonl"
    d, p, io = workers(tiny[0], Planned(lambda k, st: phases(k, st, OVERALLOCATED)), False)
    d.trace = StepTrace(str(path))
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    serve(d, p, io, [m.NewRequest(f"q{i}", pr, greedy, float(i)) for i, pr in enumerate(tiny[1][:2])])
    d.trace.close()
    recs = read_trace(path)
    timings = d.policy.timings  # type: ignore[attr-defined]
    assert recs and len(timings) == len(recs)
    assert all(r.planned_ms is not None and r.predicted_ms is not None and r.planned_ms == r.predicted_ms + 2.5
               for r in recs)
    assert [(t.predicted_ms, t.planned_ms) for t in timings] == [(r.predicted_ms, r.planned_ms) for r in recs]
