"""Logit controls (penalties, logit_bias, bad words, allowed_token_ids): validation, the bad-word
tokenization rule, and the batched device implementation (`ModelRunner.sample_next` ->
`logit_controls.py`) against a plain-Python reference on fixed logits, over several steps whose
tokens reach the "host" one step late (as in the engines' one-step-ahead scheduling)."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.loader import resolve_model
from rapidserve.logit_controls import HISTORY, TokenHistory, TokenState, apply_controls, plan_controls
from rapidserve.prompt import PromptError, PromptLimits
from rapidserve.runner import ModelRunner
from rapidserve.runner import sampling as runner_sampling
from rapidserve.sampler import token_generators
from rapidserve.sampling_params import SamplingParams, SamplingParamsError, resolve_bad_words

V = 1280  # tiny-llama's vocabulary

# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"logit_bias": ((1, 2.0), (1, 3.0))}, "logit_bias"),  # an id twice
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": [2**31]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": [" \n"]}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
    ({"bad_words_token_ids": [list(range(33))]}, "bad_words_token_ids"),
    ({"bad_words_token_ids": [[1, -1]]}, "bad_words_token_ids"),
])
def test_invalid_controls_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(SamplingParamsError, match=rf"^{field}="):
        SamplingParams(**kwargs)


def test_controls_normalise_and_round_trip() -> None:
    p = SamplingParams(presence_penalty=1, frequency_penalty=-2, repetition_penalty=2,
                       logit_bias={"9": 250, 3: -0.5, 4: -1e9}, allowed_token_ids=[5, 1], bad_words="x",
                       bad_words_token_ids=[[7], [8, 9]])
    assert isinstance(p.presence_penalty, float) and p.repetition_penalty == 2.0
    assert p.logit_bias == ((3, -0.5), (4, -100.0), (9, 100.0))  # sorted, clamped to [-100, 100] (vLLM)
    assert p.allowed_token_ids == (5, 1) and p.bad_words == ("x",) and p.bad_words_token_ids == ((7,), (8, 9))
    assert hash(p) == hash(SamplingParams(**msgspec.structs.asdict(p)))
    for codec in (msgspec.msgpack, msgspec.json):
        assert codec.decode(codec.encode(p), type=SamplingParams) == p
    assert p.has_logit_controls and p.has_penalties and p.needs_token_history
    assert not SamplingParams().has_logit_controls
    assert not SamplingParams(logit_bias={1: 1.0}, bad_words_token_ids=[[3]]).needs_token_history
    assert SamplingParams(bad_words_token_ids=[[3, 4]]).needs_token_history
    assert p.for_sample(1).logit_bias == p.logit_bias  # n > 1: every sample keeps the controls


def test_bad_words_are_tokenized_with_and_without_a_leading_space() -> None:
    vocab = {"cat": [10], " cat": [11], "dog house": [20, 21], " dog house": [22, 21], "big": [30, 31],
             " big": [32], "red": [40], " red": [40]}
    p = resolve_bad_words(SamplingParams(bad_words=["cat", "  dog house", "big", "red"]), lambda t: vocab[t])
    # " big" is one token where "big" is two (a different length), " red" is the same token: not added
    assert p.bad_words_token_ids == ((10,), (11,), (20, 21), (22, 21), (30, 31), (40,))
    with pytest.raises(SamplingParamsError, match="^bad_words: 'long'"):
        resolve_bad_words(SamplingParams(bad_words=["long"]), lambda t: list(range(40)))


def test_the_edge_checks_token_ids_and_tokenized_bad_words() -> None:
    limits = PromptLimits(V, 512)
    limits.check_params(SamplingParams(logit_bias={V - 1: 1.0}, allowed_token_ids=[0], bad_words_token_ids=[[1]]))
    for kw, field in (({"logit_bias": {V: 1.0}}, "logit_bias"), ({"allowed_token_ids": [3, V]}, "allowed_token_ids"),
                      ({"bad_words_token_ids": [[1, V]]}, "bad_words"), ({"bad_words": ["x"]}, "bad_words")):
        with pytest.raises(PromptError, match=f"'{field}'"):
            limits.check_params(SamplingParams(**kw))


# --------------------------------------------------------------------------- the reference


def reference_logits(raw: np.ndarray, p: SamplingParams, prompt: list[int], outputs: list[int]) -> np.ndarray:
    """Row `raw` [V] float32 with `p`'s controls, plain loops, in vLLM's order."""
    x = raw.astype(np.float32).copy()
    if p.allowed_token_ids is not None:
        for t in range(len(x)):
            if t not in p.allowed_token_ids:
                x[t] = -np.inf
    for w in p.bad_words_token_ids:
        prefix = list(w[:-1])
        if len(prefix) <= len(outputs) and (not prefix or outputs[len(outputs) - len(prefix):] == prefix):
            x[w[-1]] = -np.inf
    for t, b in p.logit_bias:
        x[t] = x[t] + np.float32(b)
    counts = Counter(outputs)
    in_prompt = set(prompt)
    rep, freq, pres = (np.float32(v) for v in (p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
    for t in range(len(x)):
        c = counts.get(t, 0)
        if p.repetition_penalty != 1.0 and (t in in_prompt or c > 0):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        x[t] = (x[t] - freq * np.float32(c)) - pres * np.float32(c > 0)
    return x


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=8,
                                 max_model_len=256)
    source = resolve_model(cfg.model, preset_device=torch.device("cpu"), preset_dtype=torch.float32)
    return ModelRunner(cfg, source, show_progress=False)


def _row_params(rng: random.Random) -> list[SamplingParams]:
    """Mixed rows: plain greedy and random, each control alone and together, greedy and seeded random."""
    top = [rng.randrange(V) for _ in range(6)]
    controls: list[dict[str, Any]] = [
        {},
        {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.6},
        {"frequency_penalty": 1.3},
        {"presence_penalty": -0.7},
        {"frequency_penalty": 0.4, "presence_penalty": 0.9, "repetition_penalty": 1.2},
        {"logit_bias": {top[0]: 5.5, top[1]: -3.0}},
        {"allowed_token_ids": top[:4]},
        {"bad_words_token_ids": [[top[2]], [top[3], top[4]], [top[4], top[3], top[5]]]},
        {"allowed_token_ids": top, "logit_bias": {top[5]: 2.0}, "repetition_penalty": 1.4,
         "bad_words_token_ids": [[top[0], top[1]]]},
    ]
    out = []
    for c in controls:
        out.append(SamplingParams(temperature=0.0, logprobs=2, **c))
        out.append(SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=rng.randrange(1000), **c))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_matches_the_reference_over_steps(runner: ModelRunner, seed: int) -> None:
    """Each row's tokens, step after step, equal the reference's (greedy: its argmax; seeded random: the
    sampler on the reference's logits with the same generators); logprobs are the raw logits'; the
    host learns each step's tokens only after the next step was sampled; one row is preempted midway."""
    rng = random.Random(seed)
    params = _row_params(rng)
    b = len(params)
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 20))] for _ in range(b)]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 6))] for _ in range(b)]  # e.g. after a preemption
    for i, p in enumerate(params):  # make bad-word prefixes match sometimes
        if p.bad_words_token_ids and len(p.bad_words_token_ids) > 1:
            outputs[i] += list(p.bad_words_token_ids[1][:-1])
    keys = [(f"r{i}", 0) for i in range(b)]
    known = [list(o) for o in outputs]  # what the host knows: one step behind from the second step on
    state = runner.tokens
    gen = torch.Generator().manual_seed(seed)
    for step in range(8):
        if step == 4:  # row 3 is preempted: a new key, refilled from what the host knows then
            known[3] = list(outputs[3])
            keys[3] = ("r3", 1)
            state.retain(keys)
        raw = torch.randn(b, V, generator=gen) * 4
        index = [len(o) for o in outputs]
        hist = [TokenHistory(keys[i], prompts[i], known[i]) for i in range(b)]
        out = runner.sample_next(raw.clone(), params, index, (), history=hist.__getitem__)
        ref = torch.from_numpy(np.stack([reference_logits(raw[i].numpy(), p, prompts[i], outputs[i])
                                         for i, p in enumerate(params)]))
        gens = token_generators([(p.seed, k) for p, k in zip(params, index, strict=True)], runner.device)
        want = runner.sampler.sample(ref, params, gens).token_ids
        assert out.token_ids.tolist() == want.tolist(), f"step {step}"
        assert out.logprobs is not None
        torch.testing.assert_close(out.logprobs, torch.log_softmax(raw, -1).gather(1, out.token_ids[:, None])[:, 0])
        for i, t in enumerate(out.token_ids.tolist()):
            outputs[i].append(t)
        known = [o[:-1] for o in outputs]  # the newest token is still "in flight"
    assert state.in_use == sum(1 for p in params if p.needs_token_history)
    state.retain(())
    assert state.in_use == 0


