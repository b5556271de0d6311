"""Hugging Face model folders: config.json -> ModelConfig, safetensors (single or sharded) -> tensors.

The model types of `hf_arch.MODEL_TYPES` are read (what is architecture-specific: hf_arch.py, e.g. Gemma 3's config
and a multimodal checkpoint's text weights, which are read under their own names and handed on under ours).

Only config.json, the quantization side files, the safetensors headers and the fp8 KV cache's scale tensors (two
numbers a layer, `kv_scales.py`) are read when the folder is resolved (to refuse a quantized checkpoint by name,
`quant.py`, or read an FP8 one's scheme, `fp8_checkpoint.py`; then to check every tensor the config and the scheme
need is there with the right shape and dtype); `weights()` then streams one tensor at a time through `safe_open`,
and `shard_weights(layout)` one tensor-parallel rank's parts through `get_slice`, which reads only the rank's rows
or columns (`parallel.shard.shard_bounds`; an FP8 checkpoint's block scales by its blocks) from the memory-mapped
file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from rapidserve.config import ModelConfig, RopeScaling
from rapidserve.config_base import ConfigError
from rapidserve.loader.fp8_checkpoint import check_fp8_tensors, checkpoint_quantization, declared_quantization
from rapidserve.loader.hf_arch import gemma3_config, model_type_problem, rope_scaling, sliding_fields, text_weights
from rapidserve.loader.hf_arch import token_ids as _token_ids
from rapidserve.loader.hub import display_name
from rapidserve.loader.kv_scales import check_kv_scale_tensors, declares_kv_cache, read_kv_scales
from rapidserve.loader.moe_hf import moe_config_from_hf
from rapidserve.loader.quant import refuse_quantized_tensors
from rapidserve.loader.source import ModelLoadError, ModelSource, check_tensor_shapes, expected_tensor_shapes
from rapidserve.moe_config import MOE_ARCHES
from rapidserve.parallel.shard import Block, TPLayout, pad_vocab, shard_bounds, shard_kind
from rapidserve.quant_config import QuantizationConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def _rope(d: dict[str, Any], path: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and llama3 / linear scaling from either transformers 4 (`rope_theta` + `rope_scaling`) or
    transformers 5 (`rope_parameters`, possibly keyed by layer type) configs."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))
    scaling = params if isinstance(params, dict) else d.get("rope_scaling")
    theta = d.get("rope_theta")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    theta = float(theta if theta is not None else 10000.0)
    return theta, rope_scaling(scaling, path)


def config_from_hf_dict(d: dict[str, Any], path: str, name: str = "model") -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (the model types of hf_arch.MODEL_TYPES; mixtral, qwen3_moe:
    `moe_hf.py`)."""
    arch = d.get("model_type")
    problem = model_type_problem(arch)
    if problem is not None:
        raise ModelLoadError(path, problem)
    if arch in MOE_ARCHES:
        return moe_config_from_hf(d, path, lambda dense: config_from_hf_dict(dense, path, name))
    if arch in ("gemma3", "gemma3_text"):
        return gemma3_config(d, path, name)
    if d.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(path, f"hidden_act {d.get('hidden_act')!r} is not supported (only silu)")
    if d.get("mlp_bias"):
        raise ModelLoadError(path, "mlp_bias=true is not supported")
    try:
        hidden, heads, layers = int(d["hidden_size"]), int(d["num_attention_heads"]), int(d["num_hidden_layers"])
        theta, scaling = _rope(d, path)
        eos = _token_ids(d.get("eos_token_id"))
        return ModelConfig(
            arch=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id") if isinstance(d.get("bos_token_id"), int) else None,
            eos_token_ids=eos,
            name=name,
            **sliding_fields(d, arch, layers),
        )
    except KeyError as e:
        raise ModelLoadError(path, f"config field {e.args[0]!r} is missing") from e
    except (TypeError, ValueError, ConfigError) as e:
        raise ModelLoadError(path, f"invalid config: {e}") from e


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(path, f"cannot read JSON: {e}") from e


