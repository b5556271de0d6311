"""Block-wise prefill under tensor parallelism on CPU (gloo): the leader publishes each task's pieces
(prefill_begin / prefill_block / prefill_end with the task id), the followers replay them in order, even
when two tasks interleave (a preemption), and every rank's KV shard ends bit-identical to the one-shot
prefills' (the same collectives in the same order), with the one-process greedy tokens."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.ipc import Receiver, Sender, ShmRing
from rapidserve.loader import resolve_model
from rapidserve.parallel.group import TPGroup
from rapidserve.parallel.mirror import Leader, MirrorMessage, follow
from rapidserve.runner import ModelRunner
from rapidserve.sampling_params import SamplingParams
from tests.test_prefill_task import BATCH_A, BATCH_B, PREFIX, PrefillItem, runner_for
from tests.tp_harness import run_ranks

GREEDY = SamplingParams(temperature=0.0)


def _scenario(runner: ModelRunner, mode: str) -> list[int]:
    """The prefix, then batches A and B: one-shot, or block-wise with B preempting A after one layer."""
    runner.prefill([PrefillItem(PREFIX, 0, [4, 5], need_logits=False)])

    def first(logits: torch.Tensor) -> list[int]:
        n = logits.shape[0]
        return runner.sample_next(logits, [GREEDY] * n, [0] * n, (2,)).token_ids.tolist()

    if mode == "oneshot":
        return first(runner.prefill(BATCH_A)) + first(runner.prefill(BATCH_B))
    a = runner.prefill_task(BATCH_A)
    a.step(1)
    b = runner.prefill_task(BATCH_B)
    b.step(1)
    b.step(9)
    got_b = first(b.logits())
    a.step(9)
    return first(a.logits()) + got_b


def _digest(runner: ModelRunner) -> str:
    return hashlib.sha256(runner.kv_pool.tensor.numpy().tobytes()).hexdigest()


def _rank(model: str, spec: Any, rings: list[str], mode: str, q: Any) -> None:
    torch.set_num_threads(1)
    cfg, _ = build_engine_config(model, device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=256,
                                 block_size=16)
    source = resolve_model(cfg.model, preset_device=torch.device("cpu"), preset_dtype=torch.float32)
    tp = TPGroup(spec, cfg.model_config, torch.device("cpu"))
    try:
        runner = ModelRunner(cfg, source, show_progress=False, tp=tp)
        if tp.rank == 0:
            runner.leader = Leader(tp, [Sender(ShmRing.attach(n), MirrorMessage) for n in rings], {})
            tokens = _scenario(runner, mode)
            runner.leader.stop("done")
            q.put((0, tokens, _digest(runner)))
        else:
            why = follow(runner, Receiver(ShmRing.attach(rings[tp.rank - 1]), MirrorMessage), lambda name: None,
                         lambda: True)
            q.put((tp.rank, why, _digest(runner)))
    finally:
        tp.close()


def _run(model: str, tp: int, mode: str) -> dict[int, tuple[Any, ...]]:
    return run_ranks(_rank, tp, before=(model,), after=(mode,), role="prefill", slot_size=8192)


@pytest.mark.parametrize("model", ["preset:tiny-llama", "preset:tiny-qwen3"])
def test_followers_replay_interleaved_tasks(model: str) -> None:
    one = runner_for(model)
    want = _scenario(one, "oneshot")
    oneshot, blocks = _run(model, 2, "oneshot"), _run(model, 2, "blocks")
    assert oneshot[0][0] == want and blocks[0][0] == want
    assert blocks[1][0] == "done"
    for rank in (0, 1):  # every rank's KV shard: the same bytes either way
        assert blocks[rank][1] == oneshot[rank][1], f"rank {rank}"


class _Recorder:
    """A stand-in Leader: records what would be published."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, tuple[int, int]]] = []

    def forward(self, kind: str, arrays: object, graph_key: str, carry: object, *, task: int = -1,
                layers: tuple[int, int] = (0, 0)) -> None:
        self.calls.append((kind, task, layers))


def test_a_leader_publishes_each_piece_with_its_task() -> None:
    runner = runner_for("preset:tiny-llama")
    rec = _Recorder()
    runner.leader = rec  # type: ignore[assignment]
    a = runner.prefill_task(BATCH_A)
    a.step(2)
    b = runner.prefill_task(BATCH_B)
    b.step(5)
    b.logits()
    a.step(1)
    a.logits()
    ta, tb = a.task_id, b.task_id
    assert ta != tb
    assert rec.calls == [("prefill_begin", ta, (0, 0)), ("prefill_block", ta, (0, 2)),
                         ("prefill_begin", tb, (0, 0)), ("prefill_block", tb, (0, 3)), ("prefill_end", tb, (3, 3)),
                         ("prefill_block", ta, (2, 3)), ("prefill_end", ta, (3, 3))]
