"""`LLM` runs the one step loop in-process (rapidserve/core.py: the decode worker's step cycle over the same
`DecodeScheduler`, every step fused), on CPU in fp32.

- On the embedded SmolLM2, with a step budget that chunks the prompts and mixes their chunks with decodes and a
  KV pool small enough to preempt: `LLM`'s greedy tokens equal transformers' own and those of a real hybrid engine
  (the same loop in its worker process, behind AsyncEngine).
- Scheduling one step ahead (`async_scheduling`, the default) or waiting for each step gives the same tokens,
  finish reasons and logprobs (to float noise), for stops found while the next step is in flight (stop tokens,
  stop strings), max_tokens of 1-3, min_tokens, seeded sampling, with preemptions; every block and penalty slot
  comes back.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from rapidserve import LLM, SamplingParams
from rapidserve.core import EngineCore
from rapidserve.engine.client import AsyncEngine
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from rapidserve.partition.step_policies import AlwaysFused
from tests.test_engine import wait_blocks_free
from tests.test_llm_equivalence import CHATS, _random_prompts, hf_greedy_check

NEW = 16
BUDGET = 24  # max_num_batched_tokens: every chat prompt below (32-86 tokens) is longer, so chunked
KV_BLOCKS = 14  # 224 tokens in 16-token blocks for the ~430 of the 7 chats: preemptions happen


def smol(**kw: object) -> LLM:
    return LLM(dtype="float32", device="cpu", show_progress=False, max_model_len=512, max_num_batched_tokens=BUDGET,
               num_kv_blocks=KV_BLOCKS, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def chats() -> tuple[LLM, list[list[int]]]:
    llm = smol()
    tok = llm.get_tokenizer()
    assert tok is not None
    return llm, [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS[:7]]


async def hybrid_tokens(prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    cfg, _ = build_engine_config(None, device="cpu", dtype="float32", max_model_len=512,
                                 max_num_batched_tokens=BUDGET, num_kv_blocks=KV_BLOCKS)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode="hybrid", mps="off", startup_timeout_s=300))
    engine = await AsyncEngine.start(cfg)
    try:
        async def one(rid: str, p: list[int]) -> list[int]:
            return [t.token_id async for t in engine.generate(rid, p, params)]

        out = await asyncio.gather(*(one(f"r{i}", p) for i, p in enumerate(prompts)))
        await wait_blocks_free(engine)
        assert engine.stats is not None
        return list(out), engine.stats.num_preemptions
    finally:
        await engine.shutdown()


def test_smollm2_greedy_equals_transformers_and_the_hybrid_engine(chats: tuple[LLM, list[list[int]]],
                                                                   smollm2_hf: torch.nn.Module) -> None:
    llm, prompts = chats
    assert isinstance(llm.engine, EngineCore) and isinstance(llm.engine.policy, AlwaysFused)
    assert min(len(p) for p in prompts) > BUDGET  # every prompt is chunked
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert llm.engine.num_preemptions > 0  # the pool was too small for all at once
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks and not llm.engine.has_work
    for i, (p, toks) in enumerate(zip(prompts, got, strict=True)):
        assert len(toks) == NEW
        want, _ = hf_greedy_check(smollm2_hf, p, toks)
        assert toks == want, f"prompt {i} ({len(p)} tokens) diverged from transformers at new token " \
            f"{next(k for k, (a, b) in enumerate(zip(toks, want, strict=True)) if a != b)}"
    hybrid, preempted = asyncio.run(hybrid_tokens(prompts, greedy))
    assert hybrid == got and preempted > 0


def test_stop_strings_end_the_same_with_or_without_scheduling_ahead(chats: tuple[LLM, list[list[int]]]) -> None:
    """A stop string found while the request's next step is in flight: that step's token is dropped, the text
    ends before the stop string, and the request's blocks come back."""
    ahead, prompts = chats
    tok = ahead.get_tokenizer()
    assert tok is not None
    free = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    texts = [o.outputs[0].text for o in ahead.generate(prompts[:3], free, use_tqdm=False)]
    stops = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, stop=(t.split()[2],)) for t in texts]
    waiting = smol(async_scheduling=False)
    runs = [[(c.text, c.token_ids, c.finish_reason) for o in llm.generate(prompts[:3], stops, use_tqdm=False)
             for c in o.outputs] for llm in (ahead, waiting)]
    assert runs[0] == runs[1]
    for (text, ids, reason), full, p in zip(runs[0], texts, stops, strict=True):
        assert reason == "stop" and p.stop[0] not in text and full.startswith(text) and len(ids) < NEW
    for llm in (ahead, waiting):
        assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks and not llm.engine.has_work


def test_scheduling_ahead_gives_the_tokens_of_waiting_for_each_step() -> None:
    """The tiny preset, a small pool and budget (chunks, preemptions): stop tokens found while the next step is in
    flight, max_tokens of 1-3 (no decode after the last token), min_tokens, seeded sampling with logprobs and a
    penalty (its device slot), the same with async_scheduling on and off."""
    kw = dict(dtype="float32", device="cpu", show_progress=False, max_model_len=256, num_kv_blocks=6,
              max_num_batched_tokens=32)  # 96 tokens of pool for the ~300 of these requests
    llms = [LLM("preset:tiny-llama", async_scheduling=a, **kw) for a in (True, False)]  # type: ignore[arg-type]
    prompts = _random_prompts(llms[0].config.model_config.vocab_size, [40, 7, 30, 12, 50, 3, 21, 9, 33], seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llms[1].generate(prompts, greedy, use_tqdm=False)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[want[i][4]]) if i < 3
              else SamplingParams(temperature=0.0, max_tokens=i - 2) if i in (3, 4, 5)
              else SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True, logprobs=1,
                                  presence_penalty=0.5) if i in (6, 7)
              else SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20, stop_token_ids=[want[i][2]])
              for i in range(len(prompts))]
    runs = []
    for llm in llms:
        before = llm.engine.num_preemptions
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        runs.append([(c.token_ids, c.finish_reason, None if c.logprobs is None else c.chosen_logprobs())
                     for c in outs])
        assert llm.engine.num_preemptions > before
        assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks and llm.engine.runner.tokens.in_use == 0
    # the same tokens and reasons; logprobs to float noise (the steps' batches differ: a request ended by a token
    # still in flight has a row in the next step, and preemptions fall elsewhere)
    assert [r[:2] for r in runs[0]] == [r[:2] for r in runs[1]]
    for (_, _, a), (_, _, b) in zip(*runs, strict=True):
        assert (a is None) == (b is None) and (a is None or max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5)
    got = runs[0]
    for i in range(3):  # each stops at its 5th token or sooner
        assert got[i][1] == "stop" and got[i][0] == want[i][:len(got[i][0])] and len(got[i][0]) <= 5
    assert [len(got[i][0]) for i in (3, 4, 5)] == [1, 2, 3] and all(got[i][1] == "length" for i in (3, 4, 5))
    assert all(len(got[i][0]) == 20 and got[i][2] is not None and len(got[i][2]) == 20 for i in (6, 7))
    assert len(got[8][0]) == 20 and got[8][1] == "length" and want[8][2] not in got[8][0]  # banned below min_tokens
