"""The FlashAttention-3 backend: its adapter on CPU against a torch model of FA3's paged forward, the
search for a build, and on a Hopper GPU the real kernels against the torch reference.

The fake kernel below reads its arguments the way FA3's paged forward does (pages [P, S, Hkv, D]
through the page table, seqused_k keys per sequence, cu_seqlens_q query rows, causal mask aligned to
the end of each sequence), so the CPU tests check that the adapter hands FA3 the right views and
lengths, independently of rapidserve's own reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rapidserve.attention import AttentionMetadata, attend, fa3, get_attention_backend, split_decode_rows
from rapidserve.attention import torch_ref as ref
from rapidserve.config_base import ConfigError
from rapidserve.ops import torch_kv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_attention import (  # noqa: E402
    DECODE_CASES,
    MIXED_CASES,
    PREFILL_CASES,
    _atol,
    decode_seqs,
    make_batch,
    naive_attention,
)


def fake_fa3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
             seqused_k: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
             scale: float, window_left: int) -> torch.Tensor:
    """FA3's paged varlen forward in float64, with the checks FA3 makes on its inputs; `window_left` >= 0: each
    query sees that many keys left of its diagonal (FA3's window_size (left, 0))."""
    assert k.dim() == 4 and k.shape == v.shape and k.stride(-1) == 1 and v.stride(-1) == 1
    assert page_table.dtype == torch.int32 and seqused_k.dtype == torch.int32 and cu_seqlens_q.dtype == torch.int32
    num_seqs = page_table.shape[0]
    assert seqused_k.shape == (num_seqs,) and cu_seqlens_q.shape == (num_seqs + 1,)
    page_size, hkv = k.shape[1], k.shape[2]
    group = q.shape[1] // hkv
    out = torch.zeros(q.shape, dtype=torch.float64)
    cu = cu_seqlens_q.tolist()
    for i in range(num_seqs):
        n_k, rows = int(seqused_k[i]), slice(cu[i], cu[i + 1])
        n_q = cu[i + 1] - cu[i]
        assert n_q <= max_seqlen_q and n_k <= max_seqlen_k
        if n_k == 0:
            continue
        pages = page_table[i, torch.arange(n_k) // page_size].long()
        keys = k[pages, torch.arange(n_k) % page_size].double().repeat_interleave(group, dim=1)
        vals = v[pages, torch.arange(n_k) % page_size].double().repeat_interleave(group, dim=1)
        s = q[rows].double().transpose(0, 1) @ keys.permute(1, 2, 0) * scale  # [H, n_q, n_k]
        diag = torch.arange(n_q)[:, None] + (n_k - n_q)
        visible = torch.arange(n_k)[None, :] <= diag
        if window_left >= 0:
            visible &= torch.arange(n_k)[None, :] >= diag - window_left
        s = s.masked_fill(~visible, float("-inf"))
        out[rows] = (torch.softmax(s, dim=-1) @ vals.transpose(0, 1)).transpose(0, 1)
    return out.to(q.dtype)


ANY_DTYPE = (torch.float32, torch.float16, torch.bfloat16)
FAKE = fa3.Fa3Attention(fa3.Fa3Kernel("fake", fake_fa3, ANY_DTYPE))


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"p{i}" for i in range(len(PREFILL_CASES))])
def test_adapter_prefill(case: tuple) -> None:
    bs, group, d, hkv, seqs = case
    b = make_batch(seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, strided_q=True)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    got = FAKE.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, d**-0.5)
    torch.testing.assert_close(got.double(), naive_attention(b, d**-0.5), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"d{i}" for i in range(len(DECODE_CASES))])