def test_a_batch_without_controls_takes_the_plain_path(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*a: object, **k: object) -> None:
        raise AssertionError("the controls path ran for a batch without controls")

    monkeypatch.setattr(runner_sampling, "plan_controls", fail)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3, logprobs=1)]
    logits = torch.randn(2, V)
    out = runner.sample_next(logits.clone(), params, [0, 0], ())
    plain = runner.sample(logits.clone(), params, token_generators([(None, 0), (3, 0)], runner.device))
    assert out.token_ids.tolist() == plain.token_ids.tolist()
    assert runner.tokens.in_use == 0


def test_penalties_need_the_request_history(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="history"):
        runner.sample_next(torch.randn(1, V), [SamplingParams(presence_penalty=1.0)], [0], ())


# --------------------------------------------------------------------------- what each control does


def test_frequency_and_presence_give_exact_logits() -> None:
    state = TokenState("cpu")
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, temperature=0.0)
    logits = torch.zeros(1, 8)
    plan = plan_controls([p], [4], lambda i: TokenHistory("a", [7], [1, 1, 1, 4]), state, 8)
    x = apply_controls(logits, plan, state)
    want = [0.0, -1.75, 0.0, 0.0, -0.75, 0.0, 0.0, 0.0]  # 3 x 0.5 + 0.25 for token 1; 0.5 + 0.25 for token 4
    assert x[0].tolist() == want
    rep = SamplingParams(repetition_penalty=2.0)
    plan = plan_controls([rep], [1], lambda i: TokenHistory("b", [0, 1], [2]), state, 8)
    x = apply_controls(torch.tensor([[4.0, -4.0, 4.0, 4.0, -4.0, 0, 0, 0]]), plan, state)
    assert x[0].tolist() == [2.0, -8.0, 2.0, 4.0, -4.0, 0, 0, 0]  # prompt and outputs: /2 if > 0, else *2
    assert logits.abs().sum() == 0  # the caller's logits are left alone


