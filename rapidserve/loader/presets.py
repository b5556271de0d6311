"""`preset:NAME`: real architecture shapes with deterministic random weights (for benchmarks and tests).

Every tensor is drawn from its own `torch.Generator`, seeded from a hash of the preset and tensor
names, so the weights are the same on every load and in any order, and generating them holds one
tensor at a time. Scales keep activations O(1) over many layers in bf16: q/k/v/gate/up ~
N(0, 1/fan_in), o/down additionally divided by 2*num_layers, norms 1 + small noise, small biases.

Tensor-parallel ranks (`shard_weights`, `rapidserve.loader.rank_weights`): each whole tensor is drawn
exactly as for one rank, on the preset device, then sliced (`shard_tensor`) and copied out, so rank r's
part of TP-N is bit-identical to the same slice of the TP-1 model. Memory: one whole tensor at a time
on the preset device (drawn in float32, then cast), plus its part; never the whole model. Each rank
pays the whole model's draw time.

`dummy:<folder>` (`--load-format dummy`, `load_dummy`) is the same machinery for any Hugging Face folder:
its config.json's shapes, random weights seeded from the model's name, its tokenizer if it has one; an FP8
checkpoint's folder gives its FP8 scheme, the random float weights quantized at load (static activation scales,
which only calibration gives, become dynamic per-tensor ones), and its kv_cache_scheme an fp8 KV cache with
uncalibrated scales (1.0).

`save_as_hf_folder` writes any ModelSource as a Hugging Face folder (config.json + safetensors) so
transformers' own implementation can load exactly the same weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from rapidserve.config import ModelConfig
from rapidserve.loader.hf import read_hf_config, tokenizer_of, write_safetensors
from rapidserve.loader.hf_arch import arch_config_json
from rapidserve.loader.kv_scales import declares_kv_cache
from rapidserve.loader.moe_hf import dense_twin, moe_hf_config_dict
from rapidserve.loader.preset_table import list_presets, preset_table
from rapidserve.loader.source import ModelLoadError, ModelSource, expected_tensor_shapes, load_hf_tokenizer
from rapidserve.parallel.shard import TPLayout, owned_shard, shard_tensor
from rapidserve.quant_config import QuantizationConfig

__all__ = ["hf_config_dict", "list_presets", "load_dummy", "load_preset", "preset_config", "preset_tensor",
           "random_source", "save_as_hf_folder"]


def preset_config(name: str) -> ModelConfig:
    presets = preset_table()
    if name not in presets:
        raise ModelLoadError(f"preset:{name}", f"unknown preset {name!r}")
    return presets[name]


def _seed(preset: str, tensor: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{preset}/{tensor}".encode()).digest()[:8], "little") >> 1


def preset_tensor(preset: str, config: ModelConfig, name: str, shape: tuple[int, ...],
                  device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One deterministic tensor of a preset (the same for the same name, shape, device and dtype)."""
    g = torch.Generator(device=device)
    g.manual_seed(_seed(preset, name))
    x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    if name.endswith("norm.weight"):  # Gemma 3's norms multiply by 1 + weight
        x = (0.0 if config.arch == "gemma3" else 1.0) + 0.05 * x
    elif name.endswith(".bias"):
        x = 0.05 * x
    elif name == "model.embed_tokens.weight":
        # Tied: the embedding is also the output layer, so keep logits around hidden**0.25.
        x = x * (config.hidden_size ** -0.25 if config.tie_word_embeddings else 1.0)
    else:
        std = 1.0 / math.sqrt(shape[1])
        if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):  # w2: a Mixtral expert's down
            std /= math.sqrt(2 * config.num_layers)
        x = x * std
    return x.to(dtype)