def test_adapter_decode(case: tuple) -> None:
    bs, group, d, hkv, ctxs = case
    b = make_batch(decode_seqs(ctxs), num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, decode=True)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    got = FAKE.decode_attention(b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, d**-0.5)
    torch.testing.assert_close(got.double(), naive_attention(b, d**-0.5, decode=True), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", MIXED_CASES, ids=[f"m{i}" for i in range(len(MIXED_CASES))])
def test_mixed_step_is_one_prefill_call(case: tuple) -> None:
    bs, group, d, hkv, seqs = case
    b = make_batch(seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, seed=7, strided_q=True)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    calls: list[str] = []

    def prefill(*a: object) -> torch.Tensor:
        calls.append("prefill")
        return FAKE.prefill_attention(*a)  # type: ignore[arg-type]

    def decode(*a: object) -> torch.Tensor:
        calls.append("decode")
        return FAKE.decode_attention(*a)  # type: ignore[arg-type]

    backend = get_attention_backend("torch", "cpu")
    spy = type(backend)("spy", backend.write_kv, prefill, decode, graph_safe=True, one_call_mixed=True)
    out = attend(spy, b.q, b.k_cache, b.v_cache, split_decode_rows(b.meta, b.q_lens), d**-0.5)
    torch.testing.assert_close(out.double(), naive_attention(b, d**-0.5), atol=2e-5, rtol=1e-4)
    assert calls == ["prefill"]


def test_decode_max_seqlen_k_comes_from_shapes() -> None:
    """A captured decode graph replays with longer contexts: the host argument is the table's capacity."""
    seen: list[tuple[int, int]] = []

    def spy(q: torch.Tensor, k: torch.Tensor, *a: object) -> torch.Tensor:
        seen.append((int(a[4]), int(a[5])))  # type: ignore[call-overload]
        return torch.zeros_like(q)

    b = make_batch(decode_seqs([5, 0, 40]), num_kv_heads=2, group=2, head_dim=32, block_size=8, decode=True)
    fa3.Fa3Attention(fa3.Fa3Kernel("spy", spy, ANY_DTYPE)).decode_attention(
        b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, 1.0)
    assert seen == [(1, b.meta.block_tables.shape[1] * 8)]


def test_prefill_needs_cu_seqlens() -> None:
    meta = AttentionMetadata(True, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        FAKE.prefill_attention(torch.zeros(1, 2, 8), torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8), meta, 1.0)


# ------------------------------------------------------------------------------- finding a build
def test_vllm_schema_check() -> None:
    fa3.check_vllm_schema(list(fa3.VLLM_FWD_ARGS))
    with pytest.raises(ImportError, match="vllm==0.24"):
        fa3.check_vllm_schema(list(fa3.VLLM_FWD_ARGS[:-1]))
    with pytest.raises(ImportError, match="not the 37 arguments"):
        fa3.check_vllm_schema(["q", "k", "v", "page_table", *fa3.VLLM_FWD_ARGS[4:]])


def test_vllm_library_found_without_importing_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "vllm"
    (pkg / "vllm_flash_attn").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="no _vllm_fa3_C"):
        fa3.vllm_fa3_library()
    lib = pkg / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so"
    lib.write_bytes(b"")
    assert fa3.vllm_fa3_library() == lib
    assert "vllm" not in sys.modules or sys.modules["vllm"].__file__ != str(pkg / "__init__.py")


def test_fa3_needs_an_nvidia_gpu() -> None:
    with pytest.raises(ImportError, match="NVIDIA GPUs only"):
        fa3.find_fa3(torch.device("cpu"))
    with pytest.raises(ConfigError, match="attention_backend='fa3'.*use attention_backend='triton'"):
        get_attention_backend("fa3", "cpu")
    assert get_attention_backend("auto", "cpu").name == "torch"


# ------------------------------------------------------------------------------------------ GPU
def _real_fa3() -> fa3.Fa3Attention:
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    try:
        return fa3.Fa3Attention(fa3.find_fa3(torch.device("cuda")))
    except ImportError as e:
        pytest.skip(f"FlashAttention-3 is not available here: {e}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16, 4, 128, 8), (16, 3, 64, 3), (32, 2, 128, 2)])
def test_gpu_fa3_prefill(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    impl = _real_fa3()
    bs, group, d, hkv = shape
    seqs = [(300, 0), (1, 700), (129, 64), (2, -1), (64, 1), (1000, 37)]
    b = make_batch(seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, dtype=dtype,
                   device="cuda", strided_q=True)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    want = ref.prefill_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(), b.meta, d**-0.5)
    got = impl.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, d**-0.5)
    torch.testing.assert_close(got.float(), want, atol=_atol(dtype), rtol=1e-2)
    mixed = [(1, 4095), (1, 700), (1, -1), (512, 1024), (300, 0)]
    b = make_batch(mixed, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, dtype=dtype, device="cuda")
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    want = ref.prefill_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(), b.meta, d**-0.5)
    got = impl.prefill_attention(b.q, b.k_cache, b.v_cache, split_decode_rows(b.meta, b.q_lens), d**-0.5)
    torch.testing.assert_close(got.float(), want, atol=_atol(dtype), rtol=1e-2)


