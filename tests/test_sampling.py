"""SamplingParams validation and serialisation; Sampler correctness, filters and seeded reproducibility."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
import torch

from rapidserve.sampler import Sampler, SamplerOutput, SamplingTensors, make_generator
from rapidserve.sampling_params import SamplingParams, SamplingParamsError

# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": 1.0}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"seed": 2**63}, "seed"),  # msgpack carries int64 at most
    ({"seed": 2**70}, "seed"),
    ({"top_k": 2**31}, "top_k"),  # int32 on the device
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"stop_token_ids": (2**31,)}, "stop_token_ids"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
    ({"stop_token_ids": ("a",)}, "stop_token_ids"),
    ({"stop": ("a", "b", "c", "d", "e")}, "stop"),
    ({"stop": ("a", "")}, "stop"),
    ({"stop": (3,)}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
])
def test_invalid_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(SamplingParamsError, match=rf"^{field}="):
        SamplingParams(**kwargs)
    assert issubclass(SamplingParamsError, ValueError)


@pytest.mark.parametrize("kwargs", [
    {},
    {"temperature": 0},
    {"top_k": -1}, {"top_k": 0}, {"top_k": 1}, {"top_k": 100_000},
    {"top_p": 1e-6}, {"top_p": 1},
    {"min_p": 0}, {"min_p": 1},
    {"max_tokens": None, "min_tokens": 1000},
    {"min_tokens": 16, "max_tokens": 16},
    {"logprobs": 0}, {"logprobs": 20},
    {"seed": -5}, {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"top_k": 2**31 - 1},
    {"stop": ("a", "b", "c", "d"), "stop_token_ids": (0, 2)},
])
def test_valid_params(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop_token_ids, p.stop) == (16, 0, (), ())
    assert (p.ignore_eos, p.logprobs, p.skip_special_tokens) == (False, None, True)


def test_loose_inputs_are_normalised_and_hashable() -> None:
    p = SamplingParams(temperature=0, stop="###", stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4)
    hash(p)
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # type: ignore[misc]
    with pytest.raises(SamplingParamsError, match="top_p"):
        p.replace(top_p=0.0)


@pytest.mark.parametrize(("kwargs", "greedy"), [
    ({"temperature": 0.0}, True), ({"temperature": 1e-7}, True), ({"top_k": 1}, True),
    ({"temperature": 0.5, "top_k": 1}, True), ({}, False), ({"temperature": 0.01}, False),
    ({"top_k": 2}, False), ({"top_p": 0.01}, False),
])
def test_is_greedy(kwargs: dict[str, Any], greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_msgspec_round_trip_preserves_all_fields() -> None:
    p = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1234, max_tokens=None,
                       min_tokens=2, stop_token_ids=(2, 128001), stop=("\n\n", "END"), ignore_eos=True,
                       logprobs=5, skip_special_tokens=False)
    for codec in (msgspec.msgpack, msgspec.json):
        q = codec.decode(codec.encode(p), type=SamplingParams)
        assert q == p
        assert msgspec.structs.asdict(q) == msgspec.structs.asdict(p)
        assert isinstance(q.stop_token_ids, tuple) and isinstance(q.stop, tuple)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams()), type=SamplingParams) == \
        SamplingParams()


def test_decoding_invalid_params_fails_naming_the_field() -> None:
    raw = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(raw, type=SamplingParams)


# --------------------------------------------------------------------------- Sampler helpers

V = 64


def _logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _sample(logits: torch.Tensor, params: list[SamplingParams], sampler: Sampler | None = None,
            gens: list[torch.Generator | None] | None = None) -> SamplerOutput:
    sampler = sampler or Sampler("cpu", seed=0)
    if gens is None:
        gens = [make_generator(p.seed, "cpu") if p.seed is not None and not p.is_greedy else None
                for p in params]
    return sampler.sample(logits, params, gens)


def _draw(logits_row: torch.Tensor, p: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one row, as a batch of n identical rows."""
    out = _sample(logits_row.expand(n, -1).contiguous(), [p] * n, Sampler("cpu", seed=seed))
    return out.token_ids


