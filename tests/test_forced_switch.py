"""The forcing behind tests/test_engine_gpu.py's adaptive runs (tests/forced_switch.py), checked on CPU: the
rapid manager on the forcing profile switches exactly on whether prefill has work, for any batch, context and
pending work, on every GPU shape; duet (DuetPolicy on the profile's costs) with the test's SLO splits whenever
decode runs beside pending prompts and takes the whole GPU back when nothing is pending, at any GPU speed and
with its online correction at either clamp; the GPU test's request sequence (a holder, then eight prompts,
twice) switches at least twice a round under both; and its hand-over test's two prompts, under duet and the real
decode scheduler, leave the second chunking at the first split, which hands it to the prefill worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapidserve.block_manager import BlockManager
from rapidserve.config import EngineConfig, SchedulerConfig
from rapidserve.engine import messages as m
from rapidserve.engine.decode_scheduler import DecodeScheduler, StepBatch
from rapidserve.loader.presets import preset_config
from rapidserve.partition.backend import Granularity, check_configurations, cu_granularity, plan_configurations
from rapidserve.partition.correction import DEFAULT_CORRECTION, Correction
from rapidserve.partition.manager import ManagerState, decide, make_state
from rapidserve.partition.plan import PartitionPlan
from rapidserve.partition.policies import AdaptiveParams, DuetPolicy, decide_adaptive
from rapidserve.partition.policy import PendingWork, WaitingPrefill
from rapidserve.partition.profile import OVERALLOCATED, load_profile, model_label, save_profile, validate_profile
from rapidserve.partition.roofline import Peaks
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition.shape import DecodeAlone, Fused, ShapeState, Split, StepShape, StepTiming
from rapidserve.partition.step_costs import ProfileCosts
from rapidserve.partition.step_policies import make_step_policy
from rapidserve.partition_config import PartitionConfig
from rapidserve.sampling_params import SamplingParams
from tests.forced_switch import DUET_SLO_MS, forcing_profile, split_for_prefill

MODEL = "preset:tiny-llama"
SHARES = (0.25, 0.5)  # tests/test_engine_gpu.py's decode shares
BUDGET = 64  # and its prefill token budget
DEVICES = {  # granularities of the GPUs the test may run on (H100 and H200: 132 SMs in groups of 8)
    "NVIDIA H200": Granularity(132, 8, 8),
    "NVIDIA B200": Granularity(148, 8, 8),
    "NVIDIA H100 PCIe": Granularity(114, 8, 8),
    "AMD Instinct MI300X": cu_granularity(304),
}
NO_WORK = None
WORK = [PendingWork(5, 5), PendingWork(64, 150), PendingWork(409, 150), PendingWork(10_000, 4096)]


@pytest.mark.parametrize("gpu", list(DEVICES))
def test_the_forcing_profile_is_a_valid_profile_of_the_device(gpu: str, tmp_path: Path) -> None:
    g = DEVICES[gpu]
    configs = plan_configurations(g, SHARES)
    prof = forcing_profile(gpu, MODEL, configs, g.total, BUDGET)
    validate_profile(prof)
    check_configurations(prof.configurations, g, "forcing profile")  # what resolve_plan checks
    path = tmp_path / "forced.json"
    save_profile(prof, path)
    assert load_profile(path, expect_gpu=gpu, expect_model=model_label(MODEL)) == prof  # as --profile is read


@pytest.mark.parametrize("gpu", list(DEVICES))
@pytest.mark.parametrize("interpolate", [False, True])
def test_rapid_on_the_forcing_profile_switches_on_pending_work_alone(gpu: str, interpolate: bool) -> None:
    g = DEVICES[gpu]
    configs = plan_configurations(g, SHARES)
    prof = forcing_profile(gpu, MODEL, configs, g.total, BUDGET)
    split = split_for_prefill(configs)
    for current in [c.name for c in configs]:
        for batch in (0, 1, 3, 8, 9, 16, 40, 256):  # 0: no decode running; past 16: beyond the buckets
            for context in (1, 6, 200, 1024, 5000):
                for work in [NO_WORK, *WORK]:
                    d, state = decide(make_state(current), decode_batch=max(batch, 1), decode_context=context,
                                      prefill_pending=work is not None, slo_itl_ms=50.0, profile=prof,
                                      hysteresis_steps=0, decode_running=batch > 0,
                                      prefill_tokens=work.tokens if work else None,
                                      prefill_longest=work.longest if work else None, prefill_budget=BUDGET,
                                      interpolate=interpolate)
                    want = split if work is not None else OVERALLOCATED
                    assert d.config == want and state.config == want, (current, batch, context, work, d.reason)
                    assert d.switched == (current != want)


def rapid_partition(g: Granularity) -> DecodePartition:
    configs = plan_configurations(g, SHARES)
    prof = forcing_profile("NVIDIA H200", MODEL, configs, g.total, BUDGET)
    plan = PartitionPlan("cuda-green", configs, prof, "forcing profile")
    return DecodePartition(PartitionConfig(hysteresis_steps=0, decode_shares=SHARES), plan, preset_config("tiny-llama"),
                           BUDGET)


LENGTHS = [5, 150, 12, 70, 33, 90, 8, 41]  # the GPU test's prompts


def test_the_gpu_tests_round_switches_under_rapid() -> None:
    """A round as decode sees it: the holder waits alone (engine idle), runs alone, then the eight arrive and are
    prefilled while it (and, one by one, they) decode, then all are done. Each phase is one or more step
    boundaries; the order of prefill completions does not matter."""
    dp = rapid_partition(DEVICES["NVIDIA H200"])
    split = split_for_prefill(dp.plan.configurations)
    for round_ in range(2):
        s = dp.advance(0, 0, True, PendingWork(5, 5))  # the holder waits at the boundary before admission
        assert s is not None and (s.old, s.new) == (OVERALLOCATED, split)
        s = dp.advance(1, 6, False, None)  # the holder decodes, nothing pending
        assert s is not None and s.new == OVERALLOCATED
        for done in range(len(LENGTHS)):  # the eight pending while the holder and the finished ones decode
            left = LENGTHS[done:]
            s = dp.advance(1 + done, 20, True, PendingWork(sum(left), max(left)))
            assert (s is not None) == (done == 0) and dp.current == split
        s = dp.advance(9, 40, False, None)
        assert s is not None and s.new == OVERALLOCATED
        assert dp.num_switches == 4 * (round_ + 1)


H100 = Peaks(matmul_flops=794e12, hbm_bw=2.98e12, num_compute_units=132)
SPEEDS = [1, 10, 1000]  # GPUs 1x, 10x and 1000x an H100 (the peaks the plan measured at start-up)
LO, HI, LO_SPLIT = DEFAULT_CORRECTION.lo, DEFAULT_CORRECTION.hi, DEFAULT_CORRECTION.lo_split
CORRECTIONS = [  # the online correction's ratios (fused, split, decode) at both clamps, and the worst mixes
    Correction(), Correction(LO, LO, LO), Correction(HI, HI, HI), Correction(LO, HI, HI), Correction(HI, LO, LO),
    Correction(LO, LO_SPLIT, LO), Correction(HI, LO_SPLIT, LO)]  # the split's own lower clamp
LIMIT = AdaptiveParams().margin * DUET_SLO_MS


def duet_policy(gpu: str, speedup: float, lookup: str = "auto") -> DuetPolicy:
    """The policy the decode worker runs for test_engine_gpu's `adaptive-duet` (`make_step_policy` on the plan
    `resolve_plan` makes of the forcing profile given as --profile, with peaks measured on a GPU `speedup` x an
    H100): DuetPolicy on the profile's costs, whatever the peaks; `lookup`: its --profile-lookup (the GPU test's is
    the default, auto)."""
    g = DEVICES[gpu]
    configs = plan_configurations(g, SHARES)
    prof = forcing_profile(gpu, MODEL, configs, g.total, BUDGET)
    peaks = Peaks(matmul_flops=H100.matmul_flops * speedup, hbm_bw=H100.hbm_bw * speedup, num_compute_units=g.total)
    plan = PartitionPlan("cuda-green", configs, prof, "forcing profile", peaks)
    pcfg = PartitionConfig(policy="duet", slo_itl_ms=DUET_SLO_MS, hysteresis_steps=0, decode_shares=SHARES,
                           profile_lookup=lookup)
    cfg = EngineConfig(MODEL, preset_config("tiny-llama"), partition=pcfg,
                       scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET))
    policy = make_step_policy(cfg, plan)
    assert isinstance(policy, DuetPolicy) and isinstance(policy.costs, ProfileCosts)
    assert policy.params.hysteresis_steps == 0
    return policy


def shape_state(contexts: tuple[int, ...], waiting: tuple[WaitingPrefill, ...], busy: int,
                current: StepShape) -> ShapeState:
    return ShapeState(contexts, waiting, busy, current, DUET_SLO_MS, BUDGET)


def is_split(policy: DuetPolicy, config: str) -> bool:
    return any(c.name == config and c.decode_units > 0 for c in policy.costs.configurations)


WAITING = {  # prompt work as decode's queue shows it: one token of a prefix-cached prompt ... far past the budget
    "cached": (WaitingPrefill("c", 0.0, 1, prefix=149),),
    "holder": (WaitingPrefill("h", 0.0, 5),),
    "eight": tuple(WaitingPrefill(f"r{i}", 0.0, n) for i, n in enumerate([5, 150, 12, 70, 33, 90, 8, 41])),
    "long": (WaitingPrefill("l", 0.0, 10_000),),
}


@pytest.mark.parametrize(("gpu", "speedup", "lookup"),
                         [(g, 1, i) for g in ("NVIDIA H200", "NVIDIA H100 PCIe", "AMD Instinct MI300X")
                          for i in ("auto", "round-up", "interpolate")]
                         + [("NVIDIA H200", s, "auto") for s in SPEEDS[1:]])
def test_duet_on_the_forcing_profile_splits_beside_decode_and_returns_to_the_whole_gpu(
        gpu: str, speedup: float, lookup: str) -> None:
    """The pure decision over a table of states, the correction at both clamps, from every configuration and
    hysteresis memory: decode running + prompts pending -> a split meeting the SLO (no fused chunk fits, by
    far); nothing pending, prefill worker idle -> decode alone on the whole GPU; nothing pending, prefill worker
    busy -> decode stays on a split; no decode running, nothing with the prefill worker -> fused (no switch)."""
    policy = duet_policy(gpu, speedup, lookup)
    costs, names = policy.costs, [c.name for c in policy.costs.configurations]
    for current in names:
        shapes = [DecodeAlone(current)] + ([Fused(BUDGET)] if current == OVERALLOCATED else [Split(current, BUDGET)])
        memories = (None, ManagerState(current, 0), ManagerState(current, 99))
        for shape, held in ((s, h) for s in shapes for h in memories):
            for corr in CORRECTIONS:
                for batch in (1, 9, 16, 256):
                    for context in (6, 1024, 5000):
                        contexts = (context,) * batch
                        # the smallest fused step there is, one prompt token, breaks the SLO 50x or more
                        assert costs.fused_ms(contexts, [(1, 149)]) * corr.fused > 50 * LIMIT
                        for what, waiting in WAITING.items():
                            for busy in (0, 150):
                                d, _ = decide_adaptive(shape_state(contexts, waiting, busy, shape), costs, corr, held,
                                                       policy.params)
                                case = (current, shape, held, corr, batch, context, what, busy, d.reason)
                                assert isinstance(d.shape, Split) and is_split(policy, d.shape.config), case
                                assert d.meets_slo and d.predicted_ms is not None and d.predicted_ms <= LIMIT, case
                        d, _ = decide_adaptive(shape_state(contexts, (), 0, shape), costs, corr, held, policy.params)
                        assert d.shape == DecodeAlone(OVERALLOCATED), (current, shape, held, corr, batch, d.reason)
                        d, _ = decide_adaptive(shape_state(contexts, (), 150, shape), costs, corr, held, policy.params)
                        assert isinstance(d.shape, DecodeAlone) and is_split(policy, d.shape.config), d.reason
                        if is_split(policy, current):  # the split kept for the batch it launched
                            assert d.shape == DecodeAlone(current), d.reason
                d, _ = decide_adaptive(shape_state((), (), 0, shape), costs, corr, held, policy.params)
                assert d.shape == DecodeAlone(OVERALLOCATED), d.reason  # idle (after the abort): the whole GPU
                for waiting in WAITING.values():
                    d, _ = decide_adaptive(shape_state((), waiting, 0, shape), costs, corr, held, policy.params)
                    assert d.shape == Fused(BUDGET), d.reason  # no decode running: fused, on the whole GPU


def land(policy: DuetPolicy, shape: StepShape, batch: int, chunk: int, factor: float) -> None:
    """The step just decided lands, taking `factor` x its prediction (or 1 ms where none)."""
    assert policy.last is not None
    predicted = policy.last.model_ms
    policy.observe(StepTiming(shape, batch, chunk, predicted, factor * predicted if predicted else 1.0))


@pytest.mark.parametrize("speedup", SPEEDS)
@pytest.mark.parametrize("factor", [1e-3, 1.0, 1e3])  # the GPU is far faster / as fast / far slower than predicted
def test_the_gpu_tests_round_switches_twice_under_duet(speedup: float, factor: float) -> None:
    """test_engine_gpu's rounds as the decode worker's policy sees them, each step landing at `factor` x its
    prediction (so the correction ratios run to a clamp): a holder is fused in while decode is idle and decodes
    alone on the whole GPU; the eight arrive beside it -> a split (prompts to the prefill worker), kept while the
    prefill worker holds prompts; all done -> decode alone on the whole GPU; the holder aborted: still there.
    The second round's prompts are prefix-cached (one token each to compute). Two switches a round."""
    policy = duet_policy("NVIDIA H200", speedup)
    configs, switches = [OVERALLOCATED], 0

    def step(contexts: tuple[int, ...], waiting: tuple[WaitingPrefill, ...], busy: int, chunk: int = 0,
             repeat: int = 40) -> StepShape:
        nonlocal switches
        for _ in range(repeat):
            shape = policy.decide(shape_state(contexts, waiting, busy, policy.last.shape if policy.last else
                                              DecodeAlone(OVERALLOCATED)))
            config = OVERALLOCATED if isinstance(shape, Fused) else shape.config
            switches += config != configs[-1]
            configs.append(config)
            land(policy, shape, len(contexts), chunk if isinstance(shape, Fused) else 0, factor)
        return shape

    lengths = [5, 150, 12, 70, 33, 90, 8, 41]
    for round_ in range(2):
        waiting = tuple(WaitingPrefill(f"r{round_}-{i}", 0.0, 1 if round_ else n, prefix=n - 1 if round_ else 0)
                        for i, n in enumerate(lengths))
        assert step((), (WaitingPrefill("hold", 0.0, 5),), 0, chunk=5, repeat=1) == Fused(BUDGET)
        assert step((6,), (), 0) == DecodeAlone(OVERALLOCATED)
        split = step((7,), waiting, 0, repeat=1)
        assert isinstance(split, Split) and split.config != OVERALLOCATED, policy.last
        for done in range(len(lengths)):  # the prefill worker holds some, the rest wait; the done ones decode
            s = step((20,) * (1 + done), waiting[done + 1:], 64)
            assert not isinstance(s, Fused) and s.config == split.config, s  # kept: Split, then DecodeAlone
        assert step((30,) * 9, (), 0) == DecodeAlone(OVERALLOCATED)
        assert step((), (), 0) == DecodeAlone(OVERALLOCATED)  # the last holder aborted
        assert switches == 2 * (round_ + 1), configs
    want = HI if factor > 1 else LO if factor < 1 else 1.0
    want_split = LO_SPLIT if factor < 1 else want  # the split kind may fall further (partition/correction.py)
    assert policy.correction.split == pytest.approx(want_split) and policy.correction.decode == pytest.approx(want)
    assert all(policy.correction.split_ratio(c) == pytest.approx(want_split)
               for c, _, _ in policy.correction.split_configs)


