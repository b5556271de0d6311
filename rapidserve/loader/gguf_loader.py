"""GGUF files (llama, qwen2, qwen3): metadata -> ModelConfig, tensors dequantized to float32.

The first load converts the file into `<cache_dir>/gguf/<key>/` (a float32 model.safetensors, the
tokenizer saved with `save_pretrained`, and meta.json), keyed by a hash of the GGUF's absolute path,
size and mtime. The folder is built under a temporary name and renamed into place, so a killed
conversion never leaves a half-written cache; a cache that fails to read back is rebuilt.
Later loads read only meta.json and the safetensors header, then stream from the cache.

Tensor-parallel ranks (`shard_weights`, `rapidserve.loader.rank_weights`): the conversion dequantises
each (possibly quantised) tensor whole, on the CPU, one at a time, once per file (the ranks of a group
resolve the same path and wait on the same lock); every rank then reads only its rows or columns of
the float32 cache through `hf.stream_safetensors_shard`, as for a Hugging Face folder. So no process
holds more than one whole dequantised tensor, and a rank's memory is its shard.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from rapidserve.config import ModelConfig, RopeScaling
from rapidserve.config_base import ConfigError
from rapidserve.loader.hf import (
    read_safetensors_headers,
    stream_safetensors,
    stream_safetensors_shard,
    write_safetensors,
)
from rapidserve.loader.source import ModelLoadError, ModelSource, check_tensor_shapes, expected_tensor_shapes

log = logging.getLogger("rapidserve.loader")
GGUF_ARCHES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
CACHE_VERSION = 1
_LAYER_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
}


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/rapidserve, or ~/.cache/rapidserve."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rapidserve")


def cache_key(path: str) -> str:
    """Hash of the GGUF's absolute path, size and modification time (and the cache format)."""
    st = os.stat(path)
    ident = f"{CACHE_VERSION}\0{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if not a model tensor."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for llama (it interleaves each head's two rotary halves).

    llama.cpp row (head, d, half) holds HF row (head, half, d): swap the two axes back.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _llama3_factors(inv_freq: np.ndarray, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """Per-frequency divisors of llama3 RoPE scaling, as llama.cpp's converter computes them."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _llama3_scaling(factors: np.ndarray, theta: float, rot_dim: int, reader: Any, arch: str,
                    path: str) -> RopeScaling | None:
    """Recover llama3 RoPE scaling from the `rope_freqs` tensor llama.cpp stores for Llama 3.1+.

    The converter writes only the divisors, so the factor is their maximum and the original context
    length is solved from the divisors in the transition band (low/high freq factors 1 and 4, as in
    every Llama 3.x); the result is accepted only if it reproduces the stored tensor.
    """
    inv = 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    if factors.shape != inv.shape:
        raise ModelLoadError(path, f"rope_freqs has {factors.size} entries, expected {inv.size}")
    meta_factor = _field(reader, f"{arch}.rope.scaling.factor")
    factor = float(meta_factor or factors.max())
    if factor <= 1.0 and np.allclose(factors, 1.0):
        return None
    low, high = 1.0, 4.0
    candidates: list[int] = []
    meta_orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if meta_orig:
        candidates.append(int(meta_orig))
    band = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    s = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
    candidates += [int(round(x)) for x in (2 * math.pi / inv[band]) * (s * (high - low) + low)]
    candidates += [2 ** k for k in range(6, 22)]
    for orig in candidates:
        if orig > 0 and np.allclose(factors, _llama3_factors(inv, factor, low, high, orig), rtol=1e-4):
            return RopeScaling(factor=factor, low_freq_factor=low, high_freq_factor=high,
                               original_max_position_embeddings=orig)
    raise ModelLoadError(path, "rope_freqs tensor does not match llama3 RoPE scaling "
                               "(only llama3 scaling is supported)")


def config_from_gguf(reader: Any, path: str) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata and tensor shapes."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHES:
        raise ModelLoadError(path, f"GGUF architecture {arch!r} is not supported")
    tensors = {t.name: t for t in reader.tensors}
    if int(_field(reader, f"{arch}.expert_count") or 0) > 0:  # a Mixtral GGUF says "llama" with experts
        raise ModelLoadError(path, f"GGUF mixture-of-experts models ({arch} with {arch}.expert_count="
                                   f"{_field(reader, f'{arch}.expert_count')}) are not supported; use the model's "
                                   "Hugging Face safetensors folder (mixtral and qwen3_moe are served from those)")

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(path, f"GGUF metadata {arch}.{key} is missing")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length") or hidden // heads)
    rot_dim = int(_field(reader, f"{arch}.rope.dimension_count") or head_dim)
    if rot_dim != head_dim:
        raise ModelLoadError(path, f"partial rotary embedding ({rot_dim} of {head_dim}) is not supported")
    theta = float(_field(reader, f"{arch}.rope.freq_base") or 10000.0)
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ModelLoadError(path, f"GGUF rope scaling type {scaling_type!r} is not supported")
    scaling = None
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
        scaling = _llama3_scaling(factors, theta, rot_dim, reader, arch, path)
    if "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    else:
        toks = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(toks.data) if toks is not None else int(need("vocab_size"))
    eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    try:
        return ModelConfig(
            arch=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(_field(reader, f"{arch}.context_length") or 4096),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
            qk_norm=arch == "qwen3",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos),
            name=str(_field(reader, "general.name") or os.path.basename(path)),
        )
    except (TypeError, ValueError, ConfigError) as e:
        raise ModelLoadError(path, f"invalid GGUF metadata: {e}") from e


def _open_reader(path: str) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/... on truncated or foreign files
        raise ModelLoadError(path, f"truncated or corrupt GGUF file ({type(e).__name__}: {e})") from e


def _dequantized(reader: Any, config: ModelConfig, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize, reshape to HF layout and un-permute, one tensor at a time, in load order."""
    from gguf.quants import dequantize

    by_hf = {hf_tensor_name(t.name): t for t in reader.tensors}
    shapes = expected_tensor_shapes(config)
    for name, shape in tqdm(shapes.items(), desc=f"Converting {os.path.basename(path)}", unit="tensor"):
        t = by_hf[name]
        try:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except Exception as e:  # a short or malformed data block surfaces here as numpy errors
            raise ModelLoadError(path, f"cannot dequantize tensor {t.name}: {e}") from e
        if config.arch == "llama" and ".self_attn.q_proj." in name:
            arr = unpermute_qk(arr, config.num_heads)
        elif config.arch == "llama" and ".self_attn.k_proj." in name:
            arr = unpermute_qk(arr, config.num_kv_heads)
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))  # owned, writable