def load_preset(name: str, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> ModelSource:
    """A ModelSource with the preset's shapes and deterministic random weights (no tokenizer).

    Weights are generated lazily per tensor on `device` (a CUDA generator draws different numbers
    than the CPU one, but is just as deterministic) in `dtype`; `shard_weights(layout)` draws each
    whole tensor the same way and keeps only the rank's slice (see the module docstring).
    """
    config = preset_config(name)
    return random_source(name, config, device, dtype, description=f"preset {name}: {config.arch} shapes with "
                                                                  "random weights")


def load_dummy(folder: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> ModelSource:
    """`--load-format dummy` (`dummy:<folder>`): the architecture of a Hugging Face folder's config.json with
    deterministic random weights drawn as a preset's (none of its weight files is read, nor needed), and its
    tokenizer and chat template when it has them."""
    folder = os.path.abspath(os.path.expanduser(folder))
    if not os.path.isdir(folder):
        raise ModelLoadError(folder, "--load-format dummy needs a Hugging Face model folder (or Hub id) whose "
                                     "config.json gives the architecture; this is not a folder")
    config, d, quant = read_hf_config(folder)
    tokenizer_dir, chat_template = tokenizer_of(folder)
    if quant is not None:  # the checkpoint's FP8 scheme over random float weights, quantized at load
        quant = dataclasses.replace(quant, online=True, activations="tensor" if quant.activations == "static" else
                                    quant.activations, origin=f"{quant.origin}, random weights quantized at load "
                                                              "(--load-format dummy)")
    return random_source(f"dummy:{config.name}", config, device, dtype, tokenizer_dir, chat_template,
                         description=f"{config.arch} model {folder} with random weights (--load-format dummy)",
                         hf_folder=folder, quantization=quant, kv_cache_scheme=declares_kv_cache(d))


def random_source(key: str, config: ModelConfig, device: str | torch.device, dtype: torch.dtype,
                  tokenizer_dir: str | None = None, chat_template: str | None = None,
                  description: str = "", hf_folder: str | None = None,
                  quantization: QuantizationConfig | None = None, kv_cache_scheme: bool = False) -> ModelSource:
    """A ModelSource of `config`'s shapes whose every tensor is `preset_tensor(key, ...)` (see load_preset);
    `hf_folder`: the Hugging Face folder whose architecture it randomizes (its generation_config.json applies);
    `quantization`: the FP8 scheme (online) its float weights are quantized with at load; `kv_cache_scheme`: its
    folder declares an fp8 KV cache (whose scales, random weights being uncalibrated, are 1.0)."""
    shapes = expected_tensor_shapes(config)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor, shape in shapes.items():
            yield tensor, preset_tensor(key, config, tensor, shape, device=device, dtype=dtype)

    def shard_weights(lay: TPLayout) -> Iterator[tuple[str, torch.Tensor]]:
        for tensor, whole in weights():
            yield tensor, owned_shard(shard_tensor(tensor, whole, lay), whole)

    return ModelSource(
        config=config, weights=weights, shard_weights=shard_weights, num_tensors=len(shapes),
        tokenizer_dir=tokenizer_dir, tokenizer_file=None, chat_template=chat_template,
        description=f"{description} ({config.num_params() / 1e9:.2f}B params)", hf_folder=hf_folder,
        quantization=quantization, kv_cache_scheme=kv_cache_scheme,
    )


def hf_config_dict(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A transformers-compatible config.json (LlamaConfig / Qwen2Config / Qwen3Config fields; MistralConfig's and
    Gemma3TextConfig's: hf_arch.arch_config_json).

    RoPE is written both the transformers 4 way (rope_theta, rope_scaling) and the transformers 5
    way (rope_parameters); each version reads its own keys. Mixture-of-experts models (MixtralConfig /
    Qwen3MoeConfig): their dense family's dict with the experts' fields, `moe_hf.moe_hf_config_dict`.
    """
    if config.moe is not None:
        return moe_hf_config_dict(config, hf_config_dict(dense_twin(config), dtype))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "linear":
        rope = {"rope_type": "linear", "rope_theta": config.rope_theta, "factor": config.rope_scaling.factor}
    elif config.rope_scaling is not None:
        rs = config.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings}
    eos: Any = list(config.eos_token_ids) if len(config.eos_token_ids) > 1 else (
        config.eos_token_ids[0] if config.eos_token_ids else None)
    d: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}.get(config.arch)],  # the others': arch_config_json
        "model_type": config.arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if config.arch != "qwen2":
        d["attention_bias"] = config.attention_bias
    if config.arch in ("qwen2", "qwen3"):
        d["use_sliding_window"] = config.sliding_window is not None
        d["sliding_window"] = config.sliding_window
        d["max_window_layers"] = config.num_layers
        if config.layer_types:
            d["layer_types"] = list(config.layer_types)
    return arch_config_json(config, d)


def save_as_hf_folder(source: ModelSource, path: str | os.PathLike[str],
                      max_shard_bytes: int | None = None, dtype: torch.dtype = torch.float32) -> None:
    """Write `source` as a Hugging Face model folder: config.json plus model.safetensors, or shards
    of at most `max_shard_bytes` (one tensor larger than that gets a shard of its own) with
    model.safetensors.index.json. Tensors are cast to `dtype` and streamed (one at a time).
    The tokenizer is saved too when the source has one."""
    out = os.fspath(path)
    os.makedirs(out, exist_ok=True)
    config = source.config
    shapes = expected_tensor_shapes(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    stream = ((n, t.to(dtype)) for n, t in source.weights() if n in shapes)
    for file, names in zip(files, shards, strict=True):
        specs = {n: (dtype, shapes[n]) for n in names}
        write_safetensors(os.path.join(out, file), specs, (next(stream) for _ in names))
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(math.prod(s) for s in shapes.values()) * itemsize},
                 "weight_map": {n: f for f, names in zip(files, shards, strict=True) for n in names}}
        with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config_dict(config, dtype), f, indent=2)
    if source.tokenizer_dir is not None:
        tok = load_hf_tokenizer(source)
        if tok is not None:
            tok.save_pretrained(out)
