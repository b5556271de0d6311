"""The lowest layer of the loader: what a resolved model is (`ModelSource`), its errors and checks.

`ModelSource` (architecture, lazy weight stream, where the tokenizer lives), `ModelLoadError`, the
tensor names and shapes a `ModelConfig` needs, and `load_hf_tokenizer` (the transformers tokenizer of
a source). The format readers (hf.py, gguf_loader.py, presets.py), `rapidserve.loader.resolve_model`
and `rapidserve.tokenizer` build on it; it imports nothing from rapidserve but the config and the
preset table.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rapidserve.config import ARCHES, ModelConfig
from rapidserve.loader.preset_table import list_presets


def supported_forms() -> str:
    """One line listing the model specs and architectures this loader understands."""
    return (
        "supported model specs: 'default' (the embedded SmolLM2-135M-Instruct GGUF), "
        f"'preset:NAME' with NAME one of {', '.join(list_presets())}, "
        "a path to a .gguf file, or a path to a Hugging Face model folder "
        "(config.json + model.safetensors or a sharded model.safetensors.index.json); "
        f"supported architectures: {', '.join(ARCHES)}"
    )


class ModelLoadError(Exception):
    """A model could not be loaded. The message names the path and lists what is supported."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"cannot load model {path!r}: {problem}\n{supported_forms()}")

    def __reduce__(self) -> tuple[type[ModelLoadError], tuple[str, str]]:
        return (ModelLoadError, (self.path, self.problem))


@dataclass(frozen=True)
class ModelSource:
    """A resolved model. `weights()` starts a fresh stream of `(hf_name, tensor)` pairs each call."""

    config: ModelConfig
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    num_tensors: int
    tokenizer_dir: str | None
    tokenizer_file: str | None
    chat_template: str | None
    description: str
    # A folder with the same tokenizer saved by `save_pretrained` (written next to a GGUF's
    # conversion cache): it loads in a fraction of a second, where parsing the GGUF takes several.
    tokenizer_cache_dir: str | None = None


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, in load order, with its Hugging Face name and shape."""
    h, i, v, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def check_tensor_shapes(found: dict[str, tuple[int, ...]], config: ModelConfig, path: str) -> None:
    """Raise ModelLoadError naming the first missing or wrong-shape tensor."""
    for name, shape in expected_tensor_shapes(config).items():
        if name not in found:
            raise ModelLoadError(path, f"tensor {name} is missing (the config needs it)")
        if tuple(found[name]) != shape:
            raise ModelLoadError(
                path, f"tensor {name} has shape {list(found[name])}, the config needs {list(shape)}")


def load_hf_tokenizer(source: ModelSource) -> Any | None:
    """The source's transformers tokenizer, or None when it has none (presets).

    Loaded from `tokenizer_cache_dir` when that folder exists and loads, else from the original
    files (`tokenizer_dir`, with `tokenizer_file` when it is a GGUF file).
    """
    if source.tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer

    tok = None
    if source.tokenizer_cache_dir is not None and os.path.isdir(source.tokenizer_cache_dir):
        try:
            tok = AutoTokenizer.from_pretrained(source.tokenizer_cache_dir)
        except (OSError, ValueError):
            tok = None  # fall back to the original files below
    if tok is None:
        kwargs = {"gguf_file": source.tokenizer_file} if source.tokenizer_file else {}
        tok = AutoTokenizer.from_pretrained(source.tokenizer_dir, **kwargs)
    return tok
