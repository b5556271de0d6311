"""The drift prefill worker (engine/drift_prefill.py) on CPU with its channels replaced by lists (as in
tests/test_worker_faults.py) and the clock in the test's hands: batches launched a layer block at a time,
a short request preempting a long batch at a block boundary and the long one resumed first, the same
first tokens and K/V as the one-shot prefill worker, Drops of launched requests answered when their
batch ends, a failing batch isolated per request."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.engine import messages as m
from rapidserve.engine.decode_worker import DecodeWorker
from rapidserve.engine.drift_prefill import IDLE_S, DriftPrefillWorker
from rapidserve.engine.prefill_worker import PrefillWorker
from rapidserve.loader import resolve_model
from rapidserve.partition.backend import Granularity, PartitionBackend
from rapidserve.partition.drift import LinearModel
from rapidserve.partition.plan import PartitionPlan, open_streams, resolve_plan
from rapidserve.partition.profile import Configuration
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition_config import PartitionConfig
from rapidserve.runner import ModelRunner
from rapidserve.runner.prefill_task import PrefillTask
from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from tests.test_partition_manager import h100_profile
from tests.test_worker_faults import POISON, FakeIO

BUDGET = 200
# prefill ms = 1 ms/token (given); TTFT SLO = 100 ms + 1000 ms per 1K tokens; ITL SLO 50 ms: a 200-token
# batch (200 ms) runs one layer (of 3) per block, a 10-token one all three at once.
DRIFT = PartitionConfig(policy="drift", slo_ttft_ms=100.0, slo_ttft_ms_per_1k_tokens=1000.0,
                        drift_prefill_model=(0.0, 1.0))


@pytest.fixture(scope="module")
def setup() -> tuple[Any, ModelRunner]:
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=64,
                                 max_model_len=512, max_num_batched_tokens=BUDGET)
    cfg = dataclasses.replace(cfg, partition=DRIFT)
    source = resolve_model(cfg.model, preset_device=torch.device("cpu"), preset_dtype=torch.float32)
    return cfg, ModelRunner(cfg, source, show_progress=False)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


LONG, SHORT, OTHER = _tokens(BUDGET, 1), _tokens(10, 2), _tokens(150, 3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def kv(rid: str, prompt: list[int], blocks: list[int], arrival: float, params: SamplingParams = GREEDY) -> m.KVReady:
    return m.KVReady(m.NewRequest(rid, prompt, params, arrival), blocks)


L_KV = kv("long", LONG, list(range(13)), 9.90)
S_KV = kv("short", SHORT, [20], 9.95)
O_KV = kv("other", OTHER, list(range(21, 31)), 9.96)


def drift_worker(cfg: Any, runner: ModelRunner, io: FakeIO, clock: Clock, **partition: Any) -> DriftPrefillWorker:
    cfg = dataclasses.replace(cfg, partition=dataclasses.replace(cfg.partition, **partition))
    plan = resolve_plan(cfg, runner.device)
    models = {k: LinearModel(*v) for k, v in plan.wire().prefill_models.items()}
    io.seat = "prefill"
    return DriftPrefillWorker(cfg, runner, io, open_streams(plan.wire(), runner.device, ("prefill",)),  # type: ignore[arg-type]
                              plan.initial, models, clock)


def run_until_idle(w: DriftPrefillWorker, limit: int = 100) -> list[str]:
    """Tick until nothing is left; the decisions taken, in order."""
    actions = []
    for _ in range(limit):
        decided = w.last
        nap = w.tick()
        if w.last is not decided and w.last is not None and w.last.action != "idle":
            actions.append(w.last.action)
        if nap == IDLE_S and w.running is None and w.preempted is None:
            return actions
    raise AssertionError("the worker did not go idle")


def one_shot(cfg: Any, runner: ModelRunner, *kvs: m.KVReady) -> tuple[dict[str, m.TokenOut], torch.Tensor]:
    """The reference: the one-shot prefill worker, each request alone."""
    runner.kv_pool.tensor.zero_()
    io = FakeIO()
    io.seat = "prefill"
    w = PrefillWorker(cfg, runner, io, open_streams(resolve_plan(cfg, runner.device).wire(), runner.device,  # type: ignore[arg-type]
                                                    ("prefill",)), "overallocated")
    for x in kvs:
        w.handle(x)
        while w.waiting_prefill:
            w.prefill_step()
    return {d.req_id: d.token for d in io.of("p2d", m.PrefillDone)}, runner.kv_pool.tensor.clone()


def test_a_short_request_preempts_and_the_long_batch_resumes(setup: tuple[Any, ModelRunner]) -> None:
    cfg, runner = setup
    want, want_kv = one_shot(cfg, runner, L_KV, S_KV, O_KV)
    runner.kv_pool.tensor.zero_()
    io, clock = FakeIO(), Clock(10.0)
    w = drift_worker(cfg, runner, io, clock)
    w.handle(L_KV)
    assert w.tick() == 0.0 and w.last is not None and w.last.action == "start"
    assert w.last.layers_per_block == 1 and w.running is not None and w.running.task.layers_done == 1
    w.handle(S_KV)  # arrives while the long batch runs: 133 ms of it left would break its 110 ms SLO
    w.tick()
    assert w.last.action == "preempt" and w.preemptions == 1 and w.preempted is not None
    assert w.preempted.task.layers_done == 1 and w.running is not None and w.running.holds("short")
    # arrives during the preemption: it would miss its TTFT behind the long batch, but preempting for it
    # would break the long one's: it waits, and the preempted batch resumes first
    w.handle(O_KV)
    actions = run_until_idle(w)
    assert actions == ["resume", "continue", "start", "continue", "continue"]  # 150 tokens: one layer a block
    done = io.of("p2d", m.PrefillDone)
    assert [d.req_id for d in done] == ["short", "long", "other"]
    assert {d.req_id: d.token for d in done} == want
    assert torch.equal(runner.kv_pool.tensor, want_kv)  # every K/V as without preemption
    assert not w.waiting_prefill


def test_no_ttft_slo_no_preemption(setup: tuple[Any, ModelRunner]) -> None:
    cfg, runner = setup
    io = FakeIO()
    w = drift_worker(cfg, runner, io, Clock(10.0), slo_ttft_ms=None, slo_ttft_ms_per_1k_tokens=0.0)
    w.handle(L_KV)
    w.tick()
    w.handle(S_KV)
    assert run_until_idle(w) == ["continue", "continue", "start"]
    assert [d.req_id for d in io.of("p2d", m.PrefillDone)] == ["long", "short"] and w.preemptions == 0


def test_decode_step_estimate_sizes_the_blocks(setup: tuple[Any, ModelRunner]) -> None:
    cfg, runner = setup
    io = FakeIO()
    w = drift_worker(cfg, runner, io, Clock(10.0))
    w.handle(m.SetPartition("overallocated", 140.0))  # decode's step beside prefill: 140 ms
    w.handle(L_KV)
    w.tick()
    assert w.last is not None and w.last.layers_per_block == 2  # 3 layers x 140 / 200 ms
    run_until_idle(w)
    w.handle(m.SetPartition("overallocated", None))  # no estimate: the ITL SLO (50 ms) again
    w.handle(kv("again", LONG, list(range(13)), 9.9))
    w.tick()
    assert w.last.layers_per_block == 1


def test_a_long_prompt_goes_in_budget_sized_chunks(setup: tuple[Any, ModelRunner]) -> None:
    cfg, runner = setup
    prompt = _tokens(2 * BUDGET + 17, 4)
    x = kv("chunked", prompt, list(range(30, 57)), 9.0)
    want, want_kv = one_shot(cfg, runner, x)
    assert set(want) == {"chunked"}
    runner.kv_pool.tensor.zero_()
    io = FakeIO()
    w = drift_worker(cfg, runner, io, Clock(10.0))
    w.handle(x)
    assert run_until_idle(w).count("start") == 3 and not io.of("p2d", m.PrefillFailed)
    assert {d.req_id: d.token for d in io.of("p2d", m.PrefillDone)} == want
    assert torch.equal(runner.kv_pool.tensor, want_kv)


def test_drops_of_launched_requests_wait_for_their_batch(setup: tuple[Any, ModelRunner]) -> None:
    cfg, runner = setup
    io = FakeIO()
    w = drift_worker(cfg, runner, io, Clock(10.0))
    w.handle(L_KV)
    w.tick()
    w.handle(S_KV)
    w.tick()  # short preempts long
    w.handle(O_KV)
    w.handle(m.Drop("long"))  # preempted: its blocks hold layer 0 and will get the rest when it resumes
    w.handle(m.Drop("other"))  # waiting: answered at once
    assert [d.req_id for d in io.of("p2d", m.Dropped)] == ["other"]
    w.handle(m.Drop("short"))  # running
    w.tick()  # the short batch ends: its Drop is answered, no PrefillDone
    assert [d.req_id for d in io.of("p2d", m.Dropped)] == ["other", "short"]
    run_until_idle(w)
    assert [d.req_id for d in io.of("p2d", m.Dropped)] == ["other", "short", "long"]
    assert not io.of("p2d", m.PrefillDone) and not w.waiting_prefill


def test_a_failing_batch_is_isolated_per_request(setup: tuple[Any, ModelRunner], monkeypatch: pytest.MonkeyPatch,
                                                 ) -> None:
    cfg, runner = setup
    real = runner.sample_next

    def sample_next(logits: torch.Tensor, params: Any, index: Any, eos: Any, *a: Any, **kw: Any) -> Any:
        if any(p.seed == POISON for p in params):
            raise RuntimeError("sampling blew up for this request")
        return real(logits, params, index, eos, *a, **kw)

    monkeypatch.setattr(runner, "sample_next", sample_next)
    io = FakeIO()
    w = drift_worker(cfg, runner, io, Clock(10.0))
    bad = SamplingParams(temperature=0.0, max_tokens=4, seed=POISON)
    w.handle(kv("good", SHORT, [20], 9.9))
    w.handle(kv("bad", OTHER, list(range(21, 31)), 9.9, bad))
    run_until_idle(w)
    assert [d.req_id for d in io.of("p2d", m.PrefillDone)] == ["good"]
    assert [f.req_id for f in io.of("p2d", m.PrefillFailed)] == ["bad"]
    steps = {"n": 0}
    real_step = PrefillTask.step

    def step_fails_once(self: PrefillTask, n: int) -> tuple[int, int]:
        steps["n"] += 1
        if steps["n"] == 2:
            raise RuntimeError("a block failed")
        return real_step(self, n)

    monkeypatch.setattr(PrefillTask, "step", step_fails_once)
    w.handle(kv("a", LONG[:100], list(range(10)), 9.9))
    w.handle(kv("b", LONG[100:], list(range(10, 20)), 9.9))
    run_until_idle(w)  # the batch's second block fails: each request again, alone, in one shot
    assert [d.req_id for d in io.of("p2d", m.PrefillDone)] == ["good", "a", "b"] and not w.waiting_prefill



def test_a_constraint_that_cannot_compile_fails_alone_as_its_own_fault(setup: tuple[Any, ModelRunner]) -> None:
    """Structured outputs in the drift prefill worker: a constraint its grammar book cannot compile (this
    preset has no tokenizer: the compile fails, off the loop) fails that request alone, PrefillFailed with
    the constraint's fault (never a first token sampled unconstrained); the request beside it is served."""
    import time

    cfg, runner = setup
    io = FakeIO()
    w = drift_worker(cfg, runner, io, Clock(10.0))
    constrained = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputs(regex="[a-z]+"))
    w.handle(kv("bad", SHORT, [20], 9.9, constrained))
    w.handle(kv("good", OTHER, list(range(21, 31)), 9.9))
    deadline = time.monotonic() + 60
    while w.waiting_prefill or w.running is not None:
        assert time.monotonic() < deadline, "still prefilling"
        w.tick()
    assert [d.req_id for d in io.of("p2d", m.PrefillDone)] == ["good"]
    failed = io.of("p2d", m.PrefillFailed)
    assert [(f.req_id, f.fault) for f in failed] == [("bad", m.STRUCTURED_FAULT)]
    assert "regex constraint" in failed[0].message and "tokenizer" in failed[0].message, failed[0].message
    assert len(w.grammar) == 0

