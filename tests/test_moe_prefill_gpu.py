"""The fused MoE kernels' prefill variants (issue 40, rapidserve/ops/triton_moe.py: weights by TMA, persistent grids,
the top-k sum in chunks) on a GPU against the pointer-load launch and the CPU-checked reference (split from
test_moe_gpu.py so that the GPU suite's parts can balance it). Skipped without a CUDA or ROCm GPU."""

from __future__ import annotations

import pytest
import torch
from test_moe_ops import check_prefill_variants, moe_inputs

from rapidserve.ops.moe import moe_experts_ref

pytestmark = pytest.mark.gpu


def test_prefill_variants_small_shapes_on_the_gpu() -> None:
    """The interpreter's check of the TMA / persistent / chunked top-k sum variants natively (fp16 only: the bits are
    compared; fp32 against its TMA twin to rounding), with the GPU's SM count sizing the persistent grids."""
    check_prefill_variants([torch.float16, torch.float32], "cuda")


@pytest.mark.parametrize(("e", "k", "h", "i", "t"), [(8, 2, 4096, 14336 // 8, 1024), (128, 8, 2048, 768, 1024),
                                                     (128, 8, 2048, 768, 256)],
                         ids=["mixtral-8x7b-tp8", "qwen3-30b-a3b", "qwen3-30b-a3b-short"])
def test_prefill_variants_real_shapes(e: int, k: int, h: int, i: int, t: int) -> None:
    """At real prefill shapes (bf16), the packaged tiles' variants (weights by TMA, a persistent grid of 1 and 2
    programs an SM, both; down's top-k sum in chunks where its tile holds too many partial rows) give the bits of
    the pointer-load launch, one program a tile, and agree with the reference; and the same under a CUDA graph."""
    from rapidserve.ops.triton_moe import fused_moe, moe_config

    x, w13, w2, weights, ids = moe_inputs(t, e, k, h, i, torch.bfloat16, seed=t, device="cuda")
    base = moe_config(t * k, e, i, h, x.dtype, x.device)
    base = base._replace(gate_up=base.gate_up._replace(tma=0, persistent=0, split_k=1),
                         down=base.down._replace(tma=0, persistent=0, split_k=1))
    want = fused_moe(x, w13, w2, weights, ids, base)
    ref = moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(want.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    for tma, persistent in [(1, 0), (0, 1), (1, 1), (1, 2)]:
        cfg = base._replace(gate_up=base.gate_up._replace(tma=tma, persistent=persistent),
                            down=base.down._replace(tma=tma, persistent=persistent))
        assert torch.equal(fused_moe(x, w13, w2, weights, ids, cfg), want), (tma, persistent)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fused_moe(x, w13, w2, weights, ids, cfg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
