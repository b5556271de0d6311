"""The lowest layer of the loader: what a resolved model is (`ModelSource`), its errors and checks.

`ModelSource` (architecture, lazy weight stream, where the tokenizer lives), `ModelLoadError`, the
tensor names and shapes a `ModelConfig` needs, `rank_weights` (one tensor-parallel rank's weight
stream) and `load_hf_tokenizer` (the transformers tokenizer of a source). The format readers (hf.py,
gguf_loader.py, presets.py), `rapidserve.loader.resolve_model` and `rapidserve.tokenizer` build on it;
it imports nothing from rapidserve but the config (with `moe_config`'s tensor names), the preset table and
`parallel.shard` (the pure sharding plan, which imports nothing of the loader).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rapidserve.config import ARCHES, ModelConfig
from rapidserve.loader.preset_table import list_presets
from rapidserve.moe_config import moe_tensor_shapes
from rapidserve.parallel.shard import ShardError, TPLayout, shard_shape, sharded_weights, tp_layout
from rapidserve.quant_config import KVScales, QuantizationConfig


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
    """A resolved model. `weights()` starts a fresh stream of `(hf_name, tensor)` pairs each call.

    `shard_weights(layout)`, when set, starts a fresh stream of tensor-parallel rank `layout.rank`'s
    parts instead, read or made one tensor at a time without the whole model: the same names in the
    same order as `weights()`, each tensor bit-identical to `parallel.shard.shard_tensor(name, whole,
    layout)` and owning its memory (contiguous, no view into a whole tensor). None: the source cannot
    read parts, and `rank_weights` slices `weights()`. Whoever replaces `weights` (dataclasses.replace)
    must replace or clear `shard_weights` too. Use `rank_weights`, not these fields, to load a rank.
    """

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
    shard_weights: Callable[[TPLayout], Iterator[tuple[str, torch.Tensor]]] | None = None
    # A Hugging Face model folder's path (where its generation_config.json may be; `dummy:<folder>` keeps its
    # folder), None: GGUF files, presets.
    hf_folder: str | None = None
    # The FP8 scheme the weights come in (an FP8 checkpoint: its weights, scales and input scales are in the
    # stream; `online`, a dummy of one: float weights quantized at load), None: float weights.
    quantization: QuantizationConfig | None = None
    # The fp8 KV cache (loader/kv_scales.py): whether the checkpoint's config declares one (a kv_cache_scheme:
    # `--kv-cache-dtype auto` then stores fp8), and its calibrated per-layer scales when its tensors carry them
    # (read when the source is resolved; never in the weight stream).
    kv_cache_scheme: bool = False
    kv_scales: KVScales | None = None


def rank_weights(source: ModelSource, layout: TPLayout,
                 device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensor-parallel rank `layout.rank`'s weights: `(hf_name, part)` in load order, each part
    `shard_tensor(name, whole, layout)` bit for bit, contiguous, moved to `device` (None: where the
    loader made it) as it goes.

    Through `source.shard_weights` when the loader has it (HF folders and the GGUF cache read only the
    rank's rows/columns; presets make one whole tensor at a time), else `sharded_weights` over
    `source.weights()` (one whole tensor at a time on the loader's side). Either way no process holds
    the whole model. ShardError at once when `layout` is not this model's (made for another config),
    and for a part whose shape is not the layout's (a loader that broke its contract).
    """
    config = source.config
    want_layout = tp_layout(config, layout.tp, layout.rank)  # ShardError naming the size that does not fit
    if layout != want_layout:
        raise ShardError(f"tensor-parallel layout {layout} was not made for model {config.name} "
                         f"(its layout for rank {layout.rank} of {layout.tp} is {want_layout})")
    return _checked(source, layout, device)


def _checked(source: ModelSource, layout: TPLayout,
             device: torch.device | str | None) -> Iterator[tuple[str, torch.Tensor]]:
    shapes = expected_tensor_shapes(source.config)
    if source.shard_weights is None:
        block = source.quantization.block if source.quantization is not None else None
        parts = sharded_weights(source.weights(), layout, device, block)
    else:
        parts = ((n, t.contiguous() if device is None else t.to(device).contiguous())
                 for n, t in source.shard_weights(layout))
    for name, part in parts:
        if name in shapes and tuple(part.shape) != shard_shape(name, shapes[name], layout):
            raise ShardError(f"tensor {name}: rank {layout.rank} of {layout.tp} got shape {list(part.shape)}, "
                             f"the layout needs {list(shard_shape(name, shapes[name], layout))}")
        yield name, part


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
        if config.moe is not None and config.moe.sparse(n):
            shapes.update(moe_tensor_shapes(config.arch, config.moe, h, n))
        else:
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.arch == "gemma3":  # norms before and after the MLP too
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def check_tensor_shapes(found: dict[str, tuple[int, ...]], config: ModelConfig, path: str,
                        files: Mapping[str, str] | None = None) -> None:
    """Raise ModelLoadError naming the first missing or wrong-shape tensor (and, for a wrong shape,
    the file `files` says holds it; else `path`)."""
    for name, shape in expected_tensor_shapes(config).items():
        if name not in found:
            raise ModelLoadError(path, f"tensor {name} is missing (the config needs it)")
        if tuple(found[name]) != shape:
            raise ModelLoadError(
                (files or {}).get(name, path),
                f"tensor {name} has shape {list(found[name])}, the config needs {list(shape)}")


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
