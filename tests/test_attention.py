"""Paged attention: the torch reference against a naive float64 softmax(QK^T)V on many shapes, the
reference against transformers' own SDPA attention, and the Triton kernels against the reference
(under the Triton interpreter on CPU, in a subprocess, and natively on a GPU).

Run as a script (``TRITON_INTERPRET=1 python tests/test_attention.py write_kv|prefill|decode``) it
performs the interpreter checks; the ``test_triton_interpreter`` tests do exactly that (all in one subprocess).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from triton_interp import interpreted_checks, run_checks, selected

from rapidserve.attention import AttentionMetadata, get_attention_backend
from rapidserve.attention import torch_ref as ref
from rapidserve.config_base import ConfigError
from rapidserve.ops import torch_kv

HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D] (prefill) or [B, Hq, D] (decode)
    k_new: torch.Tensor  # [T, Hkv, D]: the keys to write this step
    v_new: torch.Tensor
    k_cache: torch.Tensor  # prefix already written; unwritten slots hold NaN
    v_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence [ctx, Hkv, D], every key of the sequence
    values: list[torch.Tensor]
    q_lens: list[int]


def make_batch(seqs: list[tuple[int, int]], *, num_kv_heads: int, group: int, head_dim: int,
               block_size: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
               decode: bool = False, strided_q: bool = False) -> Batch:
    """seqs: (q_len, prefix) per sequence; (q_len, -1) is a padding sequence (context 0, slot -1).
    Blocks are handed out from a random permutation, spare table entries point at random blocks."""
    gen = torch.Generator().manual_seed(seed)
    ctxs = [0 if p < 0 else q + p for q, p in seqs]
    needed = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(needed) + 2
    table = perm[torch.randint(0, num_blocks, (len(seqs), width), generator=gen)].to(torch.int32)
    nxt = 0
    for i, n in enumerate(needed):
        table[i, :n] = perm[nxt:nxt + n].to(torch.int32)
        nxt += n
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen).to(dtype)

    keys = [rnd(c, num_kv_heads, head_dim) for c in ctxs]
    values = [rnd(c, num_kv_heads, head_dim) for c in ctxs]
    q_lens = [q for q, _ in seqs]
    new_slots: list[int] = []
    k_new, v_new = [], []
    for i, ((q_len, prefix), ctx) in enumerate(zip(seqs, ctxs, strict=True)):
        slots = [int(table[i, t // block_size]) * block_size + t % block_size for t in range(ctx)]
        if prefix < 0:
            new_slots += [-1] * q_len
            k_new.append(rnd(q_len, num_kv_heads, head_dim))
            v_new.append(rnd(q_len, num_kv_heads, head_dim))
            continue
        # The cached prefix was written by an earlier step.
        torch_kv.write_kv(keys[i][:prefix], values[i][:prefix], k_cache, v_cache,
                          torch.tensor(slots[:prefix], dtype=torch.int64))
        new_slots += slots[prefix:]
        k_new.append(keys[i][prefix:])
        v_new.append(values[i][prefix:])
    num_tokens = sum(q_lens)
    num_heads = num_kv_heads * group
    rows = len(seqs) if decode else num_tokens
    if strided_q:  # q as a view into a wider fused-qkv style buffer
        q = rnd(rows, (num_heads + 5) * head_dim)[:, 3 * head_dim:(3 + num_heads) * head_dim]
        q = q.view(rows, num_heads, head_dim)
    else:
        q = rnd(rows, num_heads, head_dim)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        is_prefill=not decode, slot_mapping=torch.tensor(new_slots, dtype=torch.int64),
        block_tables=table, context_lens=torch.tensor(ctxs, dtype=torch.int32),
        cu_seqlens_q=None if decode else cu, max_seqlen_q=max(q_lens), max_context_len=max(ctxs))
    b = Batch(q, torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, meta, keys, values, q_lens)
    if device != "cpu":
        b = to_device(b, device)
    return b


def to_device(b: Batch, device: str) -> Batch:
    m = b.meta
    meta = AttentionMetadata(m.is_prefill, m.slot_mapping.to(device), m.block_tables.to(device),
                             m.context_lens.to(device),
                             None if m.cu_seqlens_q is None else m.cu_seqlens_q.to(device),
                             m.max_seqlen_q, m.max_context_len)
    return Batch(b.q.to(device), b.k_new.to(device), b.v_new.to(device), b.k_cache.to(device),
                 b.v_cache.to(device), meta, b.keys, b.values, b.q_lens)


def naive_attention(b: Batch, scale: float, decode: bool = False) -> torch.Tensor:
    """float64 softmax(QK^T)V over the dense keys, new token j of a sequence seeing keys 0..prefix+j."""
    out = torch.zeros(b.q.shape, dtype=torch.float64)
    group = b.q.shape[1] // b.keys[0].shape[1] if b.keys else 1
    start = 0
    for i, (keys, values) in enumerate(zip(b.keys, b.values, strict=True)):
        ctx = keys.shape[0]
        q_len = 1 if decode else b.q_lens[i]
        rows = slice(i, i + 1) if decode else slice(start, start + q_len)
        start += b.q_lens[i]
        if ctx == 0:
            continue
        qi = b.q[rows].double().cpu().transpose(0, 1)  # [Hq, q_len, D]
        k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
        s = qi @ k.transpose(1, 2) * scale
        visible = torch.arange(ctx)[None, :] <= torch.arange(q_len)[:, None] + (ctx - q_len)
        s = s.masked_fill(~visible, float("-inf"))
        out[rows] = (torch.softmax(s, dim=-1) @ v).transpose(0, 1)
    return out


# (block_size, group, head_dim, num_kv_heads, [(q_len, prefix) ...]); prefix -1 = padding sequence.
PREFILL_CASES = [
    (16, 1, 32, 2, [(1, 0)]),
    (16, 1, 64, 2, [(70, 0)]),
    (16, 4, 128, 2, [(16, 0), (17, 0), (15, 0)]),
    (16, 4, 64, 2, [(5, 16), (1, 32), (33, 48)]),
    (16, 3, 64, 3, [(40, 0), (9, 7), (1, 50), (70, 1)]),
    (16, 3, 32, 1, [(3, 13), (13, 3), (4, -1)]),
    (8, 1, 32, 4, [(8, 8), (9, 7), (7, 9), (1, 0), (64, 0)]),
    (8, 4, 128, 1, [(2, 24), (31, 33), (50, 50)]),
    (8, 3, 64, 2, [(1, 1), (2, -1), (69, 31)]),
    (16, 4, 32, 2, [(48, 0), (1, 47), (2, -1), (20, 44), (11, 0)]),
    (8, 1, 64, 1, [(1, 0), (1, 8), (1, 15), (1, 16), (1, 17)]),
    (16, 3, 128, 2, [(64, 16), (33, 0)]),
]

# (block_size, group, head_dim, num_kv_heads, [context_len ...]); 0 = padding row.
DECODE_CASES = [
    (16, 1, 32, 2, [1]),
    (16, 4, 128, 2, [16, 17, 15, 32]),
    (16, 3, 64, 3, [100, 0, 1, 48, 49]),
    (8, 4, 64, 1, [8, 9, 7, 64, 120]),
    (8, 1, 128, 4, [0, 3]),
    (16, 3, 32, 2, [0, 0, 200]),
    (8, 3, 64, 2, [33, 1, 2, 5, 70]),
    (16, 4, 64, 2, [250, 16, 1]),
]


def decode_seqs(ctxs: list[int]) -> list[tuple[int, int]]:
    return [(1, -1) if c == 0 else (1, c - 1) for c in ctxs]


def _atol(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"p{i}" for i in range(len(PREFILL_CASES))])
def test_torch_prefill_matches_naive(case: tuple, strided: bool) -> None:
    bs, group, d, hkv, seqs = case
    b = make_batch(seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, seed=len(seqs),
                   strided_q=strided)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    out = ref.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, d**-0.5)
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    torch.testing.assert_close(out.double(), naive_attention(b, d**-0.5), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"d{i}" for i in range(len(DECODE_CASES))])
def test_torch_decode_matches_naive(case: tuple) -> None:
    bs, group, d, hkv, ctxs = case
    b = make_batch(decode_seqs(ctxs), num_kv_heads=hkv, group=group, head_dim=d, block_size=bs,
                   seed=sum(ctxs), decode=True)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    out = ref.decode_attention(b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, d**-0.5)
    torch.testing.assert_close(out.double(), naive_attention(b, d**-0.5, decode=True), atol=2e-5, rtol=1e-4)
    for i, c in enumerate(ctxs):
        if c == 0:
            assert torch.count_nonzero(out[i]) == 0


def test_torch_write_kv_skips_padding() -> None:
    b = make_batch([(3, 2), (2, -1), (4, 0)], num_kv_heads=2, group=1, head_dim=32, block_size=8)
    before = b.k_cache.clone()
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    written = (~torch.isnan(b.k_cache[:, 0, :, 0])).sum() - (~torch.isnan(before[:, 0, :, 0])).sum()
    assert int(written) == 7  # the padding sequence's 2 tokens are not written


def test_torch_reference_matches_transformers_sdpa() -> None:
    """Bit-identical to transformers' sdpa_attention_forward in fp32 (prefill from empty and decode)."""
    sdpa = pytest.importorskip("transformers.integrations.sdpa_attention")
    hkv, group, d, n = 3, 3, 64, 37
    module = SimpleNamespace(num_key_value_groups=group, is_causal=True, training=False)
    b = make_batch([(n, 0)], num_kv_heads=hkv, group=group, head_dim=d, block_size=16, seed=3)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    out = ref.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, d**-0.5)
    hf_q = b.q.unsqueeze(0).transpose(1, 2)  # [1, Hq, n, D], as transformers lays it out
    hf_k = b.keys[0].unsqueeze(0).transpose(1, 2).contiguous()
    hf_v = b.values[0].unsqueeze(0).transpose(1, 2).contiguous()
    hf_out, _ = sdpa.sdpa_attention_forward(module, hf_q, hf_k, hf_v, None, scaling=d**-0.5)
    assert torch.equal(out, hf_out[0])

    qd = torch.randn(1, hkv * group, d)
    dec = ref.decode_attention(qd, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, d**-0.5)
    hf_dec, _ = sdpa.sdpa_attention_forward(module, qd.unsqueeze(2), hf_k, hf_v, None, scaling=d**-0.5)
    torch.testing.assert_close(dec, hf_dec[:, 0], atol=1e-6, rtol=1e-6)


