"""Logit controls through every engine on CPU: `LLM`, the hybrid engine (scheduling one step ahead) and
the RAPID engine (prefill samples the first token, decode the rest one step ahead), each with a pool
small enough that requests are preempted and recomputed, give the tokens of an `LLM` with a large pool
(greedy and seeded random rows, penalties, bad words, logit_bias, allowed_token_ids, mixed with plain
rows); a request aborted midway leaves nothing behind; at the end no penalty slot is in use."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.engine.client import AsyncEngine
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from tests.test_prefix_cache_engines import quiet_stats

MODEL = "preset:tiny-llama"  # deterministic random weights, vocabulary of 1280
NEW = 10
KV_BLOCKS = 16  # 256 tokens for 10 requests of ~40: preemptions happen
_rng = random.Random(19)
PROMPTS = [[_rng.randrange(3, 1280) for _ in range(_rng.randrange(24, 34))] for _ in range(13)]
BASE = dict(max_tokens=NEW, ignore_eos=True)


def _params(plain: list[list[int]]) -> list[SamplingParams]:
    """One SamplingParams per prompt; `plain`: each prompt's greedy tokens without controls."""
    g = dict(temperature=0.0, **BASE)
    r = dict(temperature=0.9, top_k=40, **BASE)
    return [
        SamplingParams(logit_bias={77: 3.5}, repetition_penalty=3.0, **g),  # the bias alone repeats 77 (row 3)
        SamplingParams(logit_bias={77: 3.5}, frequency_penalty=1.5, presence_penalty=0.5, logprobs=1, **g),
        SamplingParams(bad_words_token_ids=[plain[2][1:3], plain[2][5:6]], **g),
        SamplingParams(logit_bias={plain[3][0]: -100, 77: 3.5}, **g),
        SamplingParams(allowed_token_ids=sorted(set(plain[4]) | {5, 6, 7}), presence_penalty=2.0, **g),
        SamplingParams(**g),
        SamplingParams(seed=7, repetition_penalty=1.3, frequency_penalty=0.3, **r),
        SamplingParams(seed=8, bad_words_token_ids=[[plain[7][0]]], **r),
        SamplingParams(seed=9, logit_bias={90: 3.5}, frequency_penalty=1.0, repetition_penalty=2.0, **r),
        SamplingParams(presence_penalty=-1.0, repetition_penalty=0.8, **g),
        # two tokens pushed far up and a small frequency penalty: they alternate in a pattern set by the exact
        # counts, so a count missed or doubled (say, around a preemption) changes the tokens
        *(SamplingParams(logit_bias={100 + 2 * j: 6.0, 101 + 2 * j: 6.0}, frequency_penalty=0.3 + 0.1 * j, **g)
          for j in range(3)),
    ]


def _generate(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected() -> tuple[list[SamplingParams], list[list[int]]]:
    llm = LLM(MODEL, dtype="float32", device="cpu", show_progress=False, max_model_len=256)
    plain = _generate(llm, [SamplingParams(temperature=0.0, **BASE)] * len(PROMPTS))
    params = _params(plain)
    out = _generate(llm, params)
    assert llm.engine.num_preemptions == 0 and llm.engine.runner.tokens.in_use == 0
    # the controls did something, and what they promise holds
    assert out[3].count(77) >= 4 and out[0].count(77) <= 2 and out[1].count(77) <= 2 and out[5] == plain[5]
    assert max(out[9].count(t) for t in out[9]) >= 4  # negative penalties: repeats
    assert all(set(o) == {100 + 2 * j, 101 + 2 * j} for j, o in enumerate(out[10:])), out[10:]
    assert all(out[2][j:j + 2] != plain[2][1:3] for j in range(NEW - 1)) and plain[2][5] not in out[2]
    assert plain[3][0] not in out[3][:1] and set(out[4]) <= set(params[4].allowed_token_ids or ())
    assert len(set(out[4])) == NEW  # presence_penalty=2 over a small allowed set: no token twice here
    return params, out


def test_llm_with_preemptions(expected: tuple[list[SamplingParams], list[list[int]]]) -> None:
    params, want = expected
    llm = LLM(MODEL, dtype="float32", device="cpu", show_progress=False, max_model_len=256, num_kv_blocks=KV_BLOCKS)
    assert _generate(llm, params) == want
    assert llm.engine.num_preemptions > 0
    assert llm.engine.runner.tokens.in_use == 0


@pytest.mark.parametrize("mode", ["hybrid", "rapid"])
def test_engine_with_preemptions_and_an_abort(expected: tuple[list[SamplingParams], list[list[int]]],
                                              mode: str) -> None:
    params, want = expected
    cfg, _ = build_engine_config(MODEL, device="cpu", dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=256)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode=mode, mps="off", startup_timeout_s=300))  # type: ignore[arg-type]

    async def main() -> tuple[list[list[int]], Any]:
        engine = await AsyncEngine.start(cfg)
        try:
            async def one(i: int) -> list[int]:
                return [t.token_id async for t in engine.generate(f"r{i}", PROMPTS[i], params[i])]

            async def aborted() -> None:  # penalized, stopped after two tokens (an abort mid-decode)
                gen = engine.generate("ab", PROMPTS[0], params[0].replace(max_tokens=200))
                for _ in range(2):
                    await gen.__anext__()
                await gen.aclose()

            got = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))), aborted())
            return list(got[:-1]), await quiet_stats(engine)
        finally:
            await engine.shutdown()

    got, stats = asyncio.run(main())
    assert got == want
    assert stats.num_preemptions > 0
    assert stats.token_slots == 0