def _reference_probs(logits_row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a random row should be drawn from, built the slow obvious way."""
    x = logits_row.double() / p.temperature
    probs = torch.softmax(x, -1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    order = sorted(range(len(probs)), key=lambda i: (-float(x[i]), i))
    if p.top_k > 0:
        for i in order[p.top_k:]:
            keep[i] = False
    if p.top_p < 1.0:
        kept = probs * keep
        kept = kept / kept.sum()
        mass = 0.0
        for i in order:
            if mass >= p.top_p:
                keep[i] = False
            mass += float(kept[i])
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs.max()
    out = probs * keep
    return out / out.sum()


def _chi_square(draws: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(draws, minlength=len(expected)).double()
    n = float(draws.numel())
    assert counts[expected == 0].sum() == 0, "drew a token of probability 0"
    # Pool the rare tokens so every cell expects >= 5 draws.
    big = expected * n >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big] * n, (expected[~big] * n).sum().reshape(1)])
    keep = exp > 0
    stat = float((((obs - exp) ** 2) / exp)[keep].sum())
    return stat, int(keep.sum()) - 1


def _chi_square_limit(df: int) -> float:
    # Wilson-Hilferty approximation of the 99.99% quantile: a correct sampler fails 1 in 10^4.
    z = 3.719
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# --------------------------------------------------------------------------- Sampler tests


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = _logits(16, 1000).to(dtype)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 16)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[3] == 10
    assert out.logprobs is None and out.top_logprobs is None


@pytest.mark.parametrize("temperature", [1.0, 0.3, 2.0])
def test_top_k_1_equals_greedy(temperature: float) -> None:
    logits = _logits(32, 500, seed=1)
    out = _sample(logits, [SamplingParams(temperature=temperature, top_k=1, seed=5)] * 32)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    logits = _logits(12, 300, seed=2, scale=0.5)  # flat: random rows rarely hit the argmax
    params = [SamplingParams(temperature=0.0) if i % 3 == 0 else SamplingParams(temperature=1.5)
              for i in range(12)]
    original = logits.clone()
    out = _sample(logits, params)
    assert torch.equal(logits, original), "the caller's logits must not be modified"
    greedy = [i for i in range(12) if i % 3 == 0]
    assert torch.equal(out.token_ids[greedy], logits.argmax(-1)[greedy])
    assert not torch.equal(out.token_ids, logits.argmax(-1))


def test_tiny_temperature_converges_to_argmax() -> None:
    logits = _logits(1, 200, seed=3)
    top2 = logits[0].topk(2).values
    assert float(top2[0] - top2[1]) > 0.05
    assert bool((_draw(logits[0], SamplingParams(temperature=1e-3), 2000) == logits.argmax()).all())
    # Below the greedy threshold the row is argmaxed; no overflow to NaN / inf.
    p = SamplingParams(temperature=1e-8)
    assert p.is_greedy
    assert bool((_draw(logits[0], p, 10) == logits.argmax()).all())


def test_seeded_request_is_independent_of_batching() -> None:
    steps, vocab = 12, 257
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, min_p=0.01, seed=1234)
    step_logits = [_logits(1, vocab, seed=100 + s, scale=1.0)[0] for s in range(steps)]

    def run(batch_size: int, row: int, sampler_seed: int) -> list[int]:
        sampler = Sampler("cpu", seed=sampler_seed)
        gen = make_generator(1234, "cpu")
        other_gen = make_generator(99, "cpu")
        tokens = []
        for s in range(steps):
            logits = _logits(batch_size, vocab, seed=1000 * s + batch_size, scale=1.0)
            logits[row] = step_logits[s]
            params: list[SamplingParams] = []
            gens: list[torch.Generator | None] = []
            for i in range(batch_size):
                if i == row:
                    params.append(target)
                    gens.append(gen)
                elif i % 3 == 0:
                    params.append(SamplingParams(temperature=0.7, seed=99))
                    gens.append(other_gen)
                elif i % 3 == 1:
                    params.append(SamplingParams(temperature=1.0, top_k=5))
                    gens.append(None)
                else:
                    params.append(SamplingParams(temperature=0.0))
                    gens.append(None)
            tokens.append(int(sampler.sample(logits, params, gens).token_ids[row]))
        return tokens

    alone = run(1, 0, sampler_seed=0)
    assert len(set(alone)) > 1
    assert run(7, 4, sampler_seed=0) == alone
    assert run(5, 2, sampler_seed=17) == alone
    assert run(16, 15, sampler_seed=3) == alone


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = _logits(64, 100, seed=4, scale=1.0)
    params = [SamplingParams(temperature=1.0)] * 64
    a = _sample(logits, params, Sampler("cpu", seed=7)).token_ids
    b = _sample(logits, params, Sampler("cpu", seed=7)).token_ids
    c = _sample(logits, params, Sampler("cpu", seed=8)).token_ids
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_seeded_row_without_generator_is_an_error() -> None:
    with pytest.raises(ValueError, match="generator"):
        Sampler().sample(_logits(1), [SamplingParams(seed=1)], [None])


@pytest.mark.parametrize("k", [1, 3, 10, 63])
def test_top_k_never_leaves_the_top_k(k: int) -> None:
    logits = _logits(1, V, seed=5, scale=0.3)  # flat, so every allowed token gets drawn
    draws = _draw(logits[0], SamplingParams(temperature=2.0, top_k=k), 4000)
    allowed = set(logits[0].topk(k).indices.tolist())
    assert set(draws.tolist()) == allowed


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.3, {0}), (0.5, {0, 1}), (0.65, {0, 1}), (0.71, {0, 1, 2}),
                                               (0.92, {0, 1, 2, 3})])
def test_top_p_never_leaves_the_nucleus(top_p: float, nucleus: set[int]) -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.05] + [0.05 / 60] * 60)
    rank = [3, 0, 2, 1, *range(4, 64)]  # token j has the rank[j]-th largest probability
    logits = probs.log()[torch.tensor(rank)]
    draws = _draw(logits, SamplingParams(top_p=top_p), 4000)
    assert set(draws.tolist()) == {j for j in range(64) if rank[j] in nucleus}


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_drops_unlikely_tokens(min_p: float) -> None:
    logits = _logits(1, V, seed=6, scale=1.5)[0]
    probs = torch.softmax(logits, -1)
    allowed = probs >= min_p * probs.max()
    assert int(allowed.sum()) < V
    draws = _draw(logits, SamplingParams(min_p=min_p), 4000)
    assert bool(allowed[draws].all())
    kept = probs * allowed
    expected_counts = 4000 * kept / kept.sum()
    assert set(torch.nonzero(expected_counts >= 20)[:, 0].tolist()) <= set(draws.tolist())


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 1.7, "top_k": 12},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 1.3, "top_k": 20, "top_p": 0.9},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 0.8, "top_k": 30, "top_p": 0.95, "min_p": 0.05},
])
def test_empirical_distribution_matches(kwargs: dict[str, Any]) -> None:
    logits = _logits(1, 40, seed=7, scale=1.5)[0]
    p = SamplingParams(**kwargs)
    draws = _draw(logits, p, 20000, seed=11)
    stat, df = _chi_square(draws, _reference_probs(logits, p))
    assert stat < _chi_square_limit(df), (stat, df)


def test_seeded_draws_match_the_distribution() -> None:
    logits = _logits(1, 20, seed=8, scale=1.0)[0]
    p = SamplingParams(temperature=1.0, seed=42)
    gen = make_generator(42, "cpu")
    sampler = Sampler()
    draws = torch.cat([sampler.sample(logits[None], [p], [gen]).token_ids for _ in range(5000)])
    stat, df = _chi_square(draws, _reference_probs(logits, p))
    assert stat < _chi_square_limit(df), (stat, df)


def test_logprobs_are_raw_log_softmax_at_the_chosen_token() -> None:
    logits = _logits(6, 300, seed=9)
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.5, logprobs=3),
              SamplingParams(temperature=1.3, top_k=7), SamplingParams(temperature=0.9, logprobs=5, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, logprobs=1)]
    out = _sample(logits, params)
    ref = torch.log_softmax(logits.double(), -1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs.double(), ref.gather(1, out.token_ids[:, None])[:, 0], atol=1e-5)
    assert out.top_logprobs is not None
    values, ids = out.top_logprobs
    assert values.shape == ids.shape == (6, 5) and ids.dtype == torch.int64
    assert bool((values[:, :-1] >= values[:, 1:]).all())
    assert torch.allclose(values.double(), ref.gather(1, ids), atol=1e-5)
    assert torch.allclose(values.double(), ref.topk(5, -1).values, atol=1e-5)


def test_logprobs_zero_returns_no_top_logprobs() -> None:
    out = _sample(_logits(2), [SamplingParams(logprobs=0), SamplingParams()])
    assert out.logprobs is not None and out.top_logprobs is None


def test_sampling_tensors_flags() -> None:
    params = [SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(top_k=10_000),
              SamplingParams(top_k=-1, min_p=0.2), SamplingParams(top_k=1, top_p=0.3)]
    t = SamplingTensors.from_params(params, 1000, "cpu")
    assert t.random_rows == (1, 2)
    assert t.random_idx is not None and t.random_idx.tolist() == [1, 2]
    assert (t.do_top_k, t.do_top_p, t.do_min_p) == (False, False, True)
    assert t.top_k.tolist() == [1000] * 4 and t.max_num_logprobs == -1
    assert not t.all_greedy and not t.all_random
    t2 = SamplingTensors.from_params([SamplingParams(top_k=5, top_p=0.9, logprobs=2)], 1000, "cpu")
    assert (t2.do_top_k, t2.do_top_p, t2.do_min_p) == (True, True, False)
    assert t2.all_random and t2.random_idx is None and t2.max_num_logprobs == 2


def test_empty_batch_and_shape_checks() -> None:
    assert _sample(torch.empty(0, V), []).token_ids.shape == (0,)
    with pytest.raises(ValueError, match="match"):
        Sampler().sample(_logits(2), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="batch, vocab"):
        Sampler().sample(torch.zeros(V), [SamplingParams()], [None])


@pytest.mark.parametrize("params, j, want_seed", [
    (SamplingParams(), 0, None),
    (SamplingParams(n=3), 2, None),
    (SamplingParams(n=3, seed=10), 0, 10),
    (SamplingParams(n=3, seed=10), 2, 12),
    (SamplingParams(seed=-4), 0, -4),
])
def test_sample_j_gets_seed_plus_j(params: SamplingParams, j: int, want_seed: int | None) -> None:
    sub = params.for_sample(j)
    assert sub.n == 1 and sub.seed == want_seed
    assert msgspec.structs.replace(sub, n=params.n, seed=params.seed) == params  # nothing else changes


def test_a_top_p_below_float32_range_keeps_the_most_likely_token() -> None:
    """top_p=3e-122 is 0 in float32: the most likely token must still be kept (found by the HTTP fuzzer,
    where the row was also grammar-masked, so sampling token 0 broke the grammar)."""
    logits = torch.full((2, 16), -math.inf)
    logits[:, 5], logits[:, 9] = 1.0, 3.0
    p = SamplingParams(temperature=1.0, top_p=3.1e-122, min_p=0.9)
    out = Sampler("cpu").sample(logits, [p, p], [None, None])
    assert out.token_ids.tolist() == [9, 9]
