"""Sliding-window attention (Mistral, Gemma 3's local layers) in every backend: the query at position p sees keys
p - W < t <= p. The torch reference against a naive float64 softmax with that mask (prefill from empty, after a
cached prefix, decode, mixed steps through `attend`), the FA3 adapter against a model of FA3's windowed forward,
the Triton kernels against the reference under the Triton interpreter (a subprocess), and a window no shorter than
the context giving exactly the unwindowed answer.

Run as a script (``TRITON_INTERPRET=1 python tests/test_attention_window.py prefill|decode``) it performs the
interpreter checks; `test_triton_interpreter_window` does exactly that (both in one subprocess).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_attention import Batch, decode_seqs, make_batch  # noqa: E402
from triton_interp import interpreted_checks, run_checks, selected  # noqa: E402

from rapidserve.attention import attend, fa3, get_attention_backend, split_decode_rows  # noqa: E402
from rapidserve.attention import torch_ref as ref  # noqa: E402
from rapidserve.ops import torch_kv  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (block_size, group, head_dim, num_kv_heads, [(q_len, prefix) ...], window); prefix -1: a padding sequence.
PREFILL_CASES = [
    (16, 1, 32, 2, [(70, 0)], 13),
    (16, 4, 64, 2, [(5, 16), (1, 32), (33, 48)], 20),
    (8, 3, 64, 2, [(40, 0), (9, 7), (1, 50), (3, -1)], 1),
    (8, 1, 32, 4, [(64, 0), (8, 8)], 64),  # the window is the longest context: nothing hidden
    (16, 2, 32, 2, [(100, 30), (17, 0)], 37),
    (32, 4, 128, 1, [(50, 50), (2, 24)], 16),
]
# (block_size, group, head_dim, num_kv_heads, [context_len ...], window); 0: a padding row.
DECODE_CASES = [
    (16, 1, 32, 2, [1, 13, 14, 100], 13),
    (8, 4, 64, 1, [0, 8, 9, 64, 120], 8),
    (16, 3, 32, 2, [200, 0, 5], 1),
    (8, 2, 128, 2, [33, 70], 70),
]


def naive_window(b: Batch, scale: float, window: int, decode: bool = False) -> torch.Tensor:
    """float64 softmax(QK^T)V over the dense keys, new token j of a sequence (position prefix + j) seeing the keys
    prefix + j - window < t <= prefix + j."""
    out = torch.zeros(b.q.shape, dtype=torch.float64)
    group = b.q.shape[1] // b.keys[0].shape[1]
    start = 0
    for i, (keys, values) in enumerate(zip(b.keys, b.values, strict=True)):
        ctx = keys.shape[0]
        q_len = 1 if decode else b.q_lens[i]
        rows = slice(i, i + 1) if decode else slice(start, start + q_len)
        start += b.q_lens[i]
        if ctx == 0:
            continue
        qi = b.q[rows].double().cpu().transpose(0, 1)
        k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
        s = qi @ k.transpose(1, 2) * scale
        pos = torch.arange(q_len)[:, None] + (ctx - q_len)
        cols = torch.arange(ctx)[None, :]
        s = s.masked_fill(~((cols <= pos) & (cols > pos - window)), float("-inf"))
        out[rows] = (torch.softmax(s, dim=-1) @ v).transpose(0, 1)
    return out


def _prefill(case: tuple, seed: int = 0, **kw: object) -> Batch:
    bs, group, d, hkv, seqs, _ = case
    b = make_batch(seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, seed=seed, **kw)  # type: ignore[arg-type]
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    return b


def _decode(case: tuple, **kw: object) -> Batch:
    bs, group, d, hkv, ctxs, _ = case
    b = make_batch(decode_seqs(ctxs), num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, decode=True,
                   seed=sum(ctxs), **kw)  # type: ignore[arg-type]
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    return b


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"p{i}" for i in range(len(PREFILL_CASES))])
def test_torch_prefill_window_matches_naive(case: tuple) -> None:
    b, d, w = _prefill(case, strided_q=True), case[2], case[5]
    out = ref.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, d**-0.5, window=w)
    torch.testing.assert_close(out.double(), naive_window(b, d**-0.5, w), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"d{i}" for i in range(len(DECODE_CASES))])
def test_torch_decode_window_matches_naive(case: tuple) -> None:
    b, d, w = _decode(case), case[2], case[5]
    out = ref.decode_attention(b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, d**-0.5,
                               window=w)
    torch.testing.assert_close(out.double(), naive_window(b, d**-0.5, w, decode=True), atol=2e-5, rtol=1e-4)
    for i, c in enumerate(case[4]):
        if c == 0:
            assert torch.count_nonzero(out[i]) == 0


def test_a_window_as_long_as_the_context_changes_nothing() -> None:
    """A window no shorter than every context hides no key: the unwindowed answer, bit for bit."""
    b = _prefill((16, 2, 32, 2, [(40, 0), (7, 20)], 0))
    plain = ref.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.2)
    assert torch.equal(ref.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.2, window=40), plain)
    assert not torch.equal(ref.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.2, window=39), plain)
    b = _decode((16, 2, 32, 2, [30, 5], 0))
    args = (b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, 0.2)
    assert torch.equal(ref.decode_attention(*args, window=30), ref.decode_attention(*args))


def test_attend_windows_both_halves_of_a_mixed_step() -> None:
    """A mixed step (decode rows, then prompt chunks) through `attend`: the decode kernel and the prefill kernel
    both get the layer's window; a backend is called without `window` when the layer has none."""
    seqs = [(1, 40), (1, 3), (1, -1), (30, 20), (12, 0)]
    b = make_batch(seqs, num_kv_heads=2, group=2, head_dim=32, block_size=8, seed=5)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    meta = split_decode_rows(b.meta, b.q_lens)
    seen: list[tuple[str, object]] = []
    backend = get_attention_backend("torch", "cpu")

    def prefill(*a: object, **kw: object) -> torch.Tensor:
        seen.append(("prefill", kw.get("window")))
        return ref.prefill_attention(*a, **kw)  # type: ignore[arg-type]

    def decode(*a: object, **kw: object) -> torch.Tensor:
        seen.append(("decode", kw.get("window")))
        return ref.decode_attention(*a, **kw)  # type: ignore[arg-type]

    spy = type(backend)("spy", backend.write_kv, prefill, decode)
    out = attend(spy, b.q, b.k_cache, b.v_cache, meta, 32**-0.5, window=9)
    torch.testing.assert_close(out.double(), naive_window(b, 32**-0.5, 9), atol=2e-5, rtol=1e-4)
    assert seen == [("decode", 9), ("prefill", 9)]
    seen.clear()
    attend(spy, b.q, b.k_cache, b.v_cache, meta, 32**-0.5)
    assert seen == [("decode", None), ("prefill", None)]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"p{i}" for i in range(len(PREFILL_CASES))])
