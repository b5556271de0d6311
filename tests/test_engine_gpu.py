"""The two-process RAPID engine on the GPU (AsyncEngine, rapid mode, green-context partitions, MPS auto).

- greedy tokens equal to the single-process reference (`LLM` on the same GPU, prefill launched eagerly; the
  engine's prefill worker replays its piecewise prefill graphs, per partition stream), with a static split
  and with the adaptive manager switching between splits (hysteresis 0; chunked prompts, so prefill
  switches stream between the chunks of one prompt). The switches are forced, not left to this GPU's
  timings (tests/forced_switch.py says how; tests/test_forced_switch.py checks the decisions on CPU): the
  rapid policy reads a profile written here for this GPU, under which prefill work alone decides the
  configuration; duet reads the same profile with an SLO that every split meets and no fused step does, and a
  chain of holder requests keeps decode running from before the prompts are sent until after they finished, so
  they reach decode beside a running decode (duet's condition for a split);
- duet's hand-over across the two processes (`test_duet_hands_a_prompt_chunked_in_decode_to_the_prefill_worker`):
  a prompt whose first chunk the decode worker computed in the fused step that ended another prompt goes to the
  prefill worker at the next split, which reads what decode's chunk wrote; counted in Stats.num_hand_overs;
- kill -9 of the decode worker, then of the prefill worker, with requests in flight: each request
  ends with EngineError within 2 s, the engine restarts and serves the next request correctly.

fp32 and a tiny preset model: it starts in seconds, and a mismatch at near-tied logits would be
numerics, not the engine. Graph buckets are cut to 1-16 so each start captures few graphs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import random
import signal
import time
from pathlib import Path

import msgspec
import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.config import EngineConfig
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.errors import EngineError
from rapidserve.engine.step_trace import StepRecord
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from rapidserve.partition_config import PartitionConfig
from tests.forced_switch import DUET_SLO_MS, forcing_profile
from tests.test_engine import wait_blocks_free

MODEL = "preset:tiny-llama"
MAX_LEN = 1024  # the preset's max_position_embeddings
KV_BLOCKS = 256  # 4096 tokens: no preemption here (the CPU engine tests cover it)
BUDGET = 64  # prefill token budget: the longer prompts go in chunks
NEW = 16
LENGTHS = [5, 150, 12, 70, 33, 90, 8, 41]
GRAPH_SIZES = (1, 2, 4, 8, 16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
# the holders: a chain of long greedy requests that keeps decode running from before the prompts are sent until
# after they all finished (`hold_decode`); the tiny preset's context bounds each one, not how long the prompts take
HOLD = SamplingParams(temperature=0.0, max_tokens=MAX_LEN - 200, ignore_eos=True)
HANDOVER = HOLD.max_tokens // 2  # the next holder starts when the current one has this many tokens
DECODE_SHARES = (0.25, 0.5)


def make_prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 1280) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    import torch

    prompts = make_prompts()
    llm = LLM(MODEL, dtype="float32", device="cuda", show_progress=False, max_model_len=MAX_LEN,
              num_kv_blocks=KV_BLOCKS, prefill_graph_tokens=())  # eager prefill: the engine's graphs are checked
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()  # the workers are other processes: give the memory back
    return prompts, want


@pytest.fixture(scope="module")
def forced_profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tests/forced_switch.py's profile for this GPU (its name and its own green-context splits): under it
    the rapid manager takes the split with the most prefill units whenever prefill has work, and
    overallocated when it has none, whatever this GPU's speed."""
    import torch

    from rapidserve.partition.backend import device_granularity, plan_configurations
    from rapidserve.partition.profile import save_profile

    device = torch.device("cuda", 0)
    g = device_granularity("cuda-green", device)
    prof = forcing_profile(torch.cuda.get_device_name(device), MODEL, plan_configurations(g, DECODE_SHARES),
                           g.total, BUDGET)
    path = tmp_path_factory.mktemp("profile") / "forced.json"
    save_profile(prof, path)
    return str(path)


