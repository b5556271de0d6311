"""The one step loop under forced step shapes (`ScriptedPolicy`): fused -> split -> fused transitions in the middle
of requests, on CPU, the real decode and prefill workers in this process (the channels are lists:
tests/test_worker_faults.py's harness) over one ModelRunner.

A prompt chunked in the decode worker's fused steps goes to the prefill worker at the next split step, from its last
full block (`DecodeScheduler.hand_over`); a prompt handed to the prefill worker in a split step stays there; decodes
go on in every shape.
Greedy outputs equal `LLM.generate`'s, every KV block is back at the end, and every landed step's time went back
to the policy. With two configurations (streams: the current one, as on CPU), the fused steps run on the whole
GPU's and the split steps on the split's, and the prefill worker hears of each switch before the work it
concerns."""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from typing import Any

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.config import EngineConfig
from rapidserve.config_builder import build_engine_config
from rapidserve.engine import messages as m
from rapidserve.engine.decode_worker import DecodeWorker, default_policy, fused_graph_key, fused_steps
from rapidserve.engine.prefill_worker import PrefillWorker
from rapidserve.engine.step_tally import StepTally
from rapidserve.partition.backend import Granularity, PartitionBackend
from rapidserve.partition.plan import PartitionPlan
from rapidserve.partition.policies import DuetPolicy
from rapidserve.partition.profile import OVERALLOCATED, Configuration
from rapidserve.partition.roofline import Peaks
from rapidserve.partition.roofline_profile import roofline_profile
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition.shape import DecodeAlone, Fused, ShapeState, Split, StepShape, queue_head
from rapidserve.partition.step_policies import AlwaysFused, AlwaysSplit, DuetWithoutSlo, ScriptedPolicy
from rapidserve.partition_config import PartitionConfig
from tests.test_worker_faults import FakeIO

NEW = 12
MODEL = "preset:tiny-llama"  # a tiny deterministic model: the tests are about the loop (SmolLM2: a slow test)
CONFIGS = [Configuration(OVERALLOCATED, 0, 132), Configuration("split16", 16, 116)]


class CpuSplits(PartitionBackend):
    """Two configurations whose "streams" are the current one (None), for both roles, as on a CPU."""

    def __init__(self) -> None:
        super().__init__(Granularity(132, 1, 1), CONFIGS)
        for c in CONFIGS:
            for role in ("decode", "prefill"):
                self._streams[(c.name, role)] = None