# ---------------------------------------------------------------- failures inside the workers (in-process)

COUNTED = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={100: 6.0, 101: 6.0},
                         frequency_penalty=0.3)  # count-sensitive: a token counted twice or not at all shows


def _tokens(io: Any, rid: str) -> list[int]:
    from rapidserve.engine import messages as m

    return [t.token_id for b in io.of("d2r", m.TokenBatch) for t in b.tokens if t.req_id == rid]


def test_hybrid_step_failing_after_sampling_counts_none_of_its_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host copy of a mixed step's tokens fails after sampling: the request decoding in it samples that
    token again next step, counted once (its tokens are the reference's); the failed new request, penalized
    too, and everyone else leave no slot behind."""
    from rapidserve.engine import messages as m
    from tests.test_worker_faults import FakeIO, _fused_worker, _read, _run_ahead, arm_host_copy_failure

    llm = LLM(MODEL, dtype="float32", device="cpu", show_progress=False, max_model_len=256, num_kv_blocks=64)
    want = _generate_one(llm, PROMPTS[0], COUNTED)
    io = FakeIO()
    w = _fused_worker(llm.config, llm.engine.runner, io)
    io.inbox.append(m.NewRequest("a", PROMPTS[0], COUNTED, 0.0))
    _read(w)
    armed = arm_host_copy_failure(monkeypatch)

    def before(i: int) -> None:
        if i == 3:
            io.inbox.append(m.NewRequest("b", PROMPTS[1], COUNTED, 0.0))
            _read(w)
            armed["on"] = True

    _run_ahead(w, 60, before)
    assert [(f.req_id, f.reason) for f in io.of("d2r", m.Finished)] == [("b", "error")]
    assert _tokens(io, "a") == want
    w.publish()
    assert llm.engine.runner.tokens.in_use == 0


def _generate_one(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_decode_frees_the_slot_of_a_penalized_request_that_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """RAPID decode + prefill in-process: a penalized request whose sampling raises at its third token
    fails alone; the other penalized requests get the reference's tokens; no slot stays in use."""
    from rapidserve.engine import messages as m
    from tests.test_worker_faults import FakeIO, _decode_steps, _decode_worker, _prefill_worker, _submit

    llm = LLM(MODEL, dtype="float32", device="cpu", show_progress=False, max_model_len=256, num_kv_blocks=64)
    want = _generate_one(llm, PROMPTS[2], COUNTED)
    cfg, runner = llm.config, llm.engine.runner
    bad = COUNTED.replace(seed=666)
    real = runner.sample_next

    def sample_next(logits: Any, params: Any, index: Any, eos: Any, *args: Any, **kw: Any) -> Any:
        if any(p.seed == 666 and k >= 2 for p, k in zip(params, index, strict=True)):
            raise RuntimeError("sampling blew up for this request")
        return real(logits, params, index, eos, *args, **kw)

    monkeypatch.setattr(runner, "sample_next", sample_next)
    io = FakeIO()
    w, p = _decode_worker(cfg, runner, io), _prefill_worker(cfg, runner, io)
    _submit(cfg, runner, io, w, p, m.NewRequest("a", PROMPTS[2], COUNTED, 0.0),
            m.NewRequest("bad", PROMPTS[3], bad, 0.0), m.NewRequest("b", PROMPTS[2], COUNTED, 0.0))
    _decode_steps(w, 12)
    assert [(f.req_id, f.reason) for f in io.of("d2r", m.Finished)] == [("bad", "error")]
    assert _tokens(io, "a") == want and _tokens(io, "b") == want
    assert runner.tokens.in_use == 0 and not w.sched.reqs