@pytest.mark.gpu
def test_gpu_fa3_decode_graph_replay() -> None:
    """Decode, plain and captured once then replayed with other contexts (padding rows give zeros)."""
    impl = _real_fa3()
    d = 128
    batches = [make_batch(decode_seqs(c), num_kv_heads=8, group=4, head_dim=d, block_size=16,
                          dtype=torch.bfloat16, device="cuda", decode=True, seed=s)
               for s, c in enumerate(([500, 17, 0, 1200], [900, 1, 33, 0], [4000, 2, 64, 129]))]
    for b in batches:
        torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    width = max(b.meta.block_tables.shape[1] for b in batches)
    nblk = max(b.k_cache.shape[0] for b in batches)
    kc = torch.zeros((nblk, *batches[0].k_cache.shape[1:]), dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    static = {"q": batches[0].q.clone(), "ctx": batches[0].meta.context_lens.clone(),
              "bt": torch.zeros(4, width, dtype=torch.int32, device="cuda")}

    def load(b: object) -> None:
        kc.zero_()
        vc.zero_()
        kc[:b.k_cache.shape[0]] = b.k_cache.nan_to_num(0.0)  # type: ignore[attr-defined]
        vc[:b.v_cache.shape[0]] = b.v_cache.nan_to_num(0.0)  # type: ignore[attr-defined]
        static["bt"].zero_()
        static["bt"][:, :b.meta.block_tables.shape[1]] = b.meta.block_tables  # type: ignore[attr-defined]
        static["q"].copy_(b.q)  # type: ignore[attr-defined]
        static["ctx"].copy_(b.meta.context_lens)  # type: ignore[attr-defined]

    def step() -> torch.Tensor:
        return impl.decode_attention(static["q"], kc, vc, static["bt"], static["ctx"], d**-0.5)

    load(batches[0])
    plain = step()
    want = ref.decode_attention(static["q"].float(), kc.float(), vc.float(), static["bt"], static["ctx"], d**-0.5)
    torch.testing.assert_close(plain.float(), want, atol=3e-2, rtol=1e-2)
    assert plain[2].abs().max().item() == 0.0  # the padding row
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for b in batches[1:]:
        load(b)
        graph.replay()
        want = ref.decode_attention(static["q"].float(), kc.float(), vc.float(), static["bt"], static["ctx"],
                                    d**-0.5)
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=1e-2)


def test_fp32_prefill_falls_back() -> None:
    """FA3 takes fp16/bf16 only: fp32 prefill goes to the fallback kernel, fp32 decode is refused."""
    b = make_batch([(5, 3)], num_kv_heads=1, group=2, head_dim=32, block_size=8)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    used: list[str] = []

    def fallback(*a: object) -> torch.Tensor:
        used.append("fallback")
        return ref.prefill_attention(*a)  # type: ignore[arg-type]

    impl = fa3.Fa3Attention(fa3.Fa3Kernel("fake", fake_fa3), fallback_prefill=fallback)
    got = impl.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, 32**-0.5)
    torch.testing.assert_close(got.double(), naive_attention(b, 32**-0.5), atol=2e-5, rtol=1e-4)
    assert used == ["fallback"]
    strict = fa3.Fa3Attention(fa3.Fa3Kernel("fake", fake_fa3))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        strict.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, 1.0)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        strict.decode_attention(b.q[:1], b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, 1.0)