def _chat_template(folder: str) -> str | None:
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    cfg = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(cfg):
        return None
    template = _read_json(cfg).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _weight_files(folder: str) -> list[str]:
    """The safetensors files of a folder, checking that every shard an index names exists."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(index, "the index has no weight_map")
        files = sorted(set(weight_map.values()))
        for f in files:
            if not os.path.isfile(os.path.join(folder, f)):
                raise ModelLoadError(os.path.join(folder, f), f"shard {f} listed in {INDEX_FILE} is missing")
        return [os.path.join(folder, f) for f in files]
    if os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        return [os.path.join(folder, SINGLE_FILE)]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if files:
        return [os.path.join(folder, f) for f in files]
    others = [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth"))]
    hint = f" (found {', '.join(sorted(others))}: only safetensors weights are supported)" if others else ""
    raise ModelLoadError(folder, f"no {SINGLE_FILE} or {INDEX_FILE} in the folder{hint}")


def read_safetensors_index(files: Iterable[str]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (file, shape, safetensors dtype such as "BF16" or "F8_E4M3") over all files, from the headers
    alone; a truncated or corrupt file raises naming it."""
    found: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    view = f.get_slice(name)
                    found[name] = (file, tuple(view.get_shape()), str(view.get_dtype()))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(file, f"truncated or corrupt safetensors file: {e}") from e
    return found