def _save_tokenizer(path: str, out: str) -> bool:
    """Save the GGUF's tokenizer as a regular tokenizer folder; False if it cannot be built."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        tok.save_pretrained(out)
        return True
    except Exception:  # a tokenizer that transformers cannot build just stays in the GGUF
        shutil.rmtree(out, ignore_errors=True)
        return False


def _config_to_json(config: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _config_from_json(d: dict[str, Any]) -> ModelConfig:
    d = dict(d)
    d["rope_scaling"] = RopeScaling(**d["rope_scaling"]) if d.get("rope_scaling") else None
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    d["layer_types"] = tuple(d.get("layer_types") or ())
    return ModelConfig(**d)


def _read_cache(folder: str, path: str) -> ModelSource | None:
    """The cached conversion, or None if it is absent or does not read back cleanly."""
    meta_path = os.path.join(folder, "meta.json")
    weights_path = os.path.join(folder, "model.safetensors")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("version") != CACHE_VERSION:
            return None
        config = _config_from_json(meta["config"])
        found = read_safetensors_headers([weights_path])
        check_tensor_shapes({n: s for n, (_, s) in found.items()}, config, weights_path)
    except (OSError, ValueError, KeyError, TypeError, ModelLoadError):
        return None
    shapes = expected_tensor_shapes(config)
    names = {name: weights_path for name in shapes}
    tok_dir = os.path.join(folder, "tokenizer")
    has_tok = bool(meta.get("has_tokenizer"))
    cached_tok = tok_dir if os.path.isfile(os.path.join(tok_dir, "tokenizer_config.json")) else None
    return ModelSource(
        config=config,
        weights=lambda: stream_safetensors(names),
        shard_weights=lambda lay: stream_safetensors_shard(names, shapes, lay),
        num_tensors=len(names),
        tokenizer_dir=os.path.dirname(path) if has_tok else None,
        tokenizer_file=os.path.basename(path) if has_tok else None,
        chat_template=meta.get("chat_template"),
        description=str(meta.get("description", path)),
        tokenizer_cache_dir=cached_tok if has_tok else None,
    )


def _convert(path: str, root: str, key: str) -> None:
    """Convert the GGUF into `<root>/<key>/`, built under a temporary name and renamed into place."""
    reader = _open_reader(path)
    config = config_from_gguf(reader, path)
    found: dict[str, tuple[int, ...]] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is not None:
            found[name] = tuple(int(n) for n in reversed(t.shape.tolist()))
    check_tensor_shapes(found, config, path)
    has_tok = reader.fields.get("tokenizer.ggml.tokens") is not None
    template = _field(reader, "tokenizer.chat_template")
    quant = sorted({t.tensor_type.name for t in reader.tensors})
    tmp = tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root)
    try:
        specs = {n: (torch.float32, s) for n, s in expected_tensor_shapes(config).items()}
        write_safetensors(os.path.join(tmp, "model.safetensors"), specs, _dequantized(reader, config, path))
        tok_saved = has_tok and _save_tokenizer(path, os.path.join(tmp, "tokenizer"))
        meta = {
            "version": CACHE_VERSION, "gguf_path": os.path.abspath(path),
            "config": _config_to_json(config),
            "chat_template": template if isinstance(template, str) else None,
            "has_tokenizer": has_tok, "tokenizer_saved": tok_saved,
            "description": f"{config.arch} GGUF {path} ({config.name}; {'/'.join(quant)} dequantized to "
                           f"float32; {config.num_params() / 1e9:.2f}B params)",
        }
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        os.chmod(tmp, 0o755)
        final = os.path.join(root, key)
        if os.path.exists(final):  # a broken cache (a valid one would not have been rebuilt)
            shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(path: str, cache_dir: str | None = None) -> ModelSource:
    """Resolve a GGUF file, converting it into the cache on first use."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(path, "no such GGUF file")
    root = os.path.join(cache_dir or default_cache_dir(), "gguf")
    key = cache_key(path)
    source = _read_cache(os.path.join(root, key), path)
    if source is not None:
        return source
    os.makedirs(root, exist_ok=True)
    # Processes starting together (prefill and decode workers) convert once: the others wait here.
    with open(os.path.join(root, f"{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        source = _read_cache(os.path.join(root, key), path)
        if source is None:
            why = ("a cache there does not read back" if os.path.exists(os.path.join(root, key)) else
                   "first start with this file: no conversion of its path, size and modification time is cached")
            log.info("converting GGUF %s to float32 safetensors in %s (%s; later starts read the cache)",
                     path, os.path.join(root, key), why)
            t0 = time.monotonic()
            _convert(path, root, key)
            log.info("converted GGUF %s in %.1f s", os.path.basename(path), time.monotonic() - t0)
            source = _read_cache(os.path.join(root, key), path)
    if source is None:
        raise ModelLoadError(path, f"the converted cache in {os.path.join(root, key)} does not read back")
    return source
