"""Block-wise prefill (rapidserve/runner/prefill_task.py) on CPU in fp32: however the layers are split into
blocks, and whatever task runs between two blocks (a preemption), the logits and every K/V written are
bit-identical to the one-shot `ModelRunner.prefill`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.loader import resolve_model
from rapidserve.runner import ModelRunner, PrefillItem
from rapidserve.runner.prefill_task import PrefillTask

BS = 16


def runner_for(model: str) -> ModelRunner:
    cfg, _ = build_engine_config(model, device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=256,
                                 block_size=BS)
    source = resolve_model(cfg.model, preset_device=torch.device("cpu"), preset_dtype=torch.float32)
    return ModelRunner(cfg, source, show_progress=False)


@pytest.fixture(scope="module", params=["preset:tiny-llama", "preset:tiny-qwen3", "preset:tiny-qwen2"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    return runner_for(request.param)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


PREFIX = _tokens(32, 1)  # two full blocks computed before the batch: the third item attends to them
BATCH_A = [
    PrefillItem(_tokens(40, 2), 0, [0, 1, 2]),
    PrefillItem(_tokens(7, 3), 0, [3]),
    PrefillItem(_tokens(20, 4), 32, [4, 5, 6, 7]),  # after a cached prefix of 32 tokens (blocks 4, 5)
    PrefillItem(_tokens(33, 5), 0, [8, 9, 10], need_logits=False),  # a chunk of a longer prompt
]
BATCH_B = [PrefillItem(_tokens(5, 6), 0, [12]), PrefillItem(_tokens(19, 7), 0, [13, 14])]


def _fresh(runner: ModelRunner) -> None:
    runner.kv_pool.tensor.zero_()
    runner.prefill([PrefillItem(PREFIX, 0, [4, 5], need_logits=False)])


def _one_shot(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _fresh(runner)
    a = runner.prefill(BATCH_A).clone()
    b = runner.prefill(BATCH_B).clone()
    return a, b, runner.kv_pool.tensor.clone()


def _blocks(task: PrefillTask, sizes: list[int]) -> None:
    """Blocks of `sizes` layers while layers are left (the models have 2 or 3), then one layer at a time."""
    for n in sizes + [1] * task.num_layers:
        if task.done:
            return
        task.step(n)
        assert task.query()  # on CPU a block is done when its call returns


@pytest.mark.parametrize("sizes", [[1, 1, 1], [2, 1], [1, 2], [3], [100]])
def test_block_wise_equals_one_shot(runner: ModelRunner, sizes: list[int]) -> None:
    want_a, want_b, want_kv = _one_shot(runner)
    _fresh(runner)
    a = runner.prefill_task(BATCH_A)
    assert a.layers_done == 0 and not a.done
    _blocks(a, sizes)
    got_a = a.logits()
    b = runner.prefill_task(BATCH_B)
    _blocks(b, sizes)
    assert torch.equal(got_a, want_a) and torch.equal(b.logits(), want_b)
    assert torch.equal(runner.kv_pool.tensor, want_kv)


def test_a_task_preempted_between_blocks_resumes_bit_identical(runner: ModelRunner) -> None:
    """Task A runs one layer, task B (the preemptor) runs whole, then A resumes: both as one-shot."""
    want_a, want_b, want_kv = _one_shot(runner)
    _fresh(runner)
    a = runner.prefill_task(BATCH_A)
    a.step(1)
    b = runner.prefill_task(BATCH_B)
    _blocks(b, [1, 1, 1])
    got_b = b.logits()
    a.step(100)
    assert torch.equal(a.logits(), want_a) and torch.equal(got_b, want_b)
    assert torch.equal(runner.kv_pool.tensor, want_kv)


@pytest.mark.parametrize("misuse", [
    lambda t: t.logits(),  # before every layer is queued
    lambda t: (t.step(99), t.step(1)),  # past the last layer
    lambda t: (t.step(99), t.logits(), t.logits()),  # logits twice
])
def test_misuse_raises(runner: ModelRunner, misuse: Callable[[PrefillTask], object]) -> None:
    with pytest.raises(RuntimeError):
        misuse(runner.prefill_task(BATCH_B))
