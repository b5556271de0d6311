"""Elementwise / normalisation ops: the torch versions are bit-identical to transformers' own Llama /
Qwen3 functions; the Triton versions match the torch versions (under the Triton interpreter on CPU, in
a subprocess, and natively on a GPU).

Run as a script (``TRITON_INTERPRET=1 python tests/test_ops.py``) it performs the interpreter checks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable

import pytest
import torch
from triton_interp import exit_passed, run_interpreted

from rapidserve.ops import get_ops
from rapidserve.ops import torch_ops as tops

HAS_TRITON = importlib.util.find_spec("triton") is not None
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _hf_llama() -> object:
    return pytest.importorskip("transformers.models.llama.modeling_llama")


def rope_inputs(dtype: torch.dtype, num_tokens: int = 11, num_heads: int = 6, num_kv_heads: int = 2,
                head_dim: int = 64, max_pos: int = 4096, seed: int = 0,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q view, k view) into one fused qkv buffer, positions, and a cos|sin table [max_pos, D] fp32."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads,
                                                                                 head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    positions[:3] = torch.tensor([0, 1, max_pos - 1])
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return q, k, positions, torch.cat((freqs.cos(), freqs.sin()), dim=-1)


# ----------------------------------------------------------------- torch ops == transformers
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    llama = _hf_llama()
    norm = llama.LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = torch.randn(7, 96).to(dtype) * 3
    assert torch.equal(tops.rms_norm(x, norm.weight.detach(), 1e-5), norm(x).detach())
    # Qwen3's per-head q/k norm: [T, H, D] rows.
    x3 = torch.randn(5, 4, 96).to(dtype)
    assert torch.equal(tops.rms_norm(x3, norm.weight.detach(), 1e-5), norm(x3).detach())
    # ... also as a strided view into a fused qkv output (transformers' input is contiguous).
    qkv = torch.randn(5, 7 * 96).to(dtype)
    view = qkv[:, 96:5 * 96].view(5, 4, 96)
    assert torch.equal(tops.rms_norm(view, norm.weight.detach(), 1e-5), norm(view.contiguous()).detach())


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    llama = _hf_llama()
    norm = llama.LlamaRMSNorm(128, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(128) + 0.5)
    x, residual = torch.randn(9, 128).to(dtype), torch.randn(9, 128).to(dtype)
    out, new_residual = tops.add_rms_norm(x, residual, norm.weight.detach(), 1e-6)
    hf_residual = residual + x  # LlamaDecoderLayer: hidden_states = residual + hidden_states
    assert torch.equal(new_residual, hf_residual)
    assert torch.equal(out, norm(hf_residual).detach())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [False, True])
def test_apply_rope_matches_transformers(dtype: torch.dtype, scaling: bool) -> None:
    llama = _hf_llama()
    from transformers import LlamaConfig

    params: dict[str, object] = {"rope_type": "default", "rope_theta": 10000.0}
    if scaling:
        params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    cfg = LlamaConfig(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=4096, rope_parameters=params)
    rotary = llama.LlamaRotaryEmbedding(cfg)
    q, k, positions, _ = rope_inputs(dtype)
    # The table holds transformers' own fp32 cos/sin at these positions (cos | sin, first halves).
    cos32, sin32 = rotary(torch.zeros(1), positions[None])
    table = torch.zeros(4096, 64)
    table[positions] = torch.cat((cos32[0, :, :32], sin32[0, :, :32]), dim=-1)
    q_out, k_out = tops.apply_rope(q, k, positions, table)

    cos, sin = rotary(torch.zeros(1, dtype=dtype), positions[None])  # cast to the activations' dtype
    hf_q, hf_k = llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(q_out, hf_q[0].transpose(0, 1))
    assert torch.equal(k_out, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_transformers(dtype: torch.dtype) -> None:
    act = pytest.importorskip("transformers.activations").ACT2FN["silu"]
    gate_up = torch.randn(6, 400).to(dtype) * 4  # the fused gate_up projection's output
    gate, up = gate_up[:, :200].contiguous(), gate_up[:, 200:].contiguous()  # separate projections
    assert torch.equal(tops.silu_and_mul(gate_up), act(gate) * up)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_rope_refuses_bad_shapes() -> None:
    """Checked on the host before any launch, so this runs on CPU."""
    from rapidserve.ops import triton_rope as xrope

    q, k, pos, table = rope_inputs(torch.float32, 5, 6, 2, 64)
    w = torch.ones(64)
    with pytest.raises(ValueError, match=r"q/k norm weights must be \[64\]"):
        xrope.qk_norm_rope(q, k, w, torch.ones(32), 1e-6, pos, table)
    with pytest.raises(ValueError, match="positions must be"):
        xrope.qk_norm_rope(q, k, w, w, 1e-6, pos[:3], table)
    with pytest.raises(ValueError, match="cos_sin_cache must be"):
        xrope.apply_rope(q, k, pos, table[:, :32])
    with pytest.raises(ValueError, match="one dtype"):
        xrope.apply_rope(q, k.half(), pos, table)


def test_get_ops_cpu_is_torch() -> None:
    ops = get_ops(torch.device("cpu"))
    assert ops.name == "torch" and ops.rms_norm is tops.rms_norm


# ------------------------------------------------------------------- Triton vs torch ops
def check_triton_ops(dtypes: list[torch.dtype], device: str,
                     close: Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]) -> None:
    from rapidserve.ops import triton_ops as xops
    from rapidserve.ops import triton_rope as xrope

    for dtype in dtypes:
        w = (torch.rand(96) + 0.5).to(dtype).to(device)
        for x in (torch.randn(7, 96), torch.randn(3, 4, 160)[:, :, 32:128], torch.randn(96)):
            x = x.to(dtype).to(device)
            close(xops.rms_norm(x, w, 1e-5), tops.rms_norm(x, w, 1e-5), dtype)
        x, r = torch.randn(9, 96).to(dtype).to(device), torch.randn(9, 96).to(dtype).to(device)
        got, want = xops.add_rms_norm(x, r, w, 1e-6), tops.add_rms_norm(x, r, w, 1e-6)
        close(got[0], want[0], dtype)
        assert torch.equal(got[1], want[1]), dtype  # one rounded add, as torch
        w32 = w.float()  # fp32 weight with low-precision activations promotes, as torch does
        close(xops.rms_norm(x, w32, 1e-5), tops.rms_norm(x, w32, 1e-5), dtype)

        for num_heads, num_kv, d in ((6, 2, 64), (9, 3, 32), (4, 4, 128)):
            q, k, pos, table = (t.to(device) for t in rope_inputs(dtype, 13, num_heads, num_kv, d))
            want_q, want_k = tops.apply_rope(q, k, pos, table)
            got_q, got_k = xrope.apply_rope(q, k, pos, table)  # in place
            assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
            assert torch.equal(got_q, want_q), (dtype, num_heads, d)
            assert torch.equal(got_k, want_k), (dtype, num_heads, d)

        for num_heads, num_kv, d in ((6, 2, 64), (9, 3, 32), (32, 8, 128)):
            q, k, pos, table = (t.to(device) for t in rope_inputs(dtype, 13, num_heads, num_kv, d))
            qw, kw = ((torch.rand(d) + 0.5).to(dtype).to(device) for _ in range(2))
            want_q, want_k = tops.apply_rope(tops.rms_norm(q, qw, 1e-6), tops.rms_norm(k, kw, 1e-6), pos, table)
            got_q, got_k = xrope.qk_norm_rope(q, k, qw, kw, 1e-6, pos, table)  # in place
            assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
            close(got_q, want_q, dtype)
            close(got_k, want_k, dtype)
            q, k, pos, table = (t.to(device) for t in rope_inputs(dtype, 5, num_heads, num_kv, d))
            want = tops.qk_norm_rope(q, k, qw.float(), kw.float(), 1e-6, pos, table)  # promotes: unfused path
            got = xrope.qk_norm_rope(q, k, qw.float(), kw.float(), 1e-6, pos, table)
            close(got[0], want[0], want[0].dtype)
            close(got[1], want[1], want[1].dtype)

        for inter in (200, 1500):
            x = (torch.randn(5, 2 * inter) * 4).to(dtype).to(device)
            close(xops.silu_and_mul(x), tops.silu_and_mul(x), dtype)


def _interp_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    atol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-3)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_ops_interpreter() -> None:
    """Triton ops under TRITON_INTERPRET=1 (fp32/fp16: the interpreter's bf16 casts truncate)."""
    run_interpreted(__file__)


def _gpu_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    # One rounding step of the dtype: Triton's rsqrt/exp and reduction order differ from torch's.
    atol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-2)


@pytest.mark.gpu
def test_triton_ops_gpu() -> None:
    check_triton_ops(DTYPES, "cuda", _gpu_close)
    assert get_ops(torch.device("cuda")).name == "triton"


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 before running the interpreter checks")
    check_triton_ops([torch.float32, torch.float16], "cpu", _interp_close)
    print("triton ops: ok")
    exit_passed()