@pytest.mark.parametrize("factor", [1e-3, 1e3])  # the GPU far faster / far slower than predicted
@pytest.mark.parametrize("p2_at", [0, 7, 14])  # the fused turn by which P2 is in decode's queue
def test_the_gpu_hand_over_tests_prompts_chunk_p2_with_p1s_last_tokens_then_a_split_hands_it_over(
        factor: float, p2_at: int) -> None:
    """test_engine_gpu's `test_duet_hands_a_prompt_chunked_in_decode_to_the_prefill_worker` as the decode worker's
    scheduler and policy see it (the real DecodeScheduler, each step landing before the next turn, as the switch to a
    split synchronizes the fused step): P1 (14 x BUDGET + 5 tokens) is fused alone while no decode runs, P2 (200)
    waiting behind it, whichever of those 15 turns P2 reached the queue by; the 15th fused step computes P1's last 5
    tokens and P2's first 59, the next turn splits (P1 decodes) and hands P2 over from its last full block, counted."""
    policy = duet_policy("NVIDIA H200", 1)
    s = DecodeScheduler(BlockManager(256, 16, 0.0, enable_caching=True, salt=b"m"), 256, (2,), 1024)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (64, 16)]
    p1 = m.NewRequest("p1", [3 + i % 1000 for i in range(14 * BUDGET + 5)], greedy[0], 0.0)
    p2 = m.NewRequest("p2", [1100 + i % 150 for i in range(200)], greedy[1], 0.0)
    s.add(p1)
    chunks: list[list[tuple[str, int, int]]] = []
    handed: list[m.KVReady] = []
    for turn in range(40):
        if turn == p2_at:
            s.add(p2)
        shape = policy.decide(s.shape_state(policy.last.shape if policy.last else DecodeAlone(OVERALLOCATED),
                                            DUET_SLO_MS, BUDGET, True, True))
        if isinstance(shape, Split):
            handed = s.admit()
            if handed:
                break
        batch = s.plan(shape.chunk_tokens, BUDGET, True) if isinstance(shape, Fused) else StepBatch(s.schedule(True))
        assert batch is not None
        s.launched(batch)
        chunks.append([(c.req.req_id, c.start, c.length) for c in batch.chunks])
        s.record(batch.sampled, [(5, -0.5, None, None)] * len(batch.sampled))
        s.chunks_landed(batch.chunks)
        land(policy, shape, len(batch.decode), batch.chunk_tokens, factor)
    assert chunks == [[("p1", BUDGET * k, BUDGET)] for k in range(14)] + [[("p1", 14 * BUDGET, 5), ("p2", 0, 59)]]
    assert isinstance(shape, Split) and [r.req_id for r in s.running] == ["p1"], policy.last
    assert [(kv.req_id, kv.computed_tokens) for kv in handed] == [("p2", 48)] and s.num_hand_overs == 1
