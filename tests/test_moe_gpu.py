"""The fused MoE kernels (issue 40, rapidserve/ops/triton_moe.py) on a GPU against the CPU-checked reference, and a
tiny MoE preset end to end through `LLM` (bf16, CUDA graphs) against the same model on the CPU reference path (the
prefill variants: test_moe_prefill_gpu.py; the layer from its router: test_moe_routed_gpu.py).
Skipped without a CUDA or ROCm GPU (both vendors run the same Triton kernels): the lead's GPU runs."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from test_moe_align import check_table
from test_moe_ops import check_fused, moe_inputs

from rapidserve import LLM, SamplingParams
from rapidserve.loader.presets import load_preset, save_as_hf_folder
from rapidserve.ops.moe import moe_experts_ref

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
