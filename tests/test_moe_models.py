"""The mixture-of-experts families (issue 40: mixtral, qwen3_moe) against transformers' own MixtralForCausalLM and
Qwen3MoeForCausalLM on CPU in fp32, and their loading: config.json both ways, the Hugging Face tensor names (sharded
safetensors too), tensor-parallel parts of every expert, the presets' shapes, and what is refused by name.

The tiny presets cover both routings: tiny-mixtral (top-2 of 8, renormalised, every layer sparse) and
tiny-qwen3-moe (top-4 of 16, not renormalised, layer 1 dense as an `mlp_only_layers` entry, per-head q/k norms).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidserve import LLM, SamplingParams
from rapidserve.config_base import ConfigError
from rapidserve.config_builder import build_engine_config
from rapidserve.loader import ModelLoadError, UnsupportedQuantization, expected_tensor_shapes, resolve_model
from rapidserve.loader.hf import config_from_hf_dict, read_hf_config
from rapidserve.loader.presets import hf_config_dict, load_preset, preset_config, save_as_hf_folder
from rapidserve.moe_config import MoeConfig
from rapidserve.parallel.shard import shard_config, shard_kind, tp_layout
from tests.test_llm_equivalence import _random_prompts, hf_greedy
from tests.test_loader_shard import check_ranks, open_format

MOE_TINY = ["tiny-mixtral", "tiny-qwen3-moe"]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=MOE_TINY)
def moe_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """A tiny MoE preset saved as a sharded Hugging Face folder, and transformers' model of that folder."""
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path_factory.mktemp(request.param))
    save_as_hf_folder(load_preset(request.param), folder, max_shard_bytes=150_000)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    return folder, ref


