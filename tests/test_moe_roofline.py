"""The roofline of mixture-of-experts models (issue 40, rapidserve/partition/moe_costs.py): a decode step reads the
expected unique experts of its batch, E * (1 - (1 - k/E)^B), a prefill chunk every expert; FLOPs are the k
experts each token uses; dense models are unchanged."""

from __future__ import annotations

import math

import pytest

from rapidserve.loader.presets import preset_config
from rapidserve.partition.moe_costs import expected_unique_experts, experts_read
from rapidserve.partition.roofline import decode_operators, mixed_operators, prefill_operators, totals


@pytest.mark.parametrize(("e", "k", "b", "want"), [
    (8, 2, 0, 0.0),
    (8, 2, 1, 2.0),  # one token reads exactly its k experts
    (8, 2, 2, 3.5),  # 8 * (1 - 0.75^2)
    (8, 2, 16, 8 * (1 - 0.75**16)),  # 7.92: nearly all of Mixtral's experts
    (128, 8, 1, 8.0),
    (128, 8, 8, 128 * (1 - (120 / 128) ** 8)),  # 51.9: Qwen3-30B-A3B at batch 8
    (128, 8, 64, 128 * (1 - (120 / 128) ** 64)),  # 126.9
    (4, 4, 3, 4.0),  # k = E: every token reads every expert
    (1, 1, 5, 1.0),
])
def test_expected_unique_experts(e: int, k: int, b: int, want: float) -> None:
    assert math.isclose(expected_unique_experts(e, k, b), want, rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize(("e", "k", "b"), [(0, 1, 1), (8, 0, 1), (8, 9, 1), (8, 2, -1)])
def test_expected_unique_experts_refuses_impossible_counts(e: int, k: int, b: int) -> None:
    with pytest.raises(ValueError, match="need 1 <= top_k <= num_experts"):
        expected_unique_experts(e, k, b)


def test_expected_unique_experts_by_simulation() -> None:
    """The formula against counting: B tokens each drawing k distinct experts of E uniformly."""
    import random

    rng = random.Random(0)
    for e, k, b in ((8, 2, 3), (16, 4, 5), (64, 6, 10)):
        runs = 4000
        mean = sum(len({x for _ in range(b) for x in rng.sample(range(e), k)}) for _ in range(runs)) / runs
        assert abs(mean - expected_unique_experts(e, k, b)) < 0.05 * e / math.sqrt(k), (e, k, b)


def _expert_weight_bytes(ops: list, name: str) -> float:
    return next(o.weight_bytes * o.count for o in ops if o.name == name)


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("tp", [1, 2])
def test_decode_reads_the_batchs_experts_prefill_all(preset: str, tp: int) -> None:
    cfg = preset_config(preset)
    moe = cfg.moe
    assert moe is not None
    e, k, i, h, layers = moe.num_experts, moe.top_k, moe.intermediate_size // tp, cfg.hidden_size, cfg.num_layers
    one_expert = 3 * h * i * 2  # gate, up, down of one expert on one rank, bf16
    for b in (1, 2, 8, 64):
        ops = decode_operators(cfg, b, 512, tp=tp)
        read = _expert_weight_bytes(ops, "moe_gate_up") + _expert_weight_bytes(ops, "moe_down")
        assert math.isclose(read, layers * expected_unique_experts(e, k, b) * one_expert, rel_tol=1e-12)
        assert all(o.count == 0 for o in ops if o.name in ("gate_up_proj", "act_mul", "down_proj"))
        flops = sum(o.flops for o in ops if o.name in ("moe_gate_up", "moe_down"))
        assert flops == 6 * b * k * h * i  # the k experts each token uses
    p_ops = prefill_operators(cfg, 2048, tp=tp)
    read = _expert_weight_bytes(p_ops, "moe_gate_up") + _expert_weight_bytes(p_ops, "moe_down")
    assert read == layers * e * one_expert
    # a decode step's whole weight read grows with the batch until every expert is read
    steps = [totals(decode_operators(cfg, b, 1, tp=tp))[1] for b in (1, 4, 16, 256)]
    assert steps == sorted(steps) and steps[0] < 0.5 * steps[-1]
    mixed = mixed_operators(cfg, [100] * 4, [(60, 0)], tp=tp)
    assert math.isclose(_expert_weight_bytes(mixed, "moe_down"), layers * experts_read(cfg, 64) * h * i * 2,
                        rel_tol=1e-12)


def test_dense_layers_of_an_moe_model_keep_the_dense_mlp() -> None:
    cfg = preset_config("tiny-qwen3-moe")  # 3 layers, layer 1 dense
    ops = decode_operators(cfg, 4, 16)
    count = {o.name: o.count for o in ops}
    assert count["gate_up_proj"] == count["down_proj"] == 1 and count["moe_gate_up"] == count["moe_router"] == 2


def test_dense_models_are_unchanged() -> None:
    cfg = preset_config("qwen3-8b")
    ops = decode_operators(cfg, 8, 1024)
    assert not [o for o in ops if o.name.startswith("moe_")] and experts_read(cfg, 8) == 0.0
    assert next(o.count for o in ops if o.name == "gate_up_proj") == cfg.num_layers