def engine_config(partition: str, profile: str | None = None) -> EngineConfig:
    """`adaptive` runs --policy rapid on `profile`; `adaptive-duet` --policy duet on the same profile (its costs:
    `ProfileCosts`) with `DUET_SLO_MS`, which every split meets and no fused step does (tests/forced_switch.py),
    so prompts pending beside a running decode split, and decode alone takes the whole GPU back."""
    cfg, _ = build_engine_config(MODEL, device="cuda", dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=MAX_LEN,
                                 max_num_batched_tokens=BUDGET)
    policy = dict(policy="duet", slo_itl_ms=DUET_SLO_MS) if partition == "adaptive-duet" else dict(policy="rapid")
    if partition.startswith("adaptive"):
        policy["profile"] = profile
    return dataclasses.replace(
        cfg,
        runner=dataclasses.replace(cfg.runner, graph_batch_sizes=GRAPH_SIZES),
        partition=PartitionConfig.parse(partition.removesuffix("-duet"), backend="cuda-green",
                                        decode_shares=DECODE_SHARES, hysteresis_steps=0, **policy),
        launch=LaunchConfig(mode="rapid", mps="auto", startup_timeout_s=120, on_worker_death="restart"),
    )


async def collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams,
                  first: asyncio.Event | None = None) -> list[int]:
    toks = []
    async for t in engine.generate(rid, prompt, params):
        assert t.index == len(toks)
        toks.append(t.token_id)
        if first is not None:
            first.set()
    return toks


class Holders:
    """The chain of holders of one round (`hold_decode`): their tasks and the tokens each has streamed."""

    def __init__(self, round_: int) -> None:
        self.round = round_
        self.tasks: list[asyncio.Task[list[int]]] = []
        self.prompts_done = asyncio.Event()

    def rid(self, i: int) -> str:
        return f"hold{self.round}-{i}"


async def hold_decode(engine: AsyncEngine, prompt: list[int], h: Holders, decoding: asyncio.Event) -> None:
    """Keep a holder decoding until `h.prompts_done`: start one, and start the next whenever the newest has
    HANDOVER tokens (half its max_tokens), so a successor is already admitted while its predecessor has half its
    tokens to go. `decoding` is set at the first holder's first token (it came from decode: decode runs). Since a
    holder cannot end before HANDOVER tokens and one is started at that point, an unfinished holder exists at
    every moment, whatever the GPU's speed; the caller aborts the unfinished ones once the prompts are done."""
    while not h.prompts_done.is_set():
        toks: list[int] = []
        half = asyncio.Event()

        async def run(rid: str, toks: list[int] = toks, half: asyncio.Event = half) -> list[int]:
            async for t in engine.generate(rid, prompt, HOLD):
                assert t.index == len(toks)
                toks.append(t.token_id)
                decoding.set()
                if len(toks) >= HANDOVER:
                    half.set()
            half.set()  # ended (aborted) before HANDOVER tokens: the loop sees prompts_done
            return toks

        h.tasks.append(asyncio.create_task(run(h.rid(len(h.tasks)))))
        halfway = asyncio.create_task(half.wait())
        done = asyncio.create_task(h.prompts_done.wait())
        await asyncio.wait({halfway, done}, return_when=asyncio.FIRST_COMPLETED)
        halfway.cancel()
        done.cancel()


def assert_green_split(engine: AsyncEngine) -> str:
    assert engine.workers is not None
    info = engine.workers.ready["decode"].info
    assert "cuda-green" in info["partition"], info
    assert any(n.startswith("split") for n in info["configurations"].split(",")), info
    return f"{info['partition']} [{info['configurations']}]; {engine.events[0]}"