def test_fa3_adapter_passes_the_window(case: tuple) -> None:
    """FA3 takes a window as window_size (W - 1, 0): the model of its forward gives the windowed answer."""
    from test_attention_fa3 import ANY_DTYPE, fake_fa3

    impl = fa3.Fa3Attention(fa3.Fa3Kernel("fake", fake_fa3, ANY_DTYPE))
    b, d, w = _prefill(case, seed=3), case[2], case[5]
    got = impl.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, d**-0.5, window=w)
    torch.testing.assert_close(got.double(), naive_window(b, d**-0.5, w), atol=2e-5, rtol=1e-4)
    assert fa3.window_left(w) == w - 1 and fa3.window_left(None) == -1
    with pytest.raises(ValueError, match="sliding window of 0 tokens"):
        fa3.window_left(0)


def test_fa3_fp32_fallback_keeps_the_window() -> None:
    """fp32 prefill goes to the fallback kernel, with the window."""
    from test_attention_fa3 import fake_fa3

    b = _prefill((8, 2, 32, 1, [(30, 5)], 7))
    impl = fa3.Fa3Attention(fa3.Fa3Kernel("fake", fake_fa3), fallback_prefill=ref.prefill_attention)
    got = impl.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, 32**-0.5, window=7)
    torch.testing.assert_close(got.double(), naive_window(b, 32**-0.5, 7), atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------- Triton interpreter
def _atol(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.float16: 4e-3}[dtype]


def _interp_prefill() -> None:
    from rapidserve.attention import triton_paged_prefill as tp

    for i, case in enumerate(PREFILL_CASES):
        for dtype, bm, bn in ((torch.float32, 16, 16), (torch.float16, 32, 16), (torch.float32, None, None)):
            b = _prefill(case, seed=i, dtype=dtype, strided_q=True)
            d, w = case[2], case[5]
            want = ref.prefill_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(), b.meta, d**-0.5,
                                         window=w)
            got = tp.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, d**-0.5, block_m=bm, block_n=bn, window=w)
            torch.testing.assert_close(got.float(), want.float(), atol=_atol(dtype), rtol=1e-3,
                                       msg=lambda m, c=(case, dtype, bm): f"{c}: {m}")


def _interp_decode() -> None:
    from rapidserve.attention import triton_paged_decode as tp

    for case in DECODE_CASES:
        for dtype in (torch.float32, torch.float16):
            b = _decode(case, dtype=dtype, strided_q=True)
            d, w = case[2], case[5]
            args = (b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, d**-0.5)
            want = ref.decode_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(), *args[3:], window=w)
            # the rule's splits, one, three, more than the window's tiles (at most 3 at 32 keys); fp16 (whose dtype
            # changes the dots and the output's cast, not the window's tiles) with the rule's (one split in the
            # first case, two in the others) and three splits
            configs = ((None, None), (1, 16), (3, 16), (5, 32)) if dtype == torch.float32 else ((None, None), (3, 16))
            for splits, block_n in configs:
                got = tp.decode_attention(*args, num_splits=splits, block_n=block_n, window=w)
                torch.testing.assert_close(got.float(), want.float(), atol=_atol(dtype), rtol=1e-3,
                                           msg=lambda m, c=(case, dtype, splits): f"{c}: {m}")


INTERP_CHECKS = {"prefill": _interp_prefill, "decode": _interp_decode}


@pytest.fixture(scope="module")
def interpreter(request: pytest.FixtureRequest) -> dict[str, str]:
    """The session's interpreter checks of this module, in one subprocess (tests/triton_interp.py)."""
    return interpreted_checks(__file__, selected(request, "check"))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("check", sorted(INTERP_CHECKS))
def test_triton_interpreter_window(interpreter: dict[str, str], check: str) -> None:
    """The Triton kernels' windowed paths under TRITON_INTERPRET=1 (fp32/fp16)."""
    assert interpreter[check] == "", interpreter[check]


if __name__ == "__main__":
    sys.exit(run_checks(INTERP_CHECKS, sys.argv[1:]))
