"""The fused MoE kernels (issue 40, rapidserve/ops/triton_moe.py) on a GPU against the CPU-checked reference, and a
tiny MoE preset end to end through `LLM` (bf16, CUDA graphs) against the same model on the CPU reference path.
Skipped without a CUDA or ROCm GPU (both vendors run the same Triton kernels): the lead's GPU runs."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from test_moe_align import check_table
from test_moe_ops import check_fused, check_prefill_variants, check_route, check_routed, check_split, moe_inputs

from rapidserve import LLM, SamplingParams
from rapidserve.loader.presets import load_preset, save_as_hf_folder
from rapidserve.ops.moe import moe_experts_ref, moe_layer_ref
from rapidserve.ops.moe_tiles import GemmTiles, MoeKernelConfig

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def test_fused_moe_small_shapes_on_the_gpu() -> None:
    """The interpreter's cases natively, in fp32 (IEEE), bf16 and fp16; both alignment paths equal the torch one
    exactly."""
    check_fused([torch.float32, torch.bfloat16, torch.float16], "cuda")


def test_alignment_table_on_the_gpu() -> None:
    """tests/test_moe_align.py's table natively: both paths equal the torch alignment, every row written."""
    assert check_table("cuda") > 40


@pytest.mark.parametrize(("e", "k", "h", "i"), [(8, 2, 4096, 14336 // 8), (128, 8, 2048, 768)],
                         ids=["mixtral-8x7b-tp8", "qwen3-30b-a3b"])
@pytest.mark.parametrize("t", [1, 7, 64, 300, 4096])
def test_fused_moe_real_shapes(e: int, k: int, h: int, i: int, t: int) -> None:
    """Real layer shapes (Mixtral's expert at tp 8: 1792 features) at decode and prefill token counts, bf16,
    against the float32 reference on the same bf16 inputs."""
    x, w13, w2, weights, ids = moe_inputs(t, e, k, h, i, torch.bfloat16, seed=t, device="cuda")
    from rapidserve.ops.triton_moe import fused_moe

    got = fused_moe(x, w13, w2, weights, ids)
    want = moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("t", [6, 300])  # 24 pairs: the one-program alignment; 1200: the two-launch one
def test_fused_moe_replays_in_a_cuda_graph(t: int) -> None:
    """Captured once for a batch of t tokens, replayed on new inputs and new routing (copied into the captured
    buffers): the eager result each time, with no host read during capture (a sync would fail the capture)."""
    from rapidserve.ops.triton_moe import ALIGN_ONE_PROGRAM, fused_moe

    x, w13, w2, weights, ids = moe_inputs(t, 16, 4, 256, 128, torch.bfloat16, device="cuda")
    assert (ids.numel() > ALIGN_ONE_PROGRAM) == (t == 300)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in (1, 2, 3):
        x2, _, _, weights2, ids2 = moe_inputs(t, 16, 4, 256, 128, torch.bfloat16, seed=seed, device="cuda")
        x.copy_(x2)
        weights.copy_(weights2)
        ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_moe(x, w13, w2, weights, ids)), seed


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


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_tiny_moe_llm_on_the_gpu_matches_the_cpu(preset: str, tmp_path: Path) -> None:
    """The preset saved as a Hugging Face folder (the same weights on both devices), through `LLM` with CUDA graphs
    (the Triton experts) against the CPU (the reference experts): in float32 the same greedy tokens and logprobs
    within 1e-3; in bf16 the first token's logprob within bf16 rounding and greedy tokens equal until a near-tie
    of the CPU run (a routing near-tie can pick another expert in bf16)."""
    folder = str(tmp_path / preset)
    save_as_hf_folder(load_preset(preset), folder)
    prompts = [[(7 * i + 3) % 900 + 3 for i in range(n)] for n in (5, 17, 33, 120)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    cpu = LLM(folder, device="cpu", dtype="float32", show_progress=False)
    want_all = [o.outputs[0] for o in cpu.generate(prompts, params, use_tqdm=False)]
    from rapidserve.ops import triton_moe

    for dtype in ("float32", "bfloat16"):
        gpu = LLM(folder, device="cuda", dtype=dtype, show_progress=False, num_kv_blocks=64)
        try:
            ops = gpu.engine.runner.ops
            assert ops.moe_experts is triton_moe.fused_moe and ops.moe_layer is triton_moe.routed_moe
            for g, want in zip(gpu.generate(prompts, params, use_tqdm=False), want_all, strict=True):
                got = g.outputs[0]
                assert want.top_logprobs is not None and got.logprobs is not None and want.logprobs is not None
                if dtype == "float32":
                    assert got.token_ids == want.token_ids
                    pairs = zip(got.chosen_logprobs(), want.chosen_logprobs(), strict=True)
                    assert max(abs(a - b) for a, b in pairs) < 1e-3
                    continue
                i = next((j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)) if a != b),
                         None)
                if i is not None:
                    (_, first), (runner_up, second) = want.top_logprobs[i][:2]
                    assert first - second < 0.2 and got.token_ids[i] == runner_up, (i, want.top_logprobs[i])
                if i != 0:
                    assert abs(got.chosen_logprobs()[0] - want.chosen_logprobs()[0]) < 0.1
        finally:
            del gpu
            gc.collect()
            torch.cuda.empty_cache()
