"""Split-K of decode's skinny fp8 GEMM (ops/triton_fp8_skinny.py, issue 39): how K is cut into slices
(`split_slices`), the reduce kernel's tile (`reduce_tile`), and, under the Triton interpreter (in a subprocess), every
tile family with several split factors against the float32 reference: 1-64 rows, K not a multiple of
split_k x BLOCK_K (a short last slice, and split factors that leave fewer slices than asked), N tails, a bias, the
weights in e4m3fn and in ROCm's e4m3fnuz. On the GPU: tests/test_fp8_gpu.py.

Run as a script (``TRITON_INTERPRET=1 python tests/test_fp8_splitk.py``) it performs the interpreter checks.
"""

from __future__ import annotations

import sys

import pytest
import torch
from triton_interp import interpreted_checks, run_checks, selected_by_test

from rapidserve.ops import fp8
from rapidserve.ops.fp8_tiles import Fp8Tiles

pytest.importorskip("triton")

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


@pytest.mark.parametrize(("k", "bk", "split", "want"), [
    (4096, 256, 1, (4096, 1)),  # no split-K: the whole of K, one launch
    (4096, 256, 4, (1024, 4)),  # q|k|v, o: four slices of four K steps
    (12288, 256, 3, (4096, 3)),  # down
    (12288, 512, 8, (1536, 8)),
    (4096, 512, 3, (1536, 3)),  # 4096 / 3 rounded up to whole K steps: 1536 + 1536 + 1024
    (200, 32, 3, (96, 3)),  # K not a multiple of split x BLOCK_K: 96 + 96 + 8
    (160, 32, 4, (64, 3)),  # 40 a slice rounds up to a 64-long one: three slices, not four
    (224, 32, 8, (32, 7)),
    (96, 128, 4, (128, 1)),  # one K step: one slice (no reduce kernel)
])
def test_split_slices(k: int, bk: int, split: int, want: tuple[int, int]) -> None:
    from rapidserve.ops.triton_fp8_skinny import split_slices

    k_per, splits = split_slices(k, Fp8Tiles(16, 64, bk, 4, 3, False, split))
    assert (k_per, splits) == want
    assert k_per % bk == 0 and (splits - 1) * k_per < k <= splits * k_per  # whole steps, none empty, all of K


@pytest.mark.parametrize(("rows", "want"), [(1, (1, 1024)), (3, (4, 256)), (16, (16, 64)), (33, (16, 64)),
                                            (64, (16, 64))])
def test_reduce_tile(rows: int, want: tuple[int, int]) -> None:
    from rapidserve.ops.triton_fp8_skinny import reduce_tile

    assert reduce_tile(rows) == want


INTERP_TESTS = {"split": "test_split_k_interpreter"}  # check -> test


@pytest.fixture(scope="module")
def interpreter(request: pytest.FixtureRequest) -> dict[str, str]:
    """The module's interpreter checks, in one subprocess (tests/triton_interp.py)."""
    return interpreted_checks(__file__, selected_by_test(request, INTERP_TESTS), timeout=600)


def test_split_k_interpreter(interpreter: dict[str, str]) -> None:
    """Split-K launches under TRITON_INTERPRET=1 against the reference, e4m3fn and e4m3fnuz (check_split)."""
    assert interpreter["split"] == "", interpreter["split"]


# (rows, N, K, tiles, weight format): each family (16-row tile: mma.sync on the GPU; swapped order and 64-row tiles:
# wgmma) with split factors 2, 3, 4 and 8, its weights in e4m3fn or ROCm's e4m3fnuz; K tails (200, 520: masked K
# loads), a K multiple of BLOCK_K whose last slice is short (160, 224, 96: unmasked weight loads), split factors that
# leave fewer slices than asked (160 / 4, 224 / 8), N tails (40, 48 of 32-wide tiles). Kept small: the interpreter
# runs every program in Python (about 3 s for these five on 2 cores).
SPLIT_CASES = (
    (1, 48, 200, Fp8Tiles(16, 32, 32, 4, 2, False, 3), FN),
    (3, 64, 160, Fp8Tiles(16, 64, 32, 4, 2, True, 4), FNUZ),
    (16, 40, 520, Fp8Tiles(16, 32, 64, 4, 2, False, 2), FN),
    (33, 32, 224, Fp8Tiles(64, 32, 32, 4, 2, False, 8), FNUZ),
    (64, 64, 96, Fp8Tiles(64, 64, 32, 4, 2, True, 2), FN),
)


def check_split() -> None:
    """Each SPLIT_CASES launch (`skinny_fp8_linear_rows`: the split kernel, then the reduce kernel) equals the float32
    reference on the same fp8 rows (`reference_linear_rows`) up to the float16 output's rounding, with a bias on
    every other case."""
    from rapidserve.ops import triton_fp8_skinny
    from rapidserve.ops.triton_fp8_skinny import split_slices

    g = torch.Generator().manual_seed(5)
    for i, (m, n, k, tiles, dt) in enumerate(SPLIT_CASES):
        assert split_slices(k, tiles)[1] > 1, tiles  # each case runs the two kernels
        w = torch.randn(n, k, generator=g) / k**0.5
        layer = fp8.Fp8Linear(n, k, dt, "token", None, torch.device("cpu"))
        w8, s = fp8.quantize_weight(w, "channel", None, dt)
        layer.weight.copy_(w8)
        layer.weight_scale.copy_(s)
        # float16 rows: the interpreter's tl.dot is wrong in bfloat16 (as tests/test_fp8_ops.py)
        x = torch.randn(m, k, generator=g).to(torch.float16)
        rows = fp8.QuantizedRows(*fp8.quantize_input(x.float(), "token", dt), torch.float16)
        bias = torch.randn(n, generator=g).to(torch.float16) if i % 2 else None
        want = fp8.reference_linear_rows(rows._replace(dtype=torch.float32), layer,
                                         None if bias is None else bias.float())
        got = triton_fp8_skinny.skinny_fp8_linear_rows(rows, layer.weight, layer.weight_scale, bias, config=tiles)
        assert got.dtype == torch.float16 and got.shape == (m, n)
        err = float((got.float() - want).abs().max())
        assert err <= 4e-3 + 2e-3 * float(want.abs().max()), (dt, tiles.label(), err)


if __name__ == "__main__":
    sys.exit(run_checks({"split": check_split}, sys.argv[1:]))
