"""A prompt chunked in the decode worker's fused steps, then a run of split steps: the split hands it to the prefill
worker (`DecodeScheduler.hand_over`), which computes the rest from its last full block and samples its first token.

Before this, only a fused step computed such a prompt, so a policy that split while decodes ran left it waiting until
decode had nothing to run: on the H200 (2026-11-30, Mooncake trace, duet) 23K-token prompts that arrived just behind
a short one were chunked in one fused step and then waited 20-110 s for their first token while later prompts went
by. The real decode and prefill workers in this process (tests/test_step_shapes.py's harness), on CPU and on a GPU
(`-m gpu`: prefill's kernels reading what decode's fused chunks wrote; one process and one stream here, so not the
engine's ordering across its two processes, a chunk's end event recorded before the KVReady goes:
tests/test_engine_gpu.py `test_duet_hands_a_prompt_chunked_in_decode_to_the_prefill_worker` forces a hand-over
through that), the policy forced to split from the fourth step on, one request decoding all along; the hand-over is
counted once (`num_hand_overs`)."""

from __future__ import annotations

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.engine import messages as m
from rapidserve.engine.step_launch import InFlight
from rapidserve.partition.profile import OVERALLOCATED
from rapidserve.partition.shape import Fused, ShapeState, Split, StepShape, StepTiming
from rapidserve.partition.step_policies import ScriptedPolicy
from tests import test_worker_faults
from tests.test_step_shapes import MODEL, serve, workers

LONG, BIG = 60, 120  # tokens the decoding request generates; the big prompt's length


def fuse_then_split(k: int, state: ShapeState, split: str = OVERALLOCATED) -> StepShape:
    """Three fused steps of 16 prompt tokens (the short prompt, then the big one's first chunks), then splits only."""
    return Fused(16) if k < 3 else Split(split, 48)


class Synced:
    """A decode stream that only counts its synchronizes (the switch's): as a GPU's, it has landed what it ran."""

    def __init__(self) -> None:
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1


@pytest.mark.parametrize(("device", "synced"), [("cpu", False), ("cpu", True),
                                               pytest.param("cuda", False, marks=pytest.mark.gpu)],
                         ids=["cpu", "cpu, the switch to the split synchronizes", "cuda"])
def test_a_prompt_chunked_here_goes_to_prefill_at_a_split_while_decodes_run(device: str, synced: bool,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`synced`: two configurations (fused steps on the whole GPU, splits on split16) whose decode streams count
    synchronizes, as a switch of configuration does on a GPU: the first split records the fused step in flight before
    its admission and hands the prompt over in that split. Without a switch (one configuration), the first split finds
    the last fused step in flight (launched one ahead) and the prompt goes at the next."""
    monkeypatch.setattr(test_worker_faults, "untimed", lambda msg: msg)  # the rings keep the first tokens' PhaseTimes
    llm = LLM(MODEL, dtype="float32", device=device, show_progress=False, max_model_len=512, num_kv_blocks=40,
              max_num_batched_tokens=48)
    short, big = [5, 9, 14, 3, 7, 11, 30, 8, 21], [(37 * i) % 1200 + 3 for i in range(BIG)]
    want = [o.outputs[0].token_ids for o in llm.generate(
        [short, big], [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (LONG, 4)],
        use_tqdm=False)]
    policy = ScriptedPolicy(lambda k, st: fuse_then_split(k, st, "split16" if synced else OVERALLOCATED))
    d, p, io = workers(llm, policy, two_configs=synced)
    streams = {name: Synced() for name in ("split16", OVERALLOCATED)}
    if device == "cuda":  # the host never late: each step launched before the one in flight lands, as on the CPU
        # (a GPU's tiny steps often land first, and the label would be `landed` by timing, not `ahead` by force)
        monkeypatch.setattr(InFlight, "landed", property(lambda self: False))
    if synced:
        for name, s in streams.items():
            d.backend._streams[(name, "decode")] = s  # type: ignore[union-attr]
        monkeypatch.setattr(d, "step_stream", lambda: None)  # the steps themselves run on the CPU's current stream
    launches: list[tuple[str, str]] = []  # each landed step's shape and how it was launched (the step trace's)

    class Trace:
        def add(self, batch: object, context_sum: int, launch: str, timing: StepTiming, *rest: object) -> None:
            launches.append((type(timing.shape).__name__, launch))

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    d.trace = Trace()  # type: ignore[assignment]
    free0 = d.sched.blocks.num_free
    started: dict[str, float | None] = {}  # when decode queued each handed-over prompt's first chunk
    at: dict[str, int] = {}  # the policy's decision whose split handed it over (the first split: decision 3)
    hand_over = d.sched.hand_over

    def spy() -> list[m.KVReady]:
        started.update((r.req_id, r.started) for r in d.sched.chunking)
        out = hand_over()
        at.update((kv.req_id, len(policy.states) - 1) for kv in out)
        return out

    monkeypatch.setattr(d.sched, "hand_over", spy)
    told = serve(d, p, io, [
        m.NewRequest("decodes", short, SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True), 0.0),
        m.NewRequest("big", big, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), 1.0)])
    kv = [x for x in told if isinstance(x, m.KVReady)]
    assert [x.req_id for x in kv] == ["big"]  # the short prompt ran to its end in the first fused step
    bs = d.sched.blocks.block_size
    # its fused chunks wrote 7 + 16 + 16 = 39 tokens (the first step's 16 less the short prompt's 9); prefill starts
    # at the last full block (32)
    assert kv[0].cached_tokens == 0 and kv[0].computed_tokens == (16 - 9 + 16 + 16) // bs * bs > 0
    assert at["big"] == (3 if synced else 4), at
    assert not synced or streams[OVERALLOCATED].syncs >= 1  # the fused steps' stream, left for the split
    # the first split step: behind the last fused one, or, recorded before it at the switch, `landed` (not `idle`)
    assert launches[3] == ("Split", "landed" if synced else "ahead"), launches[:5]
    # counted once (Stats.num_hand_overs: /metrics' rapidserve:prompts_handed_over_total)
    assert d.sched.num_hand_overs == 1 and d.sched.stats("overallocated", 0).num_hand_overs == 1
    # the big prompt's first token came while the other request still decoded, not after it ended
    order = [(t.req_id, t.index) for b in io.of("d2r", m.TokenBatch) for t in b.tokens]
    first_big = order.index(("big", 0))
    decoded_before = sum(1 for rid, _ in order[:first_big] if rid == "decodes")
    assert decoded_before < LONG // 4, (decoded_before, order)
    # its TTFT's phases: prefill started with decode's first chunk, not at the hand-over (else queue time)
    first = next(t for b in io.of("d2r", m.TokenBatch) for t in b.tokens if (t.req_id, t.index) == ("big", 0))
    assert first.times is not None and started["big"] is not None and first.times.started == started["big"]
    assert kv[0].started == started["big"] and first.times.admitted <= first.times.started <= first.times.sampled
    # the same greedy tokens as LLM's, every block back
    got = {rid: [t.token_id for b in io.of("d2r", m.TokenBatch) for t in b.tokens if t.req_id == rid]
           for rid in ("decodes", "big")}
    assert got == {"decodes": want[0], "big": want[1]}
    assert not io.of("d2r", m.Finished) and d.sched.blocks.num_free == free0 and not d.sched.reqs
