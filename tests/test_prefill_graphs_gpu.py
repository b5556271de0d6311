"""Piecewise prefill graphs captured as real CUDA graphs (rapidserve/runner/prefill_graphs.py): the same logits and
K/V as the eager forward, padding rows write nothing, a mixed step's carried tokens reach the graphs, and a
captured runner still serves forwards no bucket covers. The two-process engine replays them in
tests/test_engine_gpu.py (its reference `LLM` runs prefill eager)."""

from __future__ import annotations

import pytest
import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.loader import resolve_model
from rapidserve.runner import Carry, ModelRunner, PrefillItem
from tests.test_prefill_graphs import BATCHES, BUCKETS, _run_batches, _tokens

pytestmark = pytest.mark.gpu


def gpu_runner(model: str, dtype: str) -> ModelRunner:
    cfg, _ = build_engine_config(model, device="cuda", dtype=dtype, num_kv_blocks=32, max_model_len=256,
                                 block_size=16, prefill_graph_tokens=BUCKETS)
    source = resolve_model(cfg.model, preset_device=torch.device("cuda"), preset_dtype=getattr(torch, dtype))
    return ModelRunner(cfg, source, show_progress=False)


@pytest.mark.parametrize(("model", "dtype", "tol"), [("preset:tiny-llama", "float32", 1e-4),
                                                     ("preset:tiny-qwen3", "bfloat16", 3e-2)])
def test_captured_pieces_match_the_eager_forward(model: str, dtype: str, tol: float) -> None:
    runner = gpu_runner(model, dtype)
    want_logits, want_pool = _run_batches(runner)
    runner.capture_prefill_graphs(show_progress=False)
    graphs = runner._prefill_graphs
    assert graphs is not None and set(graphs.sets) == {"default"}
    assert all(isinstance(p, torch.cuda.CUDAGraph) for pieces in graphs.sets["default"].values() for p in pieces)
    assert len(graphs.sets["default"][8]) == len(runner.model.layers) + 1
    got_logits, got_pool = _run_batches(runner)
    for g, w in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    torch.testing.assert_close(got_pool.float(), want_pool.float(), rtol=tol, atol=tol)
    used = {b for batch in BATCHES for it in batch for b in it.block_table} | {4, 5}
    untouched = [b for b in range(runner.kv_pool.num_blocks) if b not in used]
    for k_cache, v_cache in runner.kv_pool.layers:  # padding rows (slot -1) wrote nothing
        assert not k_cache[untouched].any() and not v_cache[untouched].any()

    # a mixed step whose decode rows take their tokens from the device, then a forward longer than every bucket
    items = [PrefillItem([0], 5, [20]), PrefillItem(_tokens(12, 11), 0, [22])]
    carry = Carry(torch.tensor([7, 900], device="cuda"), [(0, 1)])
    graphed = runner.prefill(items, carry=carry).clone()
    long = [PrefillItem(_tokens(140, 12), 0, list(range(23, 32)))]
    long_graphed = runner.prefill(long).clone()
    runner._prefill_graphs = None
    torch.testing.assert_close(graphed, runner.prefill(items, carry=carry), rtol=tol, atol=tol)
    torch.testing.assert_close(long_graphed, runner.prefill(long), rtol=0, atol=0)  # eager both times