def model_and_reference(model: str | None) -> tuple[LLM, list[list[int]], list[list[int]]]:
    """`model` (None: the embedded SmolLM2), its KV pool small enough for preemptions, a step budget small
    enough for chunks; prompts and LLM's greedy tokens for them."""
    llm = LLM(model, dtype="float32", device="cpu", show_progress=False, max_model_len=512, num_kv_blocks=28,
              max_num_batched_tokens=48)
    rng = random.Random(7)
    top = 1280 if model is not None else 20000
    prompts = [[rng.randrange(3, top) for _ in range(n)] for n in (70, 9, 120, 33, 55, 16, 90, 24)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    return llm, prompts, want


@pytest.fixture(scope="module")
def smollm() -> tuple[LLM, list[list[int]], list[list[int]]]:
    return model_and_reference(MODEL)


def workers(llm: LLM, policy: Any, two_configs: bool) -> tuple[DecodeWorker, PrefillWorker, FakeIO]:
    cfg, runner = llm.config, llm.engine.runner
    io = FakeIO()
    configs = CONFIGS if two_configs else CONFIGS[:1]
    plan = PartitionPlan("none", configs, None, "test")
    backend = CpuSplits()
    d = DecodeWorker(cfg, runner, io, DecodePartition(cfg.partition, plan), backend, policy)  # type: ignore[arg-type]
    p = PrefillWorker(cfg, runner, io, backend, OVERALLOCATED)  # type: ignore[arg-type]
    return d, p, io


def serve(d: DecodeWorker, p: PrefillWorker, io: FakeIO, reqs: list[m.NewRequest], turns: int = 400) -> list[Any]:
    """Both loops, alternating, the messages carried between them; what the prefill worker was told, in order."""
    told: list[Any] = []
    io.inbox += reqs
    for _ in range(turns):
        io.seat = "decode"
        d.turn()
        io.seat = "prefill"
        for msg in io.sent["d2p"]:  # in order: a SetPartition before the KVReadys it concerns
            told.append(msg)
            p.handle(msg)
        io.sent["d2p"].clear()
        while p.waiting_prefill:
            p.prefill_step()
        io.seat = "decode"
        io.inbox += io.sent["p2d"]
        io.sent["p2d"].clear()
        if not d.sched.reqs and not d.inflight and not io.inbox:
            return told
    raise AssertionError(f"requests still running: {list(d.sched.reqs)}")


def streams(io: FakeIO) -> dict[str, list[m.TokenOut]]:
    out: dict[str, list[m.TokenOut]] = defaultdict(list)
    for label in ("d2r", "p2r"):
        for b in io.of(label, m.TokenBatch):
            for t in b.tokens:
                out[t.req_id].append(t)
    return {k: sorted(v, key=lambda t: t.index) for k, v in out.items()}


def phases(k: int, state: ShapeState, split: str) -> StepShape:
    """Fused for 6 turns (prompts chunked here, the first to its end), split for 6 (the rest go to prefill, those
    chunked here from their last full block), and again; a decode-alone turn now and then."""
    if k % 13 == 12:
        return DecodeAlone(split)
    return Fused(16) if (k // 6) % 2 == 0 else Split(split, 48)


@pytest.mark.parametrize("two_configs", [False, True], ids=["one configuration", "two configurations"])
def test_forced_transitions_mid_request_keep_greedy_outputs_and_free_every_block(
        smollm: tuple[LLM, list[list[int]], list[list[int]]], two_configs: bool) -> None:
    check_transitions(*smollm, two_configs)


@pytest.mark.slow
def test_forced_transitions_with_the_embedded_smollm2() -> None:
    """The same with the embedded SmolLM2 (real weights: near-tied logits would show a wrong K/V)."""
    check_transitions(*model_and_reference(None), two_configs=True)


def check_transitions(llm: LLM, prompts: list[list[int]], want: list[list[int]], two_configs: bool) -> None:
    split = "split16" if two_configs else OVERALLOCATED
    policy = ScriptedPolicy(lambda k, st: phases(k, st, split))
    d, p, io = workers(llm, policy, two_configs)
    free0 = d.sched.blocks.num_free
    sampled_here: set[str] = set()  # requests whose first token a fused step sampled (their last chunk computed here)
    launched = d.sched.launched

    def spy(batch: Any, now: float = 0.0) -> None:
        sampled_here.update(c.req.req_id for c in getattr(batch, "chunks", ()) if c.samples and not c.req.outputs)
        launched(batch, now)

    d.sched.launched = spy  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    told = serve(d, p, io, [m.NewRequest(f"q{i}", pr, greedy, float(i)) for i, pr in enumerate(prompts)])
    got = streams(io)
    for i, w in enumerate(want):
        toks = got[f"q{i}"]
        assert [t.index for t in toks] == list(range(NEW)), i
        assert [t.token_id for t in toks] == w, f"q{i} (prompt of {len(prompts[i])} tokens) diverged"
    assert not io.of("d2r", m.Finished)
    # every path served first tokens: chunked here to the end (their first token from the decode worker, with its
    # times), computed by the prefill worker (handed over in a KVReady), and chunked here, then handed over by a
    # split step from its last full block (hand_over: prefill computed the rest, its first token as the fused
    # step would have sampled it)
    kvs = [x for x in told if isinstance(x, m.KVReady)]
    assert sampled_here and {x.req_id for x in kvs if not x.outputs} - sampled_here, (sampled_here, kvs)
    over = [x for x in kvs if x.computed_tokens > x.cached_tokens]
    assert over and any(x.computed_tokens == 0 for x in kvs), [(x.req_id, x.computed_tokens) for x in kvs]
    assert all(x.computed_tokens % d.sched.blocks.block_size == 0 for x in over)
    assert any(s.current == Fused(16) for s in policy.states) and any(isinstance(s.current, Split)
                                                                      for s in policy.states)
    assert d.sched.num_preemptions > 0  # the small pool: recomputed here or by prefill
    # every block back; nothing held
    assert d.sched.blocks.num_free == free0 and not p.waiting_prefill and d.runner.tokens.in_use == 0
    assert len(d.grammar) == 0
    # every landed step's time went to the policy, with its shape
    assert policy.timings and all(t.measured_ms > 0 for t in policy.timings)
    assert {type(t.shape) for t in policy.timings} >= {Fused, Split}
    assert all(t.chunk_tokens == 0 for t in policy.timings if not isinstance(t.shape, Fused))
    assert any(t.chunk_tokens > 0 for t in policy.timings)
    # the same timings, counted by kind, reach the router in the worker's Stats (engine/step_tally.py)
    tally = StepTally(d.cfg.partition.slo_itl_ms)
    for x in policy.timings:
        tally.add(x)
    kinds = tally.snapshot()
    assert {"fused", "split", "alone"} <= set(kinds) and sum(k.steps for k in kinds.values()) == len(policy.timings)
    d._last_stats = 0.0  # the Stats are due: sent at this publish
    d.publish()
    last = io.of("d2r", m.Stats)[-1]
    assert last.step_kinds == kinds and last.step_correction == {}  # a scripted policy corrects nothing
    if two_configs:  # each switch told prefill first; fused steps ran on the whole GPU, split ones on the split
        sets = [x.config for x in told if isinstance(x, m.SetPartition)]
        assert sets and sets[0] == "split16" and set(sets) == {"split16", OVERALLOCATED}
        assert all(a != b for a, b in zip(sets, sets[1:], strict=False))
        assert d.partition.steps.keys() == {"split16", OVERALLOCATED}


def test_the_one_engines_policies_by_mode(smollm: tuple[LLM, list[list[int]], list[list[int]]]) -> None:
    """Hybrid mode's `AlwaysFused` (no prefill worker: nothing is sent to one) and rapid mode's `AlwaysSplit` (every
    prompt goes to the prefill worker) give the same greedy tokens as LLM; a policy that asks for a split step
    without a prefill worker is refused by name."""
    llm, prompts, want = smollm
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    reqs = [m.NewRequest(f"q{i}", pr, greedy, float(i)) for i, pr in enumerate(prompts)]
    d, p, io = workers(llm, AlwaysFused(), False)
    told = serve(d, p, io, reqs)
    assert not told and not io.sent["p2r"]  # no prefill worker involved
    assert [[t.token_id for t in streams(io)[f"q{i}"]] for i in range(len(reqs))] == want
    d, p, io = workers(llm, None, False)
    assert isinstance(d.policy, AlwaysSplit)
    told = serve(d, p, io, reqs)
    assert {x.req_id for x in told if isinstance(x, m.KVReady)} == {r.req_id for r in reqs}
    assert [[t.token_id for t in streams(io)[f"q{i}"]] for i in range(len(reqs))] == want
    d, p, io = workers(llm, ScriptedPolicy([Split(OVERALLOCATED, 48)], workers=("decode",), name="bad"), False)
    io.inbox.append(reqs[0])
    with pytest.raises(RuntimeError, match="'bad' asked for a split step, but it runs without a prefill worker"):
        d.turn()


def test_no_async_scheduling_gives_the_same_tokens(smollm: tuple[LLM, list[list[int]], list[list[int]]]) -> None:
    """`--no-async-scheduling` in the one loop: each step is recorded before the next is planned."""
    llm, prompts, want = smollm
    cfg = dataclasses.replace(llm.config, scheduler=dataclasses.replace(llm.config.scheduler, async_scheduling=False))
    io = FakeIO()
    plan = PartitionPlan("none", CONFIGS[:1], None, "test")
    d = DecodeWorker(cfg, llm.engine.runner, io, DecodePartition(cfg.partition, plan), None,  # type: ignore[arg-type]
                     ScriptedPolicy(lambda k, st: phases(k, st, OVERALLOCATED)))
    p = PrefillWorker(cfg, llm.engine.runner, io, CpuSplits(), OVERALLOCATED)  # type: ignore[arg-type]
    launched = []
    real = d._step

    def step() -> bool:
        out = real()
        launched.append(len(d.inflight))
        return out

    d._step = step  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    serve(d, p, io, [m.NewRequest(f"q{i}", pr, greedy, float(i)) for i, pr in enumerate(prompts)])
    assert launched and set(launched) == {0}  # nothing left in flight after a step
    assert [[t.token_id for t in streams(io)[f"q{i}"]] for i in range(len(prompts))] == want
    assert d.runner.tokens.in_use == 0 and d.sched.blocks.num_free == d.sched.blocks.num_blocks


@pytest.mark.parametrize("two_configs", [False, True], ids=["one configuration", "two configurations"])
def test_duet_without_an_slo_fuses_every_step_and_never_splits(
        smollm: tuple[LLM, list[list[int]], list[list[int]]], two_configs: bool) -> None:
    """`--mode rapid --policy duet --slo-itl-ms none`: the decode worker's own policy (`default_policy`) runs every
    step fused with the whole token budget, on a plan without a cost model (one configuration, as on a CPU:
    `DuetWithoutSlo`) and on an adaptive one (two configurations, the roofline and its peaks: `DuetPolicy`). Nothing
    is handed to the prefill worker beside it and no configuration is switched; greedy tokens as LLM's, every block
    back."""
    llm, prompts, want = smollm
    cfg = dataclasses.replace(llm.config, partition=PartitionConfig(policy="duet", slo_itl_ms=None))
    configs = CONFIGS if two_configs else CONFIGS[:1]
    peaks = Peaks(782e12, 2.98e12, 132, device="H100-like") if two_configs else None
    profile = roofline_profile(cfg.model_config, "cpu", MODEL, peaks, configs, [1, 8], [512], 48) if peaks else None
    plan = PartitionPlan("none", configs, profile, "test", peaks)
    io, backend = FakeIO(), CpuSplits()
    d = DecodeWorker(cfg, llm.engine.runner, io, DecodePartition(cfg.partition, plan), backend)  # type: ignore[arg-type]
    p = PrefillWorker(cfg, llm.engine.runner, io, backend, OVERALLOCATED)  # type: ignore[arg-type]
    assert isinstance(d.policy, DuetPolicy if two_configs else DuetWithoutSlo) and d.has_prefill
    assert d.partition.adaptive == two_configs
    assert (d.queue_head, d.reads_queue) == (two_configs, two_configs)  # DuetPolicy: the queue's head (ShapeState)
    shapes: list[StepShape] = []
    decide = d.policy.decide
    cut = 0

    def recorded(st: ShapeState) -> StepShape:
        nonlocal cut
        whole = d.sched.pending_prefill()
        assert st.waiting == (queue_head(whole, st.max_chunk_tokens) if two_configs else ())  # DuetWithoutSlo: none
        cut += 0 < len(st.waiting) < len(whole)
        shapes.append(decide(st))
        return shapes[-1]

    d.policy.decide = recorded  # type: ignore[method-assign]
    free0 = d.sched.blocks.num_free
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    told = serve(d, p, io, [m.NewRequest(f"q{i}", pr, greedy, float(i)) for i, pr in enumerate(prompts)])
    assert told == [] and not io.sent["p2r"]  # no KVReady, no SetPartition: the prefill worker never had work
    assert [[t.token_id for t in streams(io)[f"q{i}"]] for i in range(len(prompts))] == want
    assert shapes and not any(isinstance(s, Split) for s in shapes)
    assert (cut > 0) == two_configs  # the queue was longer than a step's budget (48 tokens) now and then
    assert Fused(cfg.scheduler.max_num_batched_tokens) in shapes  # the whole budget (48 tokens), decodes included
    assert set(shapes) <= {Fused(48), DecodeAlone(OVERALLOCATED)}, set(shapes)
    assert d.partition.steps.keys() == {OVERALLOCATED} and d.partition.num_switches == 0
    assert d.sched.blocks.num_free == free0 and not p.waiting_prefill and d.runner.tokens.in_use == 0
    # the Stats' step counts: no split, none over an SLO there is none of; DuetPolicy's predictions are in them and
    # its correction is sent beside (DuetWithoutSlo predicts and corrects nothing)
    d._last_stats = 0.0
    d.publish()
    last = io.of("d2r", m.Stats)[-1]
    assert set(last.step_kinds) <= {"fused", "fused_decode", "alone"} and last.step_kinds["fused"].steps > 0
    assert all(k.over_slo == 0 for k in last.step_kinds.values())
    fused = last.step_kinds["fused"]
    if two_configs:
        assert fused.predicted_ms > 0 and fused.predicted_measured_ms == pytest.approx(fused.measured_ms)
        assert set(last.step_correction) == {"fused", "split", "decode"}
    else:
        assert fused.predicted_ms == 0 and last.step_correction == {}


def test_duet_adapts_its_margin_in_the_decode_worker(smollm: tuple[LLM, list[list[int]], list[list[int]]]) -> None:
    """DuetPolicy with an SLO in the decode worker (the adaptive CPU plan: two configurations, a roofline and its
    peaks) folds each landed step into its SLO margin (partition/margin.py). The situation is forced: an ITL SLO of
    0.01 ms that every CPU step's gap is over, and a margin that moves from the first counted gap, so each binding
    fused step lowers it; the worker's Stats carry the margin it ends with. Greedy tokens as LLM's, every block back."""
    from rapidserve.partition.margin import MarginParams

    llm, prompts, want = smollm
    cfg = dataclasses.replace(llm.config, partition=PartitionConfig(policy="duet", slo_itl_ms=0.01))
    peaks = Peaks(782e12, 2.98e12, 132, device="H100-like")
    plan = PartitionPlan("none", CONFIGS, roofline_profile(cfg.model_config, "cpu", MODEL, peaks, CONFIGS, [1, 8],
                                                            [512], 48), "test", peaks)
    io, backend = FakeIO(), CpuSplits()
    d = DecodeWorker(cfg, llm.engine.runner, io, DecodePartition(cfg.partition, plan), backend)  # type: ignore[arg-type]
    p = PrefillWorker(cfg, llm.engine.runner, io, backend, OVERALLOCATED)  # type: ignore[arg-type]
    policy = d.policy
    assert isinstance(policy, DuetPolicy) and policy.margin_params is not None and policy.margin.margin == 0.9
    policy.margin_params = MarginParams(min_gaps=1.0, binding=1e-6)  # move from the first gap; every step binds
    free0 = d.sched.blocks.num_free
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    serve(d, p, io, [m.NewRequest(f"q{i}", pr, greedy, float(i)) for i, pr in enumerate(prompts)])
    assert [[t.token_id for t in streams(io)[f"q{i}"]] for i in range(len(prompts))] == want
    assert d.sched.blocks.num_free == free0
    assert policy.margin.gaps > 0 and policy.margin.over == pytest.approx(policy.margin.gaps)  # every gap over
    assert policy.margin.margin < 0.9
    d._last_stats = 0.0
    d.publish()
    assert io.of("d2r", m.Stats)[-1].step_correction["slo_margin"] == pytest.approx(policy.margin.margin)


def _plan(cfg: EngineConfig, configs: list[Configuration], with_profile: bool, with_peaks: bool) -> PartitionPlan:
    peaks = Peaks(782e12, 2.98e12, 132, device="H100-like")
    profile = roofline_profile(cfg.model_config, "cpu", MODEL, peaks, configs, [1, 8], [512], 48) if with_profile \
        else None
    return PartitionPlan("none", configs, profile, "test", peaks if with_peaks else None)


SPLITS_ONLY = [Configuration("split16", 16, 116), Configuration("split64", 64, 68)]


@pytest.mark.parametrize(("policy", "slo", "configs", "profile", "peaks", "key"), [
    ("duet", 50.0, CONFIGS, True, True, OVERALLOCATED),  # adaptive: fused steps on the whole GPU
    ("duet", None, CONFIGS[:1], False, False, OVERALLOCATED),  # no SLO: every step fused, whatever the plan
    ("duet", None, SPLITS_ONLY, False, False, "split16"),  # no whole-GPU configuration: the plan's initial one
    ("duet", 50.0, CONFIGS[:1], False, False, ""),  # an SLO on a plan that cannot switch: always split
    ("duet", 50.0, CONFIGS, True, False, ""),  # no peaks measured (no cost model): always split
    ("rapid", 50.0, CONFIGS, True, True, ""),  # rapid and drift never fuse in the decode worker
    ("drift", 50.0, CONFIGS, True, True, ""),
])
def test_which_decode_workers_capture_graphs_for_fused_steps(policy: str, slo: float | None,
                                                             configs: list[Configuration], profile: bool,
                                                             peaks: bool, key: str) -> None:
    """`fused_graph_key` (PlanWire.fused_graphs: the decode ranks capture the fused steps' piecewise prefill graphs
    on that configuration's stream) says a key exactly where `default_policy` runs fused steps, on the configuration
    `DecodeWorker.fused_config` runs them on."""
    base, _ = build_engine_config(MODEL, device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=64)
    cfg = dataclasses.replace(base, partition=PartitionConfig(policy=policy, slo_itl_ms=slo))
    plan = _plan(cfg, configs, profile, peaks)
    assert fused_graph_key(cfg, plan) == key
    assert fused_steps(cfg, plan) == bool(key)
    part = DecodePartition(cfg.partition, plan)
    fuses = not isinstance(default_policy(cfg, part, lambda: (0, 0, False, None)), AlwaysSplit)
    assert fuses == bool(key)


def test_duet_fused_steps_replay_the_pieces_captured_for_their_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the GPU's decode worker does with `PlanWire.fused_graphs` (tp_workers.capture_decode), on the CPU: the
    piecewise prefill path captured under the fused steps' configuration (the pieces recorded as plain calls,
    `eager=True`, where a GPU captures graphs), and every fused step of up to the largest bucket (48-token budget:
    16, 32, 64) replays it under that key. Greedy tokens as `LLM.generate`'s (eager), every block back."""
    llm, prompts, want = model_and_reference(MODEL)
    cfg = dataclasses.replace(llm.config, partition=PartitionConfig(policy="duet", slo_itl_ms=None))
    peaks = Peaks(782e12, 2.98e12, 132, device="H100-like")
    profile = roofline_profile(cfg.model_config, "cpu", MODEL, peaks, CONFIGS, [1, 8], [512], 48)
    plan = PartitionPlan("none", CONFIGS, profile, "test", peaks)
    key = fused_graph_key(cfg, plan)
    assert key == OVERALLOCATED
    runner = llm.engine.runner
    runner.capture_prefill_graphs(key=key, show_progress=False, eager=True)
    graphs = runner._prefill_graphs
    assert graphs is not None and set(graphs.sets) == {key} and graphs.sizes == (16, 32, 64)
    replays: list[tuple[str, int]] = []
    run = graphs.run

    def counted(key: str, bucket: int, *args: Any, **kwargs: Any) -> Any:
        replays.append((key, bucket))
        return run(key, bucket, *args, **kwargs)

    monkeypatch.setattr(graphs, "run", counted)
    io, backend = FakeIO(), CpuSplits()
    d = DecodeWorker(cfg, runner, io, DecodePartition(cfg.partition, plan), backend)  # type: ignore[arg-type]
    p = PrefillWorker(cfg, runner, io, backend, OVERALLOCATED)  # type: ignore[arg-type]
    assert isinstance(d.policy, DuetPolicy) and d.fused_config == key
    free0 = d.sched.blocks.num_free
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    serve(d, p, io, [m.NewRequest(f"q{i}", pr, greedy, float(i)) for i, pr in enumerate(prompts)])
    assert [[t.token_id for t in streams(io)[f"q{i}"]] for i in range(len(prompts))] == want
    assert replays and {k for k, _ in replays} == {key} and {b for _, b in replays} <= {16, 32, 64}
    assert d.sched.blocks.num_free == free0 and d.runner.tokens.in_use == 0
