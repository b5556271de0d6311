"""`LLM.generate` against transformers' own implementation, on CPU in fp32.

Greedy output must be token-identical: for the embedded SmolLM2 (transformers loads the same GGUF)
and for the tiny preset of each architecture (saved as a model folder that both load). The engine
runs all prompts together (continuous batching); the reference runs each prompt alone: step by step
with its KV cache for the tiny presets, and for SmolLM2 one forward over the engine's whole output
(its greedy choice at every position must be the engine's token: the same condition, 48x fewer calls).
"""

from __future__ import annotations

import pytest
import torch

from rapidserve import LLM, SamplingParams
from rapidserve.loader.presets import load_preset, save_as_hf_folder

NEW_TOKENS = 48

CHATS = [
    "What is the capital of France?",
    "Hi!",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, for a ten-year-old who likes football.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish and German.",
    "Summarize the following text: The quick brown fox jumps over the lazy dog. The dog did not react. "
    "Later that day the fox came back with friends, and together they ran across the field, over the "
    "river and into the forest, where they stayed until the evening.",
    "What is 12 times 12?",
    "Give me a short recipe for pancakes with exact quantities.",
]


def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """transformers' forward with its own KV cache, one prompt at a time, argmax each step."""
    ids, past, out, lps = torch.tensor([prompt]), None, [], []
    with torch.no_grad():
        for _ in range(steps):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float()
            nxt = int(logits.argmax())
            out.append(nxt)
            lps.append(float(torch.log_softmax(logits, -1)[nxt]))
            ids = torch.tensor([[nxt]])
    return out, lps


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    return LLM(dtype="float32", device="cpu", show_progress=False)


def hf_greedy_check(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy choice after each prefix prompt + tokens[:i], and its logprob of tokens[i]: one
    forward over the whole sequence (the logits at every position). `tokens` is transformers' own greedy
    output exactly when the choices equal it: then each step's prefix is the one greedy decoding feeds it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
    lps = torch.log_softmax(logits, -1)
    return logits.argmax(-1).tolist(), [float(lps[i, t]) for i, t in enumerate(tokens)]


def test_smollm2_greedy_matches_transformers(smollm2: LLM, smollm2_hf: torch.nn.Module) -> None:
    tok = smollm2.get_tokenizer()
    assert tok is not None
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    assert len({len(p) for p in prompts}) >= 6  # lengths really differ
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = smollm2.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        got = out.outputs[0]
        assert len(got.token_ids) == NEW_TOKENS
        want, want_lp = hf_greedy_check(smollm2_hf, prompt, got.token_ids)
        assert got.token_ids == want, f"prompt of {len(prompt)} tokens diverged at new token " \
            f"{next(i for i, (a, b) in enumerate(zip(got.token_ids, want, strict=True)) if a != b)}"
        assert got.logprobs is not None
        assert max(abs(a - b) for a, b in zip(got.chosen_logprobs(), want_lp, strict=True)) < 1e-4


def test_smollm2_answers_paris(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    assert tok is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = smollm2.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>


def test_string_prompts_stop_strings_and_n(smollm2: LLM) -> None:
    p = SamplingParams(temperature=0.0, max_tokens=40, stop=("Paris",))
    out = smollm2.generate("The capital of France is the city of", p, use_tqdm=False)[0].outputs[0]
    assert "Paris" not in out.text and out.finish_reason == "stop"
    outs = smollm2.generate(["Once upon a time"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8),
                            use_tqdm=False)[0].outputs
    again = smollm2.generate(["Once upon a time"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8),
                             use_tqdm=False)[0].outputs
    assert len(outs) == 3 and [o.token_ids for o in outs] == [o.token_ids for o in again]


TINY = ["tiny-llama", "tiny-llama-tied", "tiny-qwen2", "tiny-qwen3"]


@pytest.fixture(scope="module", params=TINY)
def tiny_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path_factory.mktemp(request.param))
    save_as_hf_folder(load_preset(request.param), folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    return folder, ref


def _random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_tiny_presets_match_transformers(tiny_pair: tuple[str, torch.nn.Module]) -> None:
    folder, ref = tiny_pair
    llm = LLM(folder, dtype="float32", device="cpu", show_progress=False)
    prompts = _random_prompts(llm.config.model_config.vocab_size, [1, 5, 16, 17, 33, 64, 100, 3])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NEW_TOKENS)[0]


@pytest.mark.parametrize("engine_kw", [
    {"max_num_batched_tokens": 24},  # prompts chunked: later chunks attend to a cached prefix (c > 0)
    {"num_kv_blocks": 12},  # a tiny pool: sequences are preempted and recomputed
    {"block_size": 8, "max_num_seqs": 3},
], ids=["chunked-prefill", "preemption", "small-blocks"])
def test_scheduling_does_not_change_greedy_output(engine_kw: dict[str, int]) -> None:
    """The same tokens come out however prompts are chunked, batched, preempted or laid out in blocks."""
    ref_llm = LLM("preset:tiny-llama", dtype="float32", device="cpu", show_progress=False)
    prompts = _random_prompts(ref_llm.config.model_config.vocab_size, [40, 7, 30, 12, 50, 3], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM("preset:tiny-llama", dtype="float32", device="cpu", show_progress=False,
              max_model_len=128, **engine_kw)  # type: ignore[arg-type]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    if "num_kv_blocks" in engine_kw:
        assert llm.engine.num_preemptions > 0
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks  # every block returned


def test_seeded_sampling_is_reproducible_across_batches() -> None:
    llm = LLM("preset:tiny-qwen3", dtype="float32", device="cpu", show_progress=False)
    prompts = _random_prompts(llm.config.model_config.vocab_size, [9, 20, 4])
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts, [seeded, SamplingParams(temperature=1.0, max_tokens=5),
                                   SamplingParams(temperature=0.0, max_tokens=30)], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone


def test_generate_rejects_mismatched_params_and_overlong_prompt() -> None:
    llm = LLM("preset:tiny-llama", dtype="float32", device="cpu", show_progress=False, max_model_len=64)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1, 2], [3]], [SamplingParams(), SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.generate([[5, 6], [1] * 64], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_work  # the valid prompt before it was not left behind
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("a string prompt", use_tqdm=False)
