"""Tensor-parallel sharded loading (issue 17) on CPU: `rapidserve.loader.rank_weights` for every format.

For presets, HF folders (one file, and a sharded index; float32 and bfloat16) and GGUF files (float32 with
Q8_0 MLP weights, Q/K permuted for llama), at every tp in {1, 2, 4} the tiny model allows: each rank's
stream has the whole stream's names in order, each part is `shard_tensor(name, whole, layout)` bit for bit,
contiguous and owning its memory, and the ranks reassemble to the whole model. Vocabularies no tp divides
put zero padding rows on the last ranks (vocab 5 at tp 4: the last rank holds padding only). HF folders are
read through `get_slice` with exactly the rank's range; a wrong shape on disk names the file and tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rapidserve.config import ModelConfig
from rapidserve.loader import ModelLoadError, ModelSource, hf, presets, rank_weights, resolve_model
from rapidserve.loader.presets import load_preset, preset_config, save_as_hf_folder
from rapidserve.parallel.shard import (
    ShardError,
    TPLayout,
    rank_tensor_shapes,
    shard_bounds,
    shard_kind,
    shard_tensor,
    tp_layout,
)

# test preset -> (tiny preset, overrides): GQA replication at tp 4, tied embeddings, biases, q/k norms,
# and vocabularies that leave 1, 3 and (vocab 5 at tp 4: ranks of 2 rows) 3 padding rows.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "shard-llama": ("tiny-llama", {}),
    "shard-llama-tied": ("tiny-llama-tied", {}),
    "shard-qwen2-pad": ("tiny-qwen2", {"vocab_size": 1199}),
    "shard-qwen3-pad": ("tiny-qwen3", {"vocab_size": 1501}),
    "shard-qwen3-vocab5": ("tiny-qwen3", {"vocab_size": 5, "num_layers": 1}),
}
FORMATS = ["preset", "hf", "hf-index", "hf-bf16", "gguf"]
TPS = (1, 2, 4)


@pytest.fixture
def shard_presets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The preset table with MODELS added (presets.py looks the table up by this name)."""
    real = presets.preset_table

    def table() -> dict[str, ModelConfig]:
        base = real()
        return {**base, **{n: base[p].replace(name=n, **o) for n, (p, o) in MODELS.items()}}

    monkeypatch.setattr(presets, "preset_table", table)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _reassemble(name: str, parts: list[torch.Tensor], lays: list[TPLayout], rows: int) -> torch.Tensor:
    """The whole tensor from the ranks' parts, by the layout rules (not through shard_bounds)."""
    kind, lay = shard_kind(name), lays[0]
    if kind == "replicated" or lay.tp == 1:
        assert all(torch.equal(_bits(p), _bits(parts[0])) for p in parts), name
        return parts[0]
    if kind == "row":
        return torch.cat(parts, dim=1)
    if kind == "kv":
        r = lay.kv_replicas
        assert all(torch.equal(p, parts[i - i % r]) for i, p in enumerate(parts)), name  # one head, r ranks
        return torch.cat(parts[::r])
    got = torch.cat(parts)
    if kind == "vocab":
        assert got.shape[0] == lay.vocab * lay.tp and not got[rows:].any(), name  # zero padding rows
        return got[:rows]
    return got


def check_ranks(source: ModelSource, whole: dict[str, torch.Tensor]) -> list[int]:
    """Every rank of every tp in TPS the model allows: parts == shard_tensor(whole) bit for bit, owned,
    contiguous, in the whole stream's order, and they reassemble to `whole`. Returns the tps checked."""
    assert source.shard_weights is not None  # the loader reads parts itself (not the fallback)
    cfg, checked = source.config, []
    for tp in TPS:
        try:
            lays = [tp_layout(cfg, tp, r) for r in range(tp)]
        except ShardError:
            continue
        checked.append(tp)
        ranks = [dict(rank_weights(source, lay)) for lay in lays]
        for lay, got in zip(lays, ranks, strict=True):
            assert list(got) == list(whole)
            for n, part in got.items():
                want = shard_tensor(n, whole[n], lay)
                assert part.dtype == want.dtype and part.shape == want.shape, (n, tp, lay.rank)
                assert torch.equal(_bits(part), _bits(want)), (n, tp, lay.rank)
                assert part.is_contiguous()
                assert part.untyped_storage().nbytes() == part.numel() * part.element_size(), n  # no view
        for n, t in whole.items():
            got_whole = _reassemble(n, [g[n] for g in ranks], lays, cfg.vocab_size)
            assert torch.equal(_bits(got_whole), _bits(t)), (n, tp)
    return checked


