"""Decode graphs of several keys (rapid mode's partition configurations) write one logits buffer
(rapidserve/runner/decode_graphs.py's memory layout): the graphs of every key share its storage, and steps that
alternate keys, each key's stream ordered after the other's as the decode worker's switch orders it, give the eager
step's logits every time."""

from __future__ import annotations

import pytest
import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.loader import resolve_model
from rapidserve.runner import DecodeItem, ModelRunner, PrefillItem

pytestmark = pytest.mark.gpu


def test_keys_share_one_logits_buffer_and_alternating_keys_match_eager() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA or ROCm GPU")
    cfg, _ = build_engine_config("preset:tiny-llama", device="cuda", dtype="float32", num_kv_blocks=32,
                                 max_model_len=256, block_size=16)
    source = resolve_model(cfg.model, preset_device=torch.device("cuda"), preset_dtype=torch.float32)
    runner = ModelRunner(cfg, source, show_progress=False)
    prompts = [[(7 * i + 3) % 1000 + 3 for i in range(30)], [(11 * i + 5) % 1000 + 3 for i in range(20)]]
    runner.prefill([PrefillItem(prompts[0], 0, [0, 1]), PrefillItem(prompts[1], 0, [2, 3])])
    steps = [DecodeItem(11, 30, [0, 1]), DecodeItem(13, 20, [2, 3])]
    want = runner.decode(steps, graph_key="eager").clone()  # no graphs under this key: the eager step
    streams = {"a": torch.cuda.Stream(), "b": torch.cuda.Stream()}
    for key, stream in streams.items():
        runner.capture_decode_graphs(stream, key=key, show_progress=False)
    ptrs = {g.logits.untyped_storage().data_ptr() for graphs in runner._graphs.values() for g in graphs.values()}
    assert len(ptrs) == 1  # one buffer for every graph of every key
    last = torch.cuda.current_stream()
    for key in ("a", "b", "a", "b"):
        stream = streams[key]
        stream.wait_stream(last)  # the switch's order (the decode worker synchronizes the old stream)
        with torch.cuda.stream(stream):
            got = runner.decode(steps, graph_key=key).clone()
        assert runner.decode_graph(2, key) is not None
        last = stream
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