def test_backend_selection() -> None:
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu).name == "torch"
    assert get_attention_backend("torch", cpu).name == "torch"
    with pytest.raises(ConfigError, match="needs a CUDA or ROCm GPU"):
        get_attention_backend("triton", cpu)
    with pytest.raises(ConfigError, match="attention_backend"):
        get_attention_backend("flash", cpu)


def test_prefill_kernel_compiles_one_variant_for_every_batch_shape() -> None:
    """The per-step counts are not specialized: each new (== 1, divisible by 16) combination of them compiled a
    variant mid-serving, a 0.5-1 s stall of every request in flight (bench/results/h100_1127/prefill_graphs/)."""
    pytest.importorskip("triton")
    from rapidserve.attention import triton_paged_prefill as tp

    k = tp._prefill_kernel
    names = {k.arg_names[i] if isinstance(i, int) else i for i in k.do_not_specialize}
    assert {"num_seqs", "num_m_tiles"} <= names


def _unspecialized(kernel: object) -> set[str]:
    return {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}  # type: ignore[attr-defined]


def test_decode_kernels_compile_one_variant_for_every_step() -> None:
    """Eager decode (hybrid's mixed steps) varies the split count and the block table's width each step: neither
    is specialized, and the reduce kernel's split tile is the same for every batch on one device and model."""
    pytest.importorskip("triton")
    from rapidserve.attention import decode_config as dc
    from rapidserve.attention import triton_paged_decode as tp

    assert {"num_splits", "stride_bt"} <= _unspecialized(tp._decode_split_kernel)
    assert "num_splits" in _unspecialized(tp._decode_reduce_kernel)
    sms, kv = 132, 8  # H100, Qwen3-8B
    tiles = {dc.decode_block_s(dc.decode_num_splits(b, kv, w, 16, 64, sms), kv, sms)
             for b in range(1, 257) for w in (1, 7, 64, 512)}
    assert tiles == {64}
    kv4 = {dc.decode_block_s(dc.decode_num_splits(b, 4, 512, 16, 64, sms), 4, sms) for b in range(1, 257)}
    assert kv4 == {64, 128}  # 4 kv heads a rank (Qwen3-8B at -tp 2): batch 1 alone splits 66 ways
    assert dc.decode_block_s(1, 1, 132) == 64  # capped for a single kv head ...
    assert dc.decode_block_s(200, 1, 132) == 256  # ... unless the split count itself is larger (override)