@pytest.mark.gpu
@pytest.mark.parametrize("partition", ["static:0.25", "adaptive", "adaptive-duet"])
def test_engine_on_gpu_with_green_partitions_matches_llm(
        partition: str, reference: tuple[list[list[int]], list[list[int]]], forced_profile: str) -> None:
    prompts, want = reference

    async def main() -> None:
        engine = await AsyncEngine.start(engine_config(partition, forced_profile))
        try:
            print(assert_green_split(engine))
            if partition.startswith("adaptive"):
                assert Path(forced_profile).name in engine.workers.ready["decode"].info["partition"]  # type: ignore[union-attr]
            # twice: the second round runs on warm workers, with the partition left by the first
            for round_ in range(2):
                h, decoding = Holders(round_), asyncio.Event()
                chain = asyncio.create_task(hold_decode(engine, prompts[0], h, decoding))
                await asyncio.wait_for(decoding.wait(), 60)  # the first holder's first token came from decode
                got = await asyncio.gather(*(collect(engine, f"r{round_}-{i}", p, GREEDY)
                                             for i, p in enumerate(prompts)))
                h.prompts_done.set()
                await chain
                # the forcing's premise: a holder ran throughout, so each prompt reached decode beside a running one
                assert any(not t.done() for t in h.tasks), "every holder ended before the prompts did"
                for i, t in enumerate(h.tasks):
                    if not t.done():
                        await engine.abort(h.rid(i))
                held = [await t for t in h.tasks]
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    assert g == w, f"round {round_}, request {i} ({len(prompts[i])} prompt tokens) diverged"
                # the first holder decoded beside every prompt's 15 decode steps after its own first token: >= NEW
                assert len(held[0]) >= NEW and held[0][:NEW] == want[0], f"round {round_}: the first holder diverged"
                for i, toks in enumerate(held):  # each holder's first NEW tokens: the reference's (fewer if aborted)
                    assert toks[:NEW] == want[0][:len(toks)], f"round {round_}: holder {i} diverged"
                    assert i == len(held) - 1 or len(toks) >= HANDOVER, (i, len(toks))  # it handed over, then ended
                await wait_blocks_free(engine)  # a Stats sent after the round (it may be shorter than their interval)
                assert engine.stats is not None
                if partition.startswith("adaptive"):  # each round: into a split for prefill, and back
                    assert engine.stats.partition_switches >= 2 * (round_ + 1), engine.stats
                else:
                    assert engine.stats.partition_switches == 0 and engine.stats.partition.startswith("split")
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.gpu
def test_duet_fused_steps_replay_the_decode_workers_prefill_graphs(
        reference: tuple[list[list[int]], list[list[int]]], forced_profile: str) -> None:
    """`--policy duet --slo-itl-ms none` in rapid mode: every step is fused in the decode worker (no split, no
    hand-off), so the decode worker captures the piecewise prefill graphs of its fused steps on its whole-GPU
    stream (PlanWire.fused_graphs) and replays them: chunks of at most BUDGET (64) tokens with their decode rows fit
    its buckets. Greedy tokens equal the eager reference's."""
    prompts, want = reference
    cfg = engine_config("adaptive-duet", forced_profile)
    cfg = dataclasses.replace(cfg, partition=dataclasses.replace(cfg.partition, slo_itl_ms=None))

    async def main() -> None:
        engine = await AsyncEngine.start(cfg)
        try:
            assert engine.workers is not None
            assert engine.workers.ready["decode"].info["fused_graphs"] == "overallocated"
            got = await asyncio.gather(*(collect(engine, f"f-{i}", p, GREEDY) for i, p in enumerate(prompts)))
            assert got == want
            await wait_blocks_free(engine)
            assert engine.stats is not None
            kinds = engine.stats.step_kinds
            assert kinds["fused"].steps > 0 and "split" not in kinds, kinds  # fused steps ran, and nothing split
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.gpu
def test_duet_hands_a_prompt_chunked_in_decode_to_the_prefill_worker(forced_profile: str, tmp_path: Path) -> None:
    """With nothing running, P1 (14 x BUDGET + 5 tokens) and P2 (200) are sent back to back, P1 first (the rings are
    FIFO). Under the forcing profile (tests/forced_switch.py) duet fuses while no decode runs (`_no_decode`:
    Fused(BUDGET), BUDGET = max_num_batched_tokens): 14 fused steps of P1 alone (each spends the whole budget, so P2
    waits), then the step with P1's last 5 tokens, which samples its first token, and P2's first 59, which leaves P2
    chunking. At the next boundary P1 decodes and P2 is pending with the prefill worker idle: no fused chunk fits
    beside a decode, every split meets the SLO, so duet splits, and the split hands P2 to the prefill worker
    (`DecodeScheduler.hand_over`: the switch to the split synchronized the stream of the fused steps, so the last
    one is recorded before the split's admission and P2 goes in that split; P1 still decodes 64 tokens), which
    computes it from its last full block (48) on, reading the K/V decode's chunk wrote in the other process. P2 need
    not reach decode in P1's drain, only by the 15th fused turn: each of those turns plans and launches a forward of
    BUDGET tokens (host work no GPU's speed removes) against the microseconds between the two sends. The step trace
    shows the premise itself (the fused steps' chunks, the split after them), so a lost race would read as one, not
    as a hand-over bug; tests/test_forced_switch.py runs this sequence on CPU through the real scheduler and policy."""
    import torch

    rng = random.Random(7)
    p1, p2 = ([rng.randrange(3, 1280) for _ in range(n)] for n in (14 * BUDGET + 5, 200))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (64, NEW)]
    llm = LLM(MODEL, dtype="float32", device="cuda", show_progress=False, max_model_len=MAX_LEN,
              num_kv_blocks=KV_BLOCKS, prefill_graph_tokens=())
    want = [o.outputs[0].token_ids for o in llm.generate([p1, p2], params, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    cfg = engine_config("adaptive-duet", forced_profile)
    trace = tmp_path / "steps.jsonl"
    cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, step_trace=str(trace)))

    async def main() -> None:
        engine = await AsyncEngine.start(cfg)
        try:
            tasks = [asyncio.create_task(collect(engine, rid, p, sp))  # P1's NewRequest goes first: tasks run in order
                     for rid, p, sp in (("p1", p1, params[0]), ("p2", p2, params[1]))]
            assert await asyncio.wait_for(asyncio.gather(*tasks), 120) == want
            await wait_blocks_free(engine)  # a Stats sent after both ended: the trace was flushed before it
            recs = [msgspec.json.decode(line, type=StepRecord) for line in trace.read_bytes().splitlines()]
            # the premise: 14 fused steps of P1 alone, then P1's last 5 tokens with P2's first 59, then a split while P1
            # decodes (P2 never chunked in decode again)
            fused = [i for i, r in enumerate(recs) if r.chunks]
            assert [recs[i].chunks for i in fused] == [[(BUDGET, BUDGET * k)] for k in range(14)] + \
                [[(5, 14 * BUDGET), (BUDGET - 5, 0)]], [(r.kind, r.chunks) for r in recs[:20]]
            after = recs[fused[-1] + 1]
            assert (after.kind, after.rows) == ("split", 1), after
            s = engine.stats
            assert s is not None and s.num_hand_overs == 1, s  # P2, the only prompt left chunking
            assert s.step_kinds["fused"].steps == 15 and s.step_kinds["split"].steps >= 1, s.step_kinds
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.gpu
def test_killed_gpu_worker_fails_requests_fast_and_engine_recovers(
        reference: tuple[list[list[int]], list[list[int]]]) -> None:
    """kill -9 of decode, then of prefill (uses `engine.running` and `engine.restarts`)."""
    prompts, want = reference
    long = SamplingParams(temperature=0.0, max_tokens=MAX_LEN - 200, ignore_eos=True)

    async def kill(engine: AsyncEngine, who: str) -> None:
        assert engine.workers is not None
        firsts = [asyncio.Event() for _ in range(3)]
        doomed = [asyncio.create_task(collect(engine, f"{who}-{i}", prompts[i], long, firsts[i])) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)  # all three decoding
        # and one whose long prompt is still with prefill (or just past it)
        doomed.append(asyncio.create_task(collect(engine, f"{who}-late", prompts[1] * 4, long)))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        os.kill(engine.workers.procs[who].pid, signal.SIGKILL)  # type: ignore[arg-type]
        for t in doomed:
            with pytest.raises(EngineError):
                await asyncio.wait_for(t, 5.0)
        assert time.monotonic() - t0 < 2.0, f"in-flight requests took {time.monotonic() - t0:.2f} s to fail"

    async def main() -> None:
        engine = await AsyncEngine.start(engine_config("static:0.25"))
        try:
            print(assert_green_split(engine))
            for n, who in enumerate(("decode", "prefill"), start=1):
                await kill(engine, who)
                deadline = time.monotonic() + 180
                while not engine.running and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert engine.running, engine.events
                assert engine.restarts == n, engine.events
                assert await collect(engine, f"after-{who}", prompts[0], GREEDY) == want[0]
                assert_green_split(engine)
            print("\n".join(engine.events))
        finally:
            await engine.shutdown()

    asyncio.run(main())