def read_safetensors_headers(files: Iterable[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (file, shape) over all files; a truncated or corrupt file raises naming it."""
    return {name: (file, shape) for name, (file, shape, _) in read_safetensors_index(files).items()}


class _Renamed:
    """A safe_open handle that reads tensor `stored[name]` for `name` (hf_arch.text_weights)."""

    def __init__(self, handle: Any, stored: Mapping[str, str]) -> None:
        self.handle, self.stored = handle, stored

    def get_slice(self, name: str) -> Any:
        return self.handle.get_slice(self.stored.get(name, name))

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.handle.get_tensor(self.stored.get(name, name))


def _read_each(names: dict[str, str], read: Callable[[Any, str, str], torch.Tensor],
               stored: Mapping[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`read(handle, name, file)` for each name (name -> file) in order, each file opened once and
    memory-mapped; an unreadable tensor is a ModelLoadError naming the file. `stored`: name -> the name the file
    holds it under, where they differ (a multimodal checkpoint's text model)."""
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        for name, file in names.items():
            try:
                if file not in handles:
                    handle = stack.enter_context(safe_open(file, framework="pt"))
                    handles[file] = handle if stored is None else _Renamed(handle, stored)
                tensor = read(handles[file], name, file)
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(file, f"cannot read tensor {name}: {e}") from e
            yield name, tensor


def stream_safetensors(names: dict[str, str],
                       stored: Mapping[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `name -> tensor` for names (name -> file) in the given order, one tensor at a time
    (each file is opened once and memory-mapped; `stored` as `_read_each`'s)."""
    return _read_each(names, lambda handle, name, file: handle.get_tensor(name), stored)


def stream_safetensors_shard(names: dict[str, str], shapes: dict[str, tuple[int, ...]], lay: TPLayout,
                             block: Block | None = None,
                             stored: Mapping[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensor-parallel rank `lay.rank`'s part of each tensor of `names` (name -> file), in order.

    Invariants: each part equals `shard_tensor(name, whole, lay)` bit for bit (the vocabulary's padding
    rows as zeros on the last ranks, a replicated KV head read by each of its ranks); a sharded tensor
    is read with `get_slice(name)[range]`, so only its `shard_bounds` range is copied out of the
    memory-mapped file (a column range of a row-parallel weight touches, per row, only the pages of
    that range; the kernel's readahead may still pull more into the page cache, never into the
    process's own memory), and a replicated one whole (`block`: an FP8 checkpoint's weight blocks, by
    which its block scales split); every part is a contiguous copy owning its memory (not a view of the
    mapping). A
    tensor whose shape on disk is not `shapes[name]` (the config's) raises ModelLoadError naming the
    file and tensor, as does an unreadable one.
    """
    def read(handle: Any, name: str, file: str) -> torch.Tensor:
        view = handle.get_slice(name)
        shape = tuple(view.get_shape())
        if shape != shapes[name]:
            raise ModelLoadError(file, f"tensor {name} has shape {list(shape)}, the config needs "
                                       f"{list(shapes[name])}")
        bounds = shard_bounds(name, shape, lay, block)
        if bounds is None:
            return handle.get_tensor(name)
        dim, start, stop = bounds
        part = view[start:stop] if dim == 0 else view[:, start:stop]
        part = part.clone(memory_format=torch.contiguous_format)
        return pad_vocab(part, lay.vocab) if shard_kind(name) == "vocab" else part

    return _read_each(names, read, stored)


def read_hf_config(folder: str) -> tuple[ModelConfig, dict[str, Any], QuantizationConfig | None]:
    """The ModelConfig of a Hugging Face folder's config.json, the parsed file and its FP8 scheme (None: float
    weights); no weights are read. A checkpoint that declares any other quantization method (config.json or a
    side file), or an FP8 form that is not served, is refused here, so both its real load and `--load-format
    dummy` of it (random weights, quantized at load with an FP8 checkpoint's scheme) say so."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(folder, "the folder has no config.json")
    d = _read_json(cfg_path)
    if not isinstance(d, dict):
        raise ModelLoadError(cfg_path, "config.json is not a JSON object")
    declared = declared_quantization(d, folder)  # another method's weights would load wrong without a word
    config = config_from_hf_dict(d, cfg_path, name=display_name(folder) or "model")
    return config, d, checkpoint_quantization(declared, folder, config)


def tokenizer_of(folder: str) -> tuple[str | None, str | None]:
    """(the folder, if it holds tokenizer files; its chat template, if any)."""
    has_tokenizer = any(os.path.isfile(os.path.join(folder, f)) for f in _TOKENIZER_FILES)
    return (folder if has_tokenizer else None), _chat_template(folder)


def load_hf_folder(folder: str) -> ModelSource:
    """Resolve a Hugging Face model folder (config.json + safetensors weights)."""
    folder = os.path.abspath(folder)
    config, d, quant = read_hf_config(folder)
    found = read_safetensors_index(_weight_files(folder))
    stored = text_weights(found, d.get("model_type"), folder)  # a multimodal checkpoint's text model: ours -> its
    if stored is not None:
        found = {ours: found[theirs] for ours, theirs in stored.items()}
    declared = declares_kv_cache(d)
    kv = check_kv_scale_tensors(found, config, declared, folder)  # the fp8 KV cache's scales: split out, read now
    kv_scales = read_kv_scales(kv, {n: found[n][0] for n in kv}, config.num_layers, folder, stored) if kv else None
    found = {n: f for n, f in found.items() if n not in kv}
    if quant is None:
        shapes = expected_tensor_shapes(config)
        refuse_quantized_tensors({n: t for n, (_, _, t) in found.items()}, frozenset(shapes), folder)
        check_tensor_shapes({n: s for n, (_, s, _) in found.items()}, config, folder,
                            files={n: f for n, (f, _, _) in found.items()})
    else:
        shapes = check_fp8_tensors(found, config, quant, folder)
    needed = {name: found[name][0] for name in shapes}
    block = quant.block if quant is not None else None
    tokenizer_dir, chat_template = tokenizer_of(folder)
    dtype = d.get("dtype") or d.get("torch_dtype") or "unknown dtype"
    return ModelSource(
        config=config,
        weights=lambda: stream_safetensors(needed, stored),
        shard_weights=lambda lay: stream_safetensors_shard(needed, shapes, lay, block, stored),
        num_tensors=len(needed),
        tokenizer_dir=tokenizer_dir,
        tokenizer_file=None,
        chat_template=chat_template,
        hf_folder=folder,
        description=f"{config.arch} model folder {folder} ({len(set(needed.values()))} safetensors "
                    f"file(s), {dtype}{', fp8' if quant is not None else ''}"
                    f"{', fp8 KV cache scales' if kv_scales is not None else ''}, {config.num_params() / 1e9:.2f}B "
                    "params)",
        quantization=quant,
        kv_cache_scheme=declared,
        kv_scales=kv_scales,
    )


def write_safetensors(path: str, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                      tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write a safetensors file one tensor at a time (memory stays at one tensor), atomically.

    `specs` fixes the header (name -> dtype, shape) up front; `tensors` must then yield exactly
    those tensors in the same order.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in specs.items():
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            order = iter(specs.items())
            for name, t in tensors:
                want, (dtype, shape) = next(order, (None, (None, None)))
                if name != want or t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise ValueError(f"tensor {name} {t.dtype} {list(t.shape)} does not match the "
                                     f"header entry {want} {dtype} {shape}")
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            if next(order, None) is not None:
                raise ValueError(f"the tensor stream ended before every tensor of {path} was written")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