# --------------------------------------------------------------------------- Triton interpreter
def _interp_write_kv() -> None:
    from rapidserve.ops import triton_kv as tp

    for dtype in (torch.float32, torch.float16):
        b = make_batch([(3, 5), (2, -1), (9, 0)], num_kv_heads=3, group=1, head_dim=64, block_size=8,
                       dtype=dtype, seed=1)
        kc, vc = b.k_cache.clone(), b.v_cache.clone()
        torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
        tp.write_kv(b.k_new, b.v_new, kc, vc, b.meta.slot_mapping)
        assert torch.equal(kc.nan_to_num(7.0), b.k_cache.nan_to_num(7.0)), dtype
        assert torch.equal(vc.nan_to_num(7.0), b.v_cache.nan_to_num(7.0)), dtype


def _interp_prefill() -> None:
    from rapidserve.attention import triton_paged_prefill as tp

    cases = [  # (block_size, group, head_dim, hkv, seqs, dtype, block_m, block_n)
        (16, 3, 64, 3, [(40, 0), (9, 7), (1, 50), (3, -1)], torch.float32, 16, 16),
        (8, 4, 32, 2, [(17, 16), (33, 0), (5, 3)], torch.float16, 32, 16),
        (8, 1, 32, 1, [(70, 30), (2, 8)], torch.float32, 32, 32),
        (16, 4, 128, 1, [(20, 12)], torch.float32, None, None),
        (32, 2, 32, 2, [(45, 20), (3, 60), (1, -1)], torch.float16, 16, 16),  # tiles smaller than pages
    ]
    for bs, group, d, hkv, seqs, dtype, bm, bn in cases:
        b = make_batch(seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, dtype=dtype,
                       strided_q=True)
        torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
        want = ref.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, d**-0.5)
        got = tp.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, d**-0.5, block_m=bm, block_n=bn)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=_atol(dtype), rtol=1e-3,
                                   msg=lambda m, c=(bs, group, d, seqs, dtype): f"{c}: {m}")


