"""A step in flight that has landed before the next one is planned is recorded and published first
(engine/step_cycle.py's docstring: the order), on CPU, with end events standing in for a GPU's.

On the CPU a step has no end event (done on return) and the loop keeps its ahead order, so these tests give each
launched step a stand-in event: one that has completed when first asked (the host late: the step landed during the
host's turn) or one that completes only once waited for (the device busy: the ahead order). Either way the decode
worker's greedy tokens equal `LLM.generate`'s (in fused, split and decode-alone steps, with preemptions) and every
block comes back; when steps have landed, each one's tokens are published before the next step is planned, and
nothing is launched with a step in flight."""

from __future__ import annotations

from typing import Any

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.engine import messages as m
from rapidserve.engine import step_cycle
from rapidserve.engine.decode_worker import DecodeWorker
from rapidserve.partition.profile import OVERALLOCATED
from rapidserve.partition.shape import ShapeState, Split, StepShape
from rapidserve.partition.step_policies import ScriptedPolicy
from tests.test_step_shapes import MODEL, NEW, model_and_reference, phases, serve, streams, workers


class Event:
    """A step's end event: completed when first asked (`landed`), or only once waited for (polled again)."""

    def __init__(self, landed: bool) -> None:
        self.done = landed

    def query(self) -> bool:
        done, self.done = self.done, True  # a step that was running has landed by the next look
        return done

    def synchronize(self) -> None:
        self.done = True


@pytest.fixture(scope="module")
def tiny() -> tuple[LLM, list[list[int]], list[list[int]]]:
    return model_and_reference(MODEL)


@pytest.mark.parametrize("landed", [True, False], ids=["landed before the next plan", "still running"])
@pytest.mark.parametrize(("two_configs", "shapes"), [(False, "phases"), (True, "phases"), (False, "split")],
                         ids=["fused, split, alone", "two configurations", "split only"])
def test_a_landed_step_is_published_before_the_next_is_planned(
        tiny: tuple[LLM, list[list[int]], list[list[int]]], monkeypatch: pytest.MonkeyPatch, landed: bool,
        two_configs: bool, shapes: str) -> None:
    llm, prompts, want = tiny
    split = "split16" if two_configs else OVERALLOCATED

    def script(k: int, st: ShapeState) -> StepShape:
        return phases(k, st, split) if shapes == "phases" else Split(split, 48)

    d, p, io = workers(llm, ScriptedPolicy(script), two_configs)
    launches: list[tuple[bool, int]] = []  # per launch: a step in flight, recorded tokens not yet published
    launch = step_cycle.launch_step

    def evented(*a: Any, **k: Any) -> Any:
        launches.append((bool(d.inflight), len(d._out)))
        f = launch(*a, **k)
        f.done = Event(landed)  # type: ignore[assignment]
        return f

    monkeypatch.setattr(step_cycle, "launch_step", evented)
    early = 0
    publish = DecodeWorker.step_landed_early

    def counted(self: DecodeWorker) -> None:
        nonlocal early
        early += 1
        assert not self.inflight  # recorded before this step is planned
        first = list(self._first)
        publish(self)
        assert not self._out and self._first == first  # first tokens from PrefillDone wait for the launch

    monkeypatch.setattr(DecodeWorker, "step_landed_early", counted)
    free0 = d.sched.blocks.num_free
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    serve(d, p, io, [m.NewRequest(f"q{i}", pr, greedy, float(i)) for i, pr in enumerate(prompts)])
    assert [[t.token_id for t in streams(io)[f"q{i}"]] for i in range(len(prompts))] == want
    assert d.sched.num_preemptions > 0 and d.sched.blocks.num_free == free0 and d.runner.tokens.in_use == 0
    assert launches
    if landed:  # nothing launched with a step in flight, nothing landed left unpublished at a launch
        assert early > 0 and all(lc == (False, 0) for lc in launches)
    else:  # the ahead order: steps launched while the one before runs; none recorded early
        assert early == 0 and any(inflight for inflight, _ in launches)


def test_an_early_publish_leaves_first_tokens_for_the_publish_after_the_launch(
        tiny: tuple[LLM, list[list[int]], list[list[int]]]) -> None:
    """A first token from PrefillDone goes out with the publish after the next launch (the gap to the second token
    stays one step), also when a landed step was published early before it."""
    d, _, io = workers(tiny[0], ScriptedPolicy([Split(OVERALLOCATED, 48)]), False)
    first, landed = m.TokenOut("a", 0, 5, None, None, None), m.TokenOut("b", 3, 6, None, None, None)
    d._first, d._out = [first], [landed]
    d.step_landed_early()
    assert [b.tokens for b in io.of("d2r", m.TokenBatch)] == [[landed]] and d._first == [first] and not d._out
    d.publish()
    assert [b.tokens for b in io.of("d2r", m.TokenBatch)] == [[landed], [first]] and not d._first
