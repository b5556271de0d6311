"""A ModelRunner of a preset's shapes cut to a few layers, for the GPU tests that time or inspect whole decode steps
(tests/test_pdl_gpu.py, tests/test_w8a16_gpu.py): the preset's deterministic random weights in bf16, built straight
from a ModelSource (no folder), quantized at load where `quantization` says."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch

from rapidserve.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from rapidserve.loader import ModelSource, expected_tensor_shapes
from rapidserve.loader.preset_table import preset_table
from rapidserve.loader.presets import preset_tensor
from rapidserve.quant_config import QuantizationConfig
from rapidserve.runner import ModelRunner


def preset_runner(preset: str, layers: int, *, ctx: int, graph_batches: Sequence[int], max_num_seqs: int,
                  max_num_batched_tokens: int, quantization: QuantizationConfig | None = None,
                  device: str = "cuda", num_blocks: int | None = 1024,
                  gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
                  step_processes: int = 1) -> ModelRunner:
    """`preset`'s shapes with `layers` layers, decode graphs at `graph_batches` (empty: none), 1024 KV blocks
    (`num_blocks` None: the pool sized from `gpu_memory_utilization`, runner/kv_budget.py, with `step_processes`),
    `max_model_len` `ctx`; `quantization` None: bf16."""
    mcfg = dataclasses.replace(preset_table()[preset], num_layers=layers)
    shapes = expected_tensor_shapes(mcfg)
    dev = torch.device(device)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in shapes.items():
            yield name, preset_tensor(preset, mcfg, name, shape, device=dev, dtype=torch.bfloat16)

    # no graph batches: the runner captures no decode graphs (RunnerConfig refuses an empty tuple)
    graphs = ({"graph_batch_sizes": tuple(graph_batches)} if graph_batches else {"use_cuda_graphs": False})
    source = ModelSource(mcfg, weights, len(shapes), None, None, None, f"{preset} ({layers} layers)")
    cfg = EngineConfig(model=preset, model_config=mcfg,
                       cache=CacheConfig(num_blocks=num_blocks, gpu_memory_utilization=gpu_memory_utilization),
                       scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=max_num_batched_tokens, max_model_len=ctx),
                       runner=RunnerConfig(device=device, dtype="bfloat16", **graphs))
    if quantization is not None:
        cfg = dataclasses.replace(cfg, quantization=quantization)
    return ModelRunner(cfg, source, show_progress=False, step_processes=step_processes)