def _interp_decode() -> None:
    from rapidserve.attention import triton_paged_decode as tp

    cases = [  # (block_size, group, head_dim, hkv, ctxs, dtype)
        (16, 3, 64, 3, [100, 0, 1, 48, 49], torch.float32),
        (8, 4, 32, 2, [8, 9, 0, 64, 120], torch.float16),
        (16, 1, 32, 2, [33, 200], torch.float32),
        (32, 2, 32, 1, [70, 0, 31], torch.float16),
    ]
    for bs, group, d, hkv, ctxs, dtype in cases:
        b = make_batch(decode_seqs(ctxs), num_kv_heads=hkv, group=group, head_dim=d, block_size=bs,
                       dtype=dtype, decode=True, strided_q=True)
        torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
        args = (b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, d**-0.5)
        want = ref.decode_attention(*args)
        # the rule's splits, one, fewer than the tiles, more than the tiles of the longest context (7 at 32 keys)
        for splits, block_n in ((None, None), (1, 16), (3, 16), (8, 32)):
            got = tp.decode_attention(*args, num_splits=splits, block_n=block_n)
            torch.testing.assert_close(got.float(), want.float(), atol=_atol(dtype), rtol=1e-3,
                                       msg=lambda m, c=(bs, group, d, ctxs, dtype, splits): f"{c}: {m}")