def write_gguf(source: ModelSource, path: Path) -> None:
    """`source` as a GGUF file the way llama.cpp's converter writes it: Q/K rows permuted for llama, the
    MLP weights quantised to Q8_0, the rest float32 (no tokenizer, no rope_freqs)."""
    import gguf
    from gguf.quants import quantize

    c = source.config
    w = gguf.GGUFWriter(str(path), c.arch)
    for add, value in (
            (w.add_block_count, c.num_layers), (w.add_context_length, c.max_position_embeddings),
            (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
            (w.add_head_count, c.num_heads), (w.add_head_count_kv, c.num_kv_heads),
            (w.add_key_length, c.head_dim), (w.add_rope_freq_base, c.rope_theta),
            (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_eos_token_id, c.eos_token_ids[0])):
        add(value)
    layer = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
             "down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, t in source.weights():
        arr, parts = t.numpy(), name.split(".")
        if parts[1] != "layers":
            w.add_tensor(f"{top['.'.join(parts[:-1])]}.{parts[-1]}", np.ascontiguousarray(arr))
            continue
        heads = {"q_proj": c.num_heads, "k_proj": c.num_kv_heads}.get(parts[-2])
        if c.arch == "llama" and heads is not None:
            arr = arr.reshape(heads, 2, arr.shape[0] // heads // 2, *arr.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        g_name = f"blk.{parts[2]}.{layer[parts[-2]]}.{parts[-1]}"
        if parts[-2] in ("gate_proj", "up_proj", "down_proj"):
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(g_name, quantize(np.ascontiguousarray(arr), q8), raw_dtype=q8)
        else:
            w.add_tensor(g_name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def open_format(fmt: str, name: str, tmp: Path) -> ModelSource:
    """The test preset `name` in format `fmt` (written under `tmp`), resolved as a user would."""
    src = load_preset(name)
    if fmt == "preset":
        return resolve_model(f"preset:{name}")
    if fmt == "gguf":
        write_gguf(src, tmp / "m.gguf")
        return resolve_model(str(tmp / "m.gguf"), cache_dir=str(tmp / "cache"))
    save_as_hf_folder(src, tmp / "m", max_shard_bytes=20_000 if fmt == "hf-index" else None,
                      dtype=torch.bfloat16 if fmt == "hf-bf16" else torch.float32)
    assert (tmp / "m" / "model.safetensors.index.json").is_file() == (fmt == "hf-index")
    return resolve_model(str(tmp / "m"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(MODELS))
def test_rank_parts_equal_shard_tensor_and_reassemble(shard_presets: None, tmp_path: Path, fmt: str,
                                                      name: str) -> None:
    source = open_format(fmt, name, tmp_path)
    assert fmt != "gguf" or "F32/Q8_0 dequantized" in source.description
    whole = {n: t.clone() for n, t in source.weights()}
    checked = check_ranks(source, whole)
    assert checked == ([1, 2] if name == "shard-llama-tied" else [1, 2, 4])  # 6 heads: no tp 4


@pytest.mark.parametrize("name", ["shard-qwen3-pad", "shard-llama"])
def test_fallback_slices_the_whole_stream_identically(shard_presets: None, name: str) -> None:
    """A source without shard_weights (a custom loader) is sliced from `weights()`: the same parts."""
    source = load_preset(name)
    plain = dataclasses.replace(source, shard_weights=None)
    for tp in (2, 4):
        for r in range(tp):
            lay = tp_layout(source.config, tp, r)
            a, b = list(rank_weights(source, lay, device="cpu")), list(rank_weights(plain, lay, device="cpu"))
            assert [n for n, _ in a] == [n for n, _ in b]
            for (n, x), (_, y) in zip(a, b, strict=True):
                assert torch.equal(_bits(x), _bits(y)), n
                assert y.untyped_storage().nbytes() == y.numel() * y.element_size(), n  # whole tensor freed


class _SpyHandle:
    """A safe_open handle that records how each tensor is read: ("whole", name) or ("slice", name, key)."""

    def __init__(self, handle: Any, calls: list[tuple[Any, ...]]) -> None:
        self._h, self._calls = handle, calls

    def get_tensor(self, name: str) -> torch.Tensor:
        self._calls.append(("whole", name))
        return self._h.get_tensor(name)

    def get_slice(self, name: str) -> Any:
        calls, view = self._calls, self._h.get_slice(name)

        class Slice:
            def get_shape(self) -> list[int]:
                return view.get_shape()

            def __getitem__(self, key: Any) -> torch.Tensor:
                calls.append(("slice", name, key))
                return view[key]

        return Slice()


def test_hf_reads_only_the_rank_range(shard_presets: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = open_format("hf-index", "shard-qwen3-pad", tmp_path)
    shapes = {n: tuple(t.shape) for n, t in source.weights()}
    calls: list[tuple[Any, ...]] = []
    real = hf.safe_open

    @contextlib.contextmanager
    def spy_open(file: str, framework: str) -> Iterator[_SpyHandle]:
        with real(file, framework=framework) as f:
            yield _SpyHandle(f, calls)

    monkeypatch.setattr(hf, "safe_open", spy_open)
    for tp in (1, 2, 4):
        for r in range(tp):
            lay = tp_layout(source.config, tp, r)
            calls.clear()
            list(rank_weights(source, lay))
            want: list[tuple[Any, ...]] = []
            for n, shape in shapes.items():
                bounds = shard_bounds(n, shape, lay)
                if bounds is None:
                    want.append(("whole", n))
                else:
                    dim, start, stop = bounds
                    want.append(("slice", n, slice(start, stop) if dim == 0 else (slice(None), slice(start, stop))))
            assert calls == want
            assert (tp == 1) == all(c[0] == "whole" for c in calls)


def _replace_tensor(file: Path, name: str, value: torch.Tensor) -> None:
    tensors = load_file(file)
    tensors[name] = value
    save_file(tensors, file)


@pytest.mark.parametrize("index", [False, True])
def test_wrong_shape_names_file_and_tensor(shard_presets: None, tmp_path: Path, index: bool) -> None:
    source = open_format("hf-index" if index else "hf", "shard-llama", tmp_path)
    bad = "model.layers.1.mlp.down_proj.weight"
    file = next(p for p in sorted((tmp_path / "m").glob("*.safetensors")) if bad in load_file(p))
    lay = tp_layout(source.config, 2, 1)
    _replace_tensor(file, bad, torch.zeros(64, 80))  # half the intermediate columns
    with pytest.raises(ModelLoadError) as e:  # the file changed after it was resolved
        list(rank_weights(source, lay))
    assert str(file) in str(e.value) and bad in str(e.value) and "[64, 80]" in str(e.value)
    with pytest.raises(ModelLoadError) as e:  # resolved again: the header check names the file too
        resolve_model(str(tmp_path / "m"))
    assert str(file) in str(e.value) and bad in str(e.value) and "the config needs [64, 160]" in str(e.value)


def test_layout_must_fit_the_model(shard_presets: None) -> None:
    source = load_preset("shard-llama-tied")
    with pytest.raises(ShardError, match="must divide the model's 6 attention heads"):
        rank_weights(source, TPLayout(4, 0, 1, 1, 2, 48, 250, 16))
    with pytest.raises(ShardError, match="was not made for model shard-llama-tied"):
        rank_weights(source, tp_layout(preset_config("shard-llama"), 2, 0))
    lay = tp_layout(source.config, 2, 0)
    with pytest.raises(ShardError, match="was not made for"):
        rank_weights(source, dataclasses.replace(lay, vocab=lay.vocab + 1))


def test_a_loader_part_of_the_wrong_shape_is_caught(shard_presets: None) -> None:
    source = load_preset("shard-llama")
    assert source.shard_weights is not None
    inner: Callable[[TPLayout], Iterator[tuple[str, torch.Tensor]]] = source.shard_weights

    def broken(lay: TPLayout) -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in inner(lay):
            yield n, (t[:-1] if n.endswith("up_proj.weight") else t)

    lay = tp_layout(source.config, 2, 0)
    with pytest.raises(ShardError, match=r"tensor model.layers.0.mlp.up_proj.weight: rank 0 of 2 got shape \[79, 64\]"):
        list(rank_weights(dataclasses.replace(source, shard_weights=broken), lay))


def test_shard_bounds_clamp_the_padded_vocabulary() -> None:
    cfg = preset_config("tiny-qwen3").replace(vocab_size=5)
    t = torch.arange(5 * 64, dtype=torch.float32).reshape(5, 64)
    for r, (start, stop) in enumerate([(0, 2), (2, 4), (4, 5), (5, 5)]):
        lay = tp_layout(cfg, 4, r)
        assert shard_bounds("lm_head.weight", (5, 64), lay) == (0, start, stop)
        part = shard_tensor("lm_head.weight", t, lay)
        assert part.shape == (2, 64) and torch.equal(part[: stop - start], t[start:stop])
        assert not part[stop - start:].any()


def test_qwen3_14b_and_llama_70b_presets_split_8_ways() -> None:
    q = preset_config("qwen3-14b")
    assert (q.arch, q.hidden_size, q.intermediate_size, q.num_layers, q.num_heads, q.num_kv_heads, q.head_dim,
            q.vocab_size, q.rope_theta, q.qk_norm, q.rms_norm_eps, q.max_position_embeddings,
            q.tie_word_embeddings) == ("qwen3", 5120, 17408, 40, 40, 8, 128, 151936, 1e6, True, 1e-6, 40960, False)
    assert abs(q.num_params() - 14.77e9) < 0.01e9
    from rapidserve.loader import expected_tensor_shapes

    shapes = rank_tensor_shapes(expected_tensor_shapes(q), tp_layout(q, 8, 7))
    p = "model.layers.39."
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (18992, 5120)
    assert shapes[p + "self_attn.q_proj.weight"] == (640, 5120) and shapes[p + "self_attn.k_proj.weight"] == (128, 5120)
    assert shapes[p + "self_attn.o_proj.weight"] == (5120, 640) and shapes[p + "mlp.down_proj.weight"] == (5120, 2176)
    assert shapes[p + "self_attn.q_norm.weight"] == (128,)
    with pytest.raises(ShardError, match="40 attention heads"):
        tp_layout(q, 16, 0)
    l70 = tp_layout(preset_config("llama-3.1-70b"), 8, 3)
    assert (l70.heads, l70.kv_heads, l70.kv_replicas, l70.intermediate, l70.vocab) == (8, 1, 1, 3584, 16032)