# ---- decode decides the partition, prefill sizes its blocks to decode's step -------------------------
class _Splits(PartitionBackend):
    """The profile's configurations with CPU "streams" (None: the current one), for both roles."""

    def __init__(self, configs: list[Configuration]) -> None:
        super().__init__(Granularity(132, 1, 1), configs)
        for c in configs:
            for role in ("decode", "prefill"):
                self._streams[(c.name, role)] = None


def _serve(dec: DecodeWorker, pre: PrefillWorker, io: FakeIO, prompts: dict[str, list[int]]) -> tuple[
        dict[str, list[int]], list[m.SetPartition]]:
    """Both workers' loops, alternating, the messages carried between them: each request's tokens, and
    the SetPartitions prefill got. Half the requests come first, the rest once those decode."""
    sets: list[m.SetPartition] = []
    waves = [dict(list(prompts.items())[: len(prompts) // 2]), dict(list(prompts.items())[len(prompts) // 2:])]
    for i in range(60):
        for rid, toks in waves[i // 2].items() if i in (0, 2) else ():
            dec.handle(m.NewRequest(rid, toks, GREEDY, 9.9))
        io.seat = "decode"
        dec.begin_step()  # the step's shape (split, on the configuration decode picks), then admission
        if dec.sched.running or dec.inflight:
            dec.step()
        dec.publish()
        io.seat = "prefill"
        for msg in io.sent["d2p"]:
            sets += [msg] if isinstance(msg, m.SetPartition) else []
            pre.handle(msg)
        io.sent["d2p"].clear()
        if isinstance(pre, DriftPrefillWorker):
            while pre.tick() == 0.0:
                pass
        while pre.waiting_prefill and not isinstance(pre, DriftPrefillWorker):
            pre.prefill_step()
        for msg in io.sent["p2d"]:
            dec.handle(msg)
        io.sent["p2d"].clear()
    toks: dict[str, list[int]] = {}
    for b in io.of("d2r", m.TokenBatch):
        for t in b.tokens:
            toks.setdefault(t.req_id, []).append(t.token_id)
    return toks, sets


def test_decode_tells_prefill_the_partition_and_its_step(setup: tuple[Any, ModelRunner]) -> None:
    """A synthetic H100 profile on CPU (streams: the current one): decode picks the configuration with
    decide_drift and sends it with its step estimate there (SetPartition.decode_step_ms), prefill sizes its
    blocks to that step, and the tokens are those of the rapid policy's workers without partitions."""
    cfg, runner = setup
    prompts = {f"r{i}": _tokens(20 + 30 * i, 10 + i) for i in range(4)}
    runner.kv_pool.tensor.zero_()
    base = dataclasses.replace(cfg, partition=PartitionConfig(mode="off"))
    io = FakeIO()
    plan = resolve_plan(base, runner.device)
    want, _ = _serve(DecodeWorker(base, runner, io, DecodePartition(base.partition, plan),  # type: ignore[arg-type]
                                  open_streams(plan.wire(), runner.device, ("decode",))),
                     PrefillWorker(base, runner, io, open_streams(plan.wire(), runner.device, ("prefill",)),  # type: ignore[arg-type]
                                   plan.initial), io, prompts)
    assert {k: len(v) for k, v in want.items()} == {k: 4 for k in prompts}

    runner.kv_pool.tensor.zero_()
    tight = dataclasses.replace(cfg, partition=dataclasses.replace(cfg.partition, slo_itl_ms=20.0))
    prof = h100_profile()  # beside prefill, p95 at these small batches: overallocated 37 ms, split16 5.4 ms
    models = {c.name: LinearModel(0.0, 1.0) for c in prof.configurations}
    plan = PartitionPlan("none", list(prof.configurations), prof, "synthetic H100 profile", None, models)
    io = FakeIO()
    dec = DecodeWorker(tight, runner, io, DecodePartition(tight.partition, plan, tight.model_config, BUDGET),  # type: ignore[arg-type]
                       _Splits(prof.configurations))
    pre = DriftPrefillWorker(tight, runner, io, _Splits(prof.configurations), plan.initial, models,  # type: ignore[arg-type]
                             Clock(10.0))
    got, sets = _serve(dec, pre, io, prompts)
    assert got == want
    # decode ran beside prefill: overallocated breaks the 18 ms limit, split16 meets it with the most
    # prefill units; prefill heard the switch with decode's step there
    assert m.SetPartition("split16", 5.4) in sets
    assert dec.partition.num_switches >= 1 and all(x.decode_step_ms is None or x.decode_step_ms > 0 for x in sets)