INTERP_CHECKS = {"write_kv": _interp_write_kv, "prefill": _interp_prefill, "decode": _interp_decode}


@pytest.fixture(scope="module")
def interpreter(request: pytest.FixtureRequest) -> dict[str, str]:
    """The session's interpreter checks of this module, in one subprocess (tests/triton_interp.py)."""
    return interpreted_checks(__file__, selected(request, "check"))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("check", sorted(INTERP_CHECKS))
def test_triton_interpreter(interpreter: dict[str, str], check: str) -> None:
    """The Triton kernels under TRITON_INTERPRET=1 (fp32/fp16: the interpreter's bf16 is inexact)."""
    assert interpreter[check] == "", interpreter[check]


# -------------------------------------------------------------------------------------------- GPU
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(16, 4, 128, 8), (16, 3, 64, 3), (8, 1, 64, 4), (32, 2, 32, 2)])
def test_gpu_prefill_and_write_kv(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    from rapidserve.attention.triton_paged_prefill import prefill_attention
    from rapidserve.ops.triton_kv import write_kv

    bs, group, d, hkv = shape
    seqs = [(300, 0), (1, 700), (129, 64), (2, -1), (64, 1), (1000, 37)]
    b = make_batch(seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, dtype=dtype,
                   device="cuda", strided_q=True)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    write_kv(b.k_new, b.v_new, kc, vc, b.meta.slot_mapping)
    assert torch.equal(kc.nan_to_num(7.0), b.k_cache.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), b.v_cache.nan_to_num(7.0))
    want = ref.prefill_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(), b.meta, d**-0.5)
    got = prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, d**-0.5)
    torch.testing.assert_close(got.float(), want, atol=_atol(dtype), rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(16, 4, 128, 8), (16, 3, 64, 3), (16, 1, 128, 4)])
def test_gpu_decode(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    from rapidserve.attention import triton_paged_decode as tp

    bs, group, d, hkv = shape
    ctxs = [2048, 1, 0, 17, 999, 64, 4000, 333]
    b = make_batch(decode_seqs(ctxs), num_kv_heads=hkv, group=group, head_dim=d, block_size=bs,
                   dtype=dtype, device="cuda", decode=True, strided_q=True)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    args = (b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, d**-0.5)
    want = ref.decode_attention(b.q.float(), args[0].float(), args[1].float(), *args[2:])
    for splits in (None, 1, 5, 64):
        got = tp.decode_attention(b.q, *args, num_splits=splits)
        torch.testing.assert_close(got.float(), want, atol=_atol(dtype), rtol=1e-2)


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replay() -> None:
    """write_kv + decode captured once, replayed with new slots and longer contexts."""
    backend = get_attention_backend("triton", torch.device("cuda"))
    assert backend.graph_safe
    d = 128
    b = make_batch(decode_seqs([500, 17, 0, 1200]), num_kv_heads=8, group=4, head_dim=d, block_size=16,
                   dtype=torch.bfloat16, device="cuda", decode=True)
    b2 = make_batch(decode_seqs([900, 1, 33, 0]), num_kv_heads=8, group=4, head_dim=d, block_size=16,
                    dtype=torch.bfloat16, device="cuda", decode=True, seed=5)
    width = max(b.meta.block_tables.shape[1], b2.meta.block_tables.shape[1])
    nblk = max(b.k_cache.shape[0], b2.k_cache.shape[0])

    def pad(x: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), float("nan"))])

    kc, vc = pad(b.k_cache, nblk), pad(b.v_cache, nblk)
    static = {"q": b.q.clone(), "k": b.k_new.clone(), "v": b.v_new.clone(),
              "slots": b.meta.slot_mapping.clone(), "ctx": b.meta.context_lens.clone(),
              "bt": torch.zeros(4, width, dtype=torch.int32, device="cuda")}
    static["bt"][:, :b.meta.block_tables.shape[1]] = b.meta.block_tables

    def step() -> torch.Tensor:
        backend.write_kv(static["k"], static["v"], kc, vc, static["slots"])
        return backend.decode_attention(static["q"], kc, vc, static["bt"], static["ctx"], d**-0.5)

    step()  # warm up / compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for src in (b, b2):
        kc.copy_(pad(src.k_cache, nblk))
        vc.copy_(pad(src.v_cache, nblk))
        static["bt"].zero_()
        static["bt"][:, :src.meta.block_tables.shape[1]] = src.meta.block_tables
        for name, t in (("q", src.q), ("k", src.k_new), ("v", src.v_new), ("slots", src.meta.slot_mapping),
                        ("ctx", src.meta.context_lens)):
            static[name].copy_(t)
        graph.replay()
        want = ref.decode_attention(src.q.float(), kc.float(), vc.float(), static["bt"], static["ctx"],
                                    d**-0.5)
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=1e-2)