def test_transformers_reads_our_folder(moe_pair: tuple[str, Any]) -> None:
    """The folder's config.json and names are transformers' (its conversion into fused experts took every
    tensor, row for row), the parameter count is ours, and our loader reads the same folder back to the preset."""
    folder, ref = moe_pair
    assert len(list(Path(folder).glob("model-*.safetensors"))) > 1  # sharded
    source = resolve_model(folder)
    cfg = source.config
    assert type(ref).__name__ == {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[cfg.arch]
    assert cfg == preset_config({"mixtral": "tiny-mixtral", "qwen3_moe": "tiny-qwen3-moe"}[cfg.arch]).replace(
        name=cfg.name)
    assert sum(p.numel() for p in ref.parameters()) == cfg.num_params()
    ours = dict(source.weights())
    block = "block_sparse_moe" if cfg.arch == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if cfg.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    experts = ref.model.layers[0].mlp.experts
    assert cfg.moe is not None
    for e in range(cfg.moe.num_experts):
        gate, up, down = (ours[f"model.layers.0.{block}.experts.{e}.{n}.weight"] for n in names)
        assert torch.equal(experts.gate_up_proj[e], torch.cat([gate, up])) and torch.equal(experts.down_proj[e], down)
    assert torch.equal(ref.model.layers[0].mlp.gate.weight, ours[f"model.layers.0.{block}.gate.weight"])


def test_greedy_and_logprobs_match_transformers(moe_pair: tuple[str, Any]) -> None:
    """Batched prompts of many lengths through `LLM` (continuous batching, chunked prefill) give transformers'
    greedy tokens, each prompt alone with its KV cache, and the same logprobs within fp32 rounding."""
    folder, ref = moe_pair
    llm = LLM(folder, dtype="float32", device="cpu", show_progress=False, max_num_batched_tokens=64)
    prompts = _random_prompts(llm.config.model_config.vocab_size, [1, 5, 17, 33, 70, 3], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        want, want_lps = hf_greedy(ref, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == want
        assert got.logprobs is not None
        assert max(abs(a - b) for a, b in zip(got.chosen_logprobs(), want_lps, strict=True)) < 1e-4


def test_prefill_logits_match_transformers(moe_pair: tuple[str, Any]) -> None:
    """The logits of one batched prefill forward (prefixes of one prompt, each its own sequence) at their last
    positions, against transformers' logits at those positions of the whole prompt, within fp32 rounding."""
    from rapidserve.runner import ModelRunner, PrefillItem

    folder, ref = moe_pair
    cfg, source = build_engine_config(folder, device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=256)
    runner = ModelRunner(cfg, source, show_progress=False)
    prompt = _random_prompts(cfg.model_config.vocab_size, [45], seed=9)[0]
    cuts = [1, 7, 20, 45]
    items = [PrefillItem(prompt[:n], 0, [3 * i, 3 * i + 1, 3 * i + 2]) for i, n in enumerate(cuts)]
    got = runner.prefill(items)
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0].float()[[n - 1 for n in cuts]]
    assert got.shape == want.shape and want.std() > 0.1
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MOE_TINY)
@pytest.mark.parametrize("fmt", ["preset", "hf-index"])
def test_rank_parts_of_every_expert(name: str, fmt: str, tmp_path: Path) -> None:
    """Each tensor-parallel rank reads a slice of every expert (gate/up rows, down columns; the router whole),
    bit for bit `shard_tensor`'s, and the ranks reassemble to the whole model (tests/test_loader_shard.py)."""
    source = open_format(fmt, name, tmp_path)
    whole = {n: t.clone() for n, t in source.weights()}
    assert check_ranks(source, whole) == [1, 2, 4]
    lay = tp_layout(source.config, 2, 1)
    moe = shard_config(source.config, lay).moe
    assert moe is not None and moe.intermediate_size == source.config.moe.intermediate_size // 2  # type: ignore[union-attr]


@pytest.mark.parametrize(("name", "kind"), [
    ("model.layers.3.block_sparse_moe.experts.7.w1.weight", "column"),
    ("model.layers.3.block_sparse_moe.experts.7.w3.weight", "column"),
    ("model.layers.3.block_sparse_moe.experts.7.w2.weight", "row"),
    ("model.layers.3.block_sparse_moe.gate.weight", "replicated"),
    ("model.layers.0.mlp.experts.100.gate_proj.weight", "column"),
    ("model.layers.0.mlp.experts.100.up_proj.weight", "column"),
    ("model.layers.0.mlp.experts.100.down_proj.weight", "row"),
    ("model.layers.0.mlp.gate.weight", "replicated"),
    ("model.layers.1.mlp.gate_proj.weight", "column"),  # a dense layer of a Qwen3-MoE model
    ("model.layers.1.mlp.down_proj.weight", "row"),
])
def test_shard_kinds_of_moe_tensors(name: str, kind: str) -> None:
    assert shard_kind(name) == kind


def test_presets_shapes() -> None:
    mixtral, qwen = preset_config("mixtral-8x7b"), preset_config("qwen3-30b-a3b")
    assert (mixtral.arch, mixtral.moe, mixtral.num_layers, mixtral.hidden_size, mixtral.vocab_size) == (
        "mixtral", MoeConfig(8, 2, 14336), 32, 4096, 32000)
    assert abs(mixtral.num_params() - 46.70e9) < 0.01e9  # Mixtral-8x7B: 46.7B
    assert (qwen.arch, qwen.moe, qwen.num_layers, qwen.hidden_size, qwen.num_kv_heads, qwen.qk_norm) == (
        "qwen3_moe", MoeConfig(128, 8, 768), 48, 2048, 4, True)
    assert abs(qwen.num_params() - 30.53e9) < 0.01e9  # Qwen3-30B-A3B: 30.5B
    for name in ("mixtral-8x7b", "qwen3-30b-a3b"):  # the tp sizes vLLM serves them at
        for tp in (1, 2, 4, 8):
            assert preset_config(name).tp_problem(tp) is None, (name, tp)
    shapes = expected_tensor_shapes(preset_config("tiny-qwen3-moe"))
    assert shapes["model.layers.0.mlp.experts.15.down_proj.weight"] == (64, 32)
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (128, 64)  # the dense layer
    assert "model.layers.1.mlp.gate.weight" not in shapes and "model.layers.0.mlp.gate_proj.weight" not in shapes


QWEN_MOE = {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
MIXTRAL = {"model_type": "mixtral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "sliding_window": None}


@pytest.mark.parametrize(("d", "want"), [
    (MIXTRAL, MoeConfig(4, 2, 96)),
    ({**MIXTRAL, "sliding_window": 4096, "max_position_embeddings": 4096}, MoeConfig(4, 2, 96)),  # covers all
    (QWEN_MOE, MoeConfig(8, 2, 32, renormalize=False)),  # transformers' default norm_topk_prob: false
    ({**QWEN_MOE, "norm_topk_prob": True, "mlp_only_layers": [0, 3]}, MoeConfig(8, 2, 32, True, (0, 3))),
    ({**QWEN_MOE, "decoder_sparse_step": 2}, MoeConfig(8, 2, 32, False, (0, 2))),  # layers 1 and 3 sparse
    ({**QWEN_MOE, "use_sliding_window": False, "sliding_window": 4096}, MoeConfig(8, 2, 32, False)),
])
def test_moe_config_json(d: dict[str, Any], want: MoeConfig) -> None:
    cfg = config_from_hf_dict(d, "x/config.json")
    assert cfg.moe == want and cfg.arch == d["model_type"]
    assert cfg.qk_norm == (d["model_type"] == "qwen3_moe") and not cfg.attention_bias
    back = config_from_hf_dict(hf_config_dict(cfg), "y/config.json")  # what we write reads back the same
    assert back.moe == cfg.moe and back.replace(name=cfg.name) == cfg


@pytest.mark.parametrize(("d", "match"), [
    ({**MIXTRAL, "sliding_window": 4096, "max_position_embeddings": 32768}, "sliding_window=4096"),
    ({**QWEN_MOE, "use_sliding_window": True}, "use_sliding_window=true"),
    ({**QWEN_MOE, "num_experts": 0}, "num_experts=0: a qwen3_moe model without experts"),
    ({**MIXTRAL, "num_experts_per_tok": 5}, "top_k=5 .* at most num_experts=4"),
    ({**QWEN_MOE, "mlp_only_layers": "all"}, "mlp_only_layers='all' must be a list"),
    ({**QWEN_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step=0 must be >= 1"),
    ({**QWEN_MOE, "num_experts_per_tok": "2"}, "num_experts_per_tok='2' must be an integer"),
    ({**QWEN_MOE, "model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not supported"),
    ({**QWEN_MOE, "model_type": "deepseek_v3"}, "model_type 'deepseek_v3' is not supported"),
])
def test_moe_config_refusals(d: dict[str, Any], match: str) -> None:
    """What is not served is refused by name, with the supported architectures listed."""
    with pytest.raises(ModelLoadError, match=match) as e:
        config_from_hf_dict(d, "x/config.json")
    assert "supported architectures: llama, qwen2, qwen3, mistral, gemma3, mixtral, qwen3_moe" in str(e.value)


def test_moe_tp_problem() -> None:
    cfg = preset_config("tiny-qwen3-moe").replace(moe=MoeConfig(16, 4, 34))
    assert cfg.tp_problem(2) is None
    assert "must divide each expert's 34 features" in (cfg.tp_problem(4) or "")
    with pytest.raises(ConfigError, match="needs moe section"):
        preset_config("tiny-qwen3").replace(arch="mixtral")
    with pytest.raises(ConfigError, match="takes no moe section"):
        preset_config("tiny-qwen3").replace(moe=MoeConfig(4, 2, 8))


def test_fp8_of_an_moe_model_is_refused(tmp_path: Path) -> None:
    """fp8 experts are not served: --quantization fp8 and an FP8 checkpoint both say so before any weight."""
    with pytest.raises(ConfigError, match="--quantization fp8 is not supported for mixture-of-experts"):
        build_engine_config("preset:tiny-mixtral", device="cpu", quantization="fp8")
    cfg = hf_config_dict(preset_config("tiny-qwen3-moe"))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantization, match="fp8 weights of a mixture-of-experts model"):
        read_hf_config(str(tmp_path))


def test_gguf_moe_is_refused() -> None:
    """A Mixtral GGUF says architecture "llama" with an expert count: refused by name, not loaded as dense."""
    from rapidserve.loader.gguf_loader import config_from_gguf

    class Field:
        def __init__(self, v: object) -> None:
            self.v = v

        def contents(self) -> object:
            return self.v

    class Reader:
        fields = {"general.architecture": Field("llama"), "llama.expert_count": Field(8)}
        tensors: list[object] = []

    with pytest.raises(ModelLoadError, match=r"GGUF mixture-of-experts models \(llama with llama.expert_count=8\)"):
        config_from_gguf(Reader(), "m.gguf")


def test_tool_call_format_of_the_families() -> None:
    """Qwen3-MoE writes Qwen3's hermes tool calls; its template says so, and without one the family does."""
    from rapidserve.server.tools import resolve_parser

    assert resolve_parser("auto", None, "qwen3_moe") == "hermes"
    assert resolve_parser("auto", "{{ '<tool_call>' }}", "mixtral") == "hermes"  # the template wins


def test_expert_parallel_flag_is_refused_by_name() -> None:
    """vLLM's --enable-expert-parallel: refused, saying how experts are split instead."""
    from rapidserve.cli_vllm import _refusal

    msg = _refusal("rapidserve serve", "--enable-expert-parallel")
    assert "does not support vLLM's --enable-expert-parallel" in msg and "sliced over the tensor-parallel ranks" in msg
