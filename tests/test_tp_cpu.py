"""Tensor parallelism on CPU (issue 17): N ranks under gloo give the greedy tokens of one process (fp32).

Each rank is a spawned process with a `TPGroup` and a `ModelRunner` over its shard; every rank makes the
same runner calls (prefill, then decode steps, some through `Carry`), the leader's tokens are compared
with a TP-1 runner's. The models cover a plain Llama (KV heads split at TP 2, replicated at TP 4), Qwen2's
q/k/v biases and a tied embedding / LM head.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.parallel.group import TPGroup, group_specs
from rapidserve.runner import Carry, DecodeItem, ModelRunner, PrefillItem

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [7, 7, 300, 12]]
STEPS = 6
BLOCK = 16


def _greedy(runner: ModelRunner) -> list[list[int]]:
    """Prefill both prompts in one batch, then STEPS decode steps; odd steps take their input tokens from
    the device (Carry), as the engine's one-step-ahead loop does."""
    tables = [[0, 1], [2, 3]]
    logits = runner.prefill([PrefillItem(p, 0, t) for p, t in zip(PROMPTS, tables, strict=True)])
    last = logits.argmax(-1)
    out = [[int(t)] for t in last]
    lens = [len(p) for p in PROMPTS]
    for step in range(STEPS):
        items = [DecodeItem(out[i][-1], lens[i] + step, tables[i]) for i in range(2)]
        carry = Carry(last, [(0, 0), (1, 1)]) if step % 2 else None
        last = runner.decode(items, carry=carry).argmax(-1)
        for i in range(2):
            out[i].append(int(last[i]))
    return out


def _config(model: str):  # noqa: ANN202 - (EngineConfig, ModelSource)
    return build_engine_config(model, device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=64,
                               block_size=BLOCK)


def _rank(model: str, spec: object, q: mp.Queue) -> None:
    torch.set_num_threads(1)
    cfg, source = _config(model)
    tp = TPGroup(spec, cfg.model_config, torch.device("cpu"))  # type: ignore[arg-type]
    try:
        runner = ModelRunner(cfg, source, show_progress=False, tp=tp)
        q.put((tp.rank, _greedy(runner), runner.kv_pool.num_blocks, tuple(runner.kv_pool.tensor.shape)))
    finally:
        tp.close()


def _run_tp(model: str, tp: int) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(model, s, q)) for s in group_specs("decode", tp, "gloo")]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            r = q.get(timeout=240)
            got[r[0]] = r[1:]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return got


@pytest.mark.parametrize(("model", "tp"), [("preset:tiny-llama", 2), ("preset:tiny-qwen2", 2),
                                           ("preset:tiny-llama-tied", 2), ("preset:tiny-llama", 4)])
def test_tp_matches_one_process(model: str, tp: int) -> None:
    cfg, source = _config(model)
    want = _greedy(ModelRunner(cfg, source, show_progress=False))
    got = _run_tp(model, tp)
    mcfg = cfg.model_config
    kv_heads = max(1, mcfg.num_kv_heads // tp)
    for rank, (tokens, blocks, shape) in got.items():
        assert tokens == want, f"rank {rank}"
        assert blocks == 8
        assert shape == (mcfg.num_layers, 2, 8, kv_heads, BLOCK, mcfg.head_dim)  # the rank's KV heads only