if __name__ == "__main__":
    sys.exit(run_checks(INTERP_CHECKS, sys.argv[1:]))


# ---------------------------------------------------------------------------------- mixed steps
# (block_size, group, head_dim, num_kv_heads, [(q_len, prefix) ...]): one-token decodes first.
MIXED_CASES = [
    (16, 4, 64, 2, [(1, 40), (1, 3), (20, 0), (5, 17)]),
    (8, 3, 32, 1, [(1, 0), (9, 7)]),
    (8, 1, 64, 2, [(1, 15), (1, 16), (1, 1)]),  # decodes only: no prefill part
    (16, 2, 32, 2, [(7, 0), (1, 30)]),  # a one-token row after a chunk stays in the prefill part
]


@pytest.mark.parametrize("case", MIXED_CASES, ids=[f"m{i}" for i in range(len(MIXED_CASES))])
def test_mixed_step_splits_decodes_from_chunks(case: tuple) -> None:
    from rapidserve.attention import attend, split_decode_rows

    bs, group, d, hkv, seqs = case
    b = make_batch(seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, seed=7, strided_q=True)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    meta = split_decode_rows(b.meta, b.q_lens)
    lead = next((i for i, n in enumerate(b.q_lens) if n != 1), len(b.q_lens))
    assert meta.num_decode_seqs == lead
    assert (meta.prefill_part is None) == (lead in (0, len(seqs)))
    if meta.prefill_part is not None:
        assert meta.prefill_part.cu_seqlens_q.tolist()[0] == 0
        assert meta.prefill_part.num_seqs == len(seqs) - lead
    calls: list[str] = []
    backend = get_attention_backend("torch", "cpu")

    def decode(*a: object) -> torch.Tensor:
        calls.append("decode")
        return backend.decode_attention(*a)  # type: ignore[arg-type]

    def prefill(*a: object) -> torch.Tensor:
        calls.append("prefill")
        return backend.prefill_attention(*a)  # type: ignore[arg-type]

    spy = type(backend)("spy", backend.write_kv, prefill, decode)
    out = attend(spy, b.q, b.k_cache, b.v_cache, meta, d**-0.5)
    torch.testing.assert_close(out.double(), naive_attention(b, d**-0.5), atol=2e-5, rtol=1e-4)
    want = (["decode"] if lead else []) + (["prefill"] if lead < len(seqs) else [])
    assert calls == want


def test_split_decode_rows_refuses_decode_metadata() -> None:
    from rapidserve.attention import split_decode_rows

    b = make_batch(decode_seqs([3, 4]), num_kv_heads=1, group=1, head_dim=32, block_size=8, decode=True)
    with pytest.raises(ValueError, match="prefill metadata"):
        split_decode_rows(b.meta, [1, 1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_mixed_step(dtype: torch.dtype) -> None:
    from rapidserve.attention import attend, split_decode_rows

    seqs = [(1, 4095), (1, 700), (1, 0), (512, 1024), (300, 0)]
    b = make_batch(seqs, num_kv_heads=8, group=4, head_dim=128, block_size=16, dtype=dtype, device="cuda",
                   strided_q=True)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    meta = split_decode_rows(b.meta, b.q_lens)
    got = attend(get_attention_backend("triton", "cuda"), b.q, b.k_cache, b.v_cache, meta, 128**-0.5)
    want = ref.prefill_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(), b.meta, 128**-0.5)
    torch.testing.assert_close(got.float(), want, atol=_atol(dtype), rtol=1e-2)