def _draws(runner: ModelRunner, p: SamplingParams, n: int = 64) -> list[int]:
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(5))
    return runner.sample_next(logits, [p] * n, [0] * n, ()).token_ids.tolist()


def test_bias_bans_and_forces_tokens(runner: ModelRunner) -> None:
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(5))
    top = int(logits[0].argmax())
    assert top not in _draws(runner, SamplingParams(temperature=0.0, logit_bias={top: -100}))[:1]
    assert 7 not in _draws(runner, SamplingParams(temperature=1.0, top_k=2, logit_bias={7: -100}))
    assert set(_draws(runner, SamplingParams(temperature=1.0, logit_bias={7: 100}))) == {7}
    assert set(_draws(runner, SamplingParams(temperature=0.0, logit_bias={9: 100}))) == {9}


def test_allowed_token_ids_only(runner: ModelRunner) -> None:
    allowed = {3, 500, 1279}
    got = _draws(runner, SamplingParams(temperature=1.5, allowed_token_ids=sorted(allowed)))
    assert set(got) <= allowed and len(set(got)) > 1
    assert set(_draws(runner, SamplingParams(temperature=0.0, allowed_token_ids=[42]))) == {42}


def test_bad_words_never_complete_in_greedy_decoding(runner: ModelRunner) -> None:
    """Greedy decoding on logits that always prefer the same 3-token phrase: with it banned, the phrase's
    last token never follows its first two (and a one-token bad word never appears); the history ring
    covers the phrase across many steps."""
    state = runner.tokens
    phrase = [11, 12, 13]
    p = SamplingParams(temperature=0.0, bad_words_token_ids=[phrase, [99]])
    outputs: list[int] = []
    for k in range(3 * HISTORY):
        logits = torch.zeros(1, V)
        logits[0, phrase[k % 3]] = 10.0
        logits[0, 99] = 5.0
        logits[0, 50] = 1.0
        tok = runner.sample_next(logits, [p], [k], (), history=lambda i: TokenHistory("bw", [1], outputs)).token_ids
        outputs.append(int(tok[0]))
    assert 99 not in outputs
    assert all(outputs[j:j + 3] != phrase for j in range(len(outputs) - 2)), outputs
    assert outputs.count(13) < outputs.count(11)  # 13 was banned after 11, 12 and taken otherwise
    state.retain(())


def test_slots_grow_and_are_reused() -> None:
    state = TokenState("cpu")
    slots = [state.slot(TokenHistory(i, [i], [i, i]), 16) for i in range(9)]
    assert sorted(slots) == list(range(9)) and state.capacity == 16 and state.in_use == 9
    assert state.counts[slots[5], 5].item() == 2 and bool(state.prompt[slots[5], 5])
    state.retain(range(4))
    assert state.in_use == 4
    s = state.slot(TokenHistory("new", [], [3]), 16)
    assert s in slots[4:] and state.counts[s].sum().item() == 1  # refilled, nothing of its last user left
    assert math.isclose(float(state.recent[s][0]), 3) and int(state.recent[s][1]) == -1
    with pytest.raises(ValueError, match="in flight"):
        state.slot(TokenHistory("x", [], [1, -1]), 16)
