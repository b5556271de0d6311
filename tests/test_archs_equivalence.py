"""`LLM.generate` of the mistral and gemma3 tiny presets against transformers' MistralForCausalLM and
Gemma3ForCausalLM on CPU in fp32 (issue 40): the same weights saved as a model folder, greedy tokens identical and
logprobs within 1e-4 with prompts and outputs longer than the sliding window (13 and 11 tokens), transformers
stepping with its own (sliding-window) KV cache. Then what the engine does around the model must not change its
tokens: chunked prefill, preemption, small blocks, piecewise prefill graphs, a second process's attached weights.
"""

from __future__ import annotations

import pytest
import torch

from rapidserve import LLM, SamplingParams
from rapidserve.llm import build_engine_config
from rapidserve.loader.presets import load_preset, save_as_hf_folder
from rapidserve.runner import ModelRunner, PrefillItem
from rapidserve.runner.model_sharing import attach_model, export_shared
from tests.test_llm_equivalence import hf_greedy

NEW = ["tiny-mistral", "tiny-gemma3"]
STEPS = 40
LENGTHS = [1, 5, 12, 13, 14, 40, 100, 3]  # around and past the windows (13, 11)


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=NEW)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path_factory.mktemp(request.param))
    save_as_hf_folder(load_preset(request.param), folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    return folder, ref


def test_greedy_tokens_and_logprobs_match_transformers(pair: tuple[str, torch.nn.Module]) -> None:
    folder, ref = pair
    assert type(ref).__name__ in ("MistralForCausalLM", "Gemma3ForCausalLM")
    llm = LLM(folder, dtype="float32", device="cpu", show_progress=False)
    mcfg = llm.config.model_config
    assert mcfg.sliding_window is not None and mcfg.sliding_window < max(LENGTHS)
    prompts = _prompts(mcfg.vocab_size, LENGTHS)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        want, want_lp = hf_greedy(ref, prompt, STEPS)
        got = out.outputs[0]
        assert got.token_ids == want, f"prompt of {len(prompt)} tokens"
        assert got.logprobs is not None
        assert max(abs(a - b) for a, b in zip(got.chosen_logprobs(), want_lp, strict=True)) < 1e-4


def test_the_window_matters() -> None:
    """The same weights without the window answer otherwise once the context passes it (the test above would not
    notice a window left unapplied by both sides otherwise)."""
    prompts = _prompts(1100, [40])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    a = LLM("preset:tiny-mistral", dtype="float32", device="cpu", show_progress=False).generate(
        prompts, params, use_tqdm=False)[0].outputs[0]
    unwindowed = LLM("preset:tiny-mistral", dtype="float32", device="cpu", show_progress=False)
    for layer in unwindowed.engine.runner.model.layers:
        layer.window = None
    b = unwindowed.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert a.logprobs is not None and b.logprobs is not None
    pairs = zip(a.chosen_logprobs(), b.chosen_logprobs(), strict=True)
    assert a.token_ids != b.token_ids or max(abs(x - y) for x, y in pairs) > 1e-3


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("engine_kw", [
    {"max_num_batched_tokens": 24},  # prompts chunked: later chunks attend to a cached prefix past the window
    {"num_kv_blocks": 12},  # a tiny pool: sequences are preempted and recomputed
    {"block_size": 8, "max_num_seqs": 3},
], ids=["chunked-prefill", "preemption", "small-blocks"])
def test_scheduling_does_not_change_greedy_output(name: str, engine_kw: dict[str, int]) -> None:
    ref_llm = LLM(f"preset:{name}", dtype="float32", device="cpu", show_progress=False)
    prompts = _prompts(ref_llm.config.model_config.vocab_size, [40, 7, 30, 12, 50, 3], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(f"preset:{name}", dtype="float32", device="cpu", show_progress=False, max_model_len=128,
              **engine_kw)  # type: ignore[arg-type]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    if "num_kv_blocks" in engine_kw:
        assert llm.engine.num_preemptions > 0
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def _runner(name: str) -> ModelRunner:
    cfg, source = build_engine_config(f"preset:{name}", device="cpu", dtype="float32", num_kv_blocks=16,
                                      max_model_len=128, block_size=16)
    return ModelRunner(cfg, source, show_progress=False)


ITEMS = [PrefillItem([(5 * i + 1) % 1000 for i in range(37)], 0, [0, 1, 2]),
         PrefillItem([(3 * i + 2) % 1000 for i in range(20)], 0, [3, 4])]


@pytest.mark.parametrize("name", NEW)
def test_piecewise_prefill_pieces_give_the_forward(name: str) -> None:
    """The piecewise prefill pieces (plain calls on CPU) run each layer's attention with its window and scale, and
    Gemma's layers with their own RoPE table: the one-shot forward's logits, bit for bit."""
    runner = _runner(name)
    want = runner.prefill(ITEMS).clone()
    runner.capture_prefill_graphs(key="split", show_progress=False, eager=True)
    graphs = runner._prefill_graphs
    assert graphs is not None
    runs: list[int] = []
    real = graphs.run
    graphs.run = lambda *a, **k: runs.append(a[1]) or real(*a, **k)  # type: ignore[method-assign]
    got = runner.prefill(ITEMS, graph_key="split")
    assert runs == [64] and torch.equal(got, want)


@pytest.mark.parametrize("name", NEW)
def test_attached_weights_compute_the_same(name: str) -> None:
    """A second model over the exporter's weights and pool (rapid mode's prefill worker: `attach_model`) rebuilds
    Gemma's two RoPE tables and its class: the exporter's logits, bit for bit."""
    runner = _runner(name)
    want = runner.prefill(ITEMS).clone()
    state = export_shared(runner.model, runner.kv_pool)
    model, pool = attach_model(runner.mcfg, runner.ops, runner.attn, runner.dtype, runner.device,
                               int(runner.model.cos_sin.shape[-2]), state)
    assert type(model) is type(runner.model) and torch.equal(model.cos_sin, runner.model.cos_sin)
    runner.model, runner.kv_pool = model, pool
    assert torch.equal(runner.prefill(ITEMS), want)
