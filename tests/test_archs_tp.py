"""Tensor parallelism on CPU for the mistral and gemma3 tiny presets (issue 40): 2 ranks under gloo give one
process's greedy tokens (fp32), with contexts past the sliding windows (13 and 11 tokens). As tests/test_tp_cpu.py:
every rank driven alike, and the leader driven alone with the followers replaying its calls through the
piecewise prefill pieces (Gemma 3's norms after the row-parallel all-reduces, its two RoPE tables)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.ipc import Receiver, Sender, ShmRing
from rapidserve.parallel.group import TPGroup
from rapidserve.parallel.mirror import Leader, MirrorMessage, follow
from rapidserve.runner import Carry, DecodeItem, ModelRunner, PrefillItem
from rapidserve.sampling_params import SamplingParams
from tests.tp_harness import run_ranks

PROMPTS = [[(7 * i + 5) % 1000 for i in range(22)], [(3 * i + 1) % 1000 for i in range(17)]]
TABLES = [[0, 1], [2, 3]]  # 32 tokens each: prompt + STEPS + 1 fit
STEPS = 8


def _config(model: str):  # noqa: ANN202 - (EngineConfig, ModelSource)
    return build_engine_config(model, device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=64, block_size=16)


def _greedy(runner: ModelRunner, graph_key: str = "default") -> list[list[int]]:
    """Prefill both prompts in one batch, then STEPS decode steps sampled greedily (`sample_next`, the leader's
    path), every decode step fed its tokens from the device."""
    params = [SamplingParams(temperature=0.0)] * 2
    logits = runner.prefill([PrefillItem(p, 0, t) for p, t in zip(PROMPTS, TABLES, strict=True)], graph_key=graph_key)
    last = runner.sample_next(logits, params, [0, 0], (2,)).token_ids
    out = [[int(t)] for t in last]
    for step in range(STEPS):
        items = [DecodeItem(0, len(PROMPTS[i]) + step, TABLES[i]) for i in range(2)]
        logits = runner.decode(items, carry=Carry(last, [(0, 0), (1, 1)]))
        last = runner.sample_next(logits, params, [step + 1] * 2, (2,)).token_ids
        for i in range(2):
            out[i].append(int(last[i]))
    return out


def _rank(model: str, pieces: bool, spec: object, rings: list[str], q: mp.Queue) -> None:
    """Every rank drives its runner (`pieces` False), or rank 0 leads and the others follow through their
    captured prefill pieces (`pieces` True)."""
    torch.set_num_threads(1)
    cfg, source = _config(model)
    tp = TPGroup(spec, cfg.model_config, torch.device("cpu"))  # type: ignore[arg-type]
    try:
        runner = ModelRunner(cfg, source, show_progress=False, tp=tp)
        if not pieces:
            q.put((tp.rank, _greedy(runner)))
            return
        runner.capture_prefill_graphs(key="split", show_progress=False, eager=True)
        if tp.rank == 0:
            runner.leader = Leader(tp, [Sender(ShmRing.attach(n), MirrorMessage) for n in rings], {})
            q.put((0, _greedy(runner, graph_key="split")))
            runner.leader.stop("done")
        else:
            why = follow(runner, Receiver(ShmRing.attach(rings[tp.rank - 1]), MirrorMessage), lambda name: None,
                         lambda: True)
            q.put((tp.rank, why))
    finally:
        tp.close()


@pytest.mark.parametrize("pieces", [False, True], ids=["every-rank-driven", "followers-replay-pieces"])
@pytest.mark.parametrize("model", ["preset:tiny-mistral", "preset:tiny-gemma3"])
def test_tp2_matches_one_process(model: str, pieces: bool) -> None:
    cfg, source = _config(model)
    mcfg = cfg.model_config
    assert mcfg.sliding_window is not None and len(PROMPTS[0]) > mcfg.sliding_window
    want = _greedy(ModelRunner(cfg, source, show_progress=False))
    got = run_ranks(_rank, 2, before=(model, pieces))
    assert got[0][0] == want
    assert got[1][0] == ("done" if pieces else want)
