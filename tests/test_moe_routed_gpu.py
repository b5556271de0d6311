"""The MoE layer from its router's logits (issue 40, rapidserve/ops/triton_moe.py `routed_moe`: routing, alignment,
split K and the top-k sum in the down launch) on a GPU against torch's routing and the CPU-checked reference, eager
and in CUDA graphs (split from test_moe_gpu.py so that the GPU suite's parts can balance it). Skipped without a CUDA
or ROCm GPU."""

from __future__ import annotations

import pytest
import torch
from test_moe_ops import check_route, check_routed, check_split, moe_inputs

from rapidserve.ops.moe import moe_layer_ref
from rapidserve.ops.moe_tiles import GemmTiles, MoeKernelConfig

pytestmark = pytest.mark.gpu


def test_routing_split_and_topk_sum_small_shapes_on_the_gpu() -> None:
    """The interpreter's checks of the decode-size folds natively: the routing kernels (both paths) against torch's
    routing, split K and the top-k sum in the down launch (its semaphores' acquire/release across programs, which the
    interpreter runs one at a time), `routed_moe` against the torch routing + reference."""
    check_route("cuda")
    check_split("cuda")
    check_routed("cuda")


# decode tiles with K split in both GEMMs (what a tuned table may ask for), and the same tiles unsplit
SPLIT = MoeKernelConfig(16, GemmTiles(64, 128, 1, 4, 3, 4), GemmTiles(128, 128, 1, 4, 4, 3))


@pytest.mark.parametrize(("e", "k", "h", "i"), [(8, 2, 4096, 14336 // 8), (128, 8, 2048, 768)],
                         ids=["mixtral-8x7b-tp8", "qwen3-30b-a3b"])
@pytest.mark.parametrize("t", [1, 3, 16, 64])
@pytest.mark.parametrize("cfg", [None, SPLIT], ids=["tables", "split"])
def test_routed_moe_real_shapes(e: int, k: int, h: int, i: int, t: int, cfg: MoeKernelConfig | None) -> None:
    """The MoE layer from its router's logits at real layer shapes and decode batches (the one-program routing up to
    128 pairs, the routing launch + two-launch alignment above), bf16, against the torch routing and the float32
    reference on the same inputs; the same bits on a second call (the top-k sum's order is fixed)."""
    from rapidserve.ops.triton_moe import routed_moe

    x, w13, w2, _, _ = moe_inputs(t, e, k, h, i, torch.bfloat16, seed=t, device="cuda")
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).cuda()
    got = routed_moe(x, logits, w13, w2, k, True, cfg)
    want = moe_layer_ref(x.float(), logits, w13.float(), w2.float(), k, True)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert torch.equal(got, routed_moe(x, logits, w13, w2, k, True, cfg))


@pytest.mark.parametrize("t", [1, 6, 40])  # 8, 48 pairs: one-program routing; 320: the routing launch, two aligning
def test_routed_moe_replays_in_a_cuda_graph(t: int) -> None:
    """`routed_moe` with split K captured once and replayed on new inputs and logits: the eager bits each time (the
    semaphores zeroed by the alignment's launch in every replay, the sums in a fixed order), with programmatic
    dependent launch as the GPU has it (on for H100/H200: kept in the graph as programmatic edges) and without."""
    from rapidserve.ops.triton_moe import routed_moe

    x, w13, w2, _, _ = moe_inputs(t, 128, 8, 2048, 768, torch.bfloat16, device="cuda")
    logits = torch.randn(t, 128, device="cuda").to(torch.bfloat16)
    routed_moe(x, logits, w13, w2, 8, True, SPLIT)  # compile outside the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = routed_moe(x, logits, w13, w2, 8, True, SPLIT)
    for seed in (1, 2, 3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        logits.copy_(torch.randn(logits.shape, device="cuda", generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, routed_moe(x, logits, w13, w2, 8, True, SPLIT)), seed
        assert torch.equal(out, routed_moe(x, logits, w13, w2, 8, True, SPLIT, pdl=False)), seed
