"""The fused MoE layer's launches (issue 40): the split-K plan and the semaphores of `ops/triton_moe.py`
(`ops/moe_plan.py`) as pure functions, and the launches of one MoE block counted on meta tensors (no GPU, no kernel
run): the router's GEMM and three Triton launches at decode sizes (`ops/triton_moe_route.py` routes and aligns in
one). The kernels themselves are checked against the torch reference in tests/test_moe_ops.py (interpreter) and
tests/test_moe_gpu.py."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rapidserve.ops.moe import route
from rapidserve.ops.moe_plan import semaphores, split_plan
from rapidserve.ops.moe_tiles import GemmTiles, MoeKernelConfig

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.mark.parametrize(("k", "block_k", "split_k", "rows", "width", "want"), [
    (768, 128, 1, 8, 2048, (1, 768)),  # no field: one program a tile, as before
    (768, 128, 2, 8, 2048, (2, 384)),  # Qwen3-30B-A3B's down at batch 1
    (768, 128, 4, 8, 2048, (3, 256)),  # 6 steps in 4 parts: 2 steps each, so 3 parts
    (768, 128, 6, 8, 2048, (6, 128)),
    (2048, 128, 4, 8, 1536, (4, 512)),  # its gate|up
    (100, 32, 3, 5, 40, (2, 64)),  # a K tail: 4 steps, 2 a part
    (768, 128, 2, 65536, 2048, (1, 768)),  # 2 x 512 MiB of partial sums: past SPLIT_SCRATCH_BYTES, no split
])
def test_split_plan(k: int, block_k: int, split_k: int, rows: int, width: int, want: tuple[int, int]) -> None:
    got = split_plan(k, GemmTiles(64, block_k, 1, 4, 3, split_k), rows, width)
    assert tuple(got) == want
    assert (got.splits - 1) * got.k_split < k <= got.splits * got.k_split and got.k_split % block_k == 0


@pytest.mark.parametrize(("tokens", "top_k", "gate_up_split", "down_split", "want"), [
    (1, 8, 1, 1, (0, 1 * 2048 // 64)),  # the top-k sum: one a (token, n block)
    (1, 1, 1, 1, (0, 0)),  # one slot, no split: down stores the token's row, nothing counted
    (1, 1, 1, 2, (0, 2048 // 64)),
    (3, 8, 2, 1, (24 * 768 // 64, 3 * 2048 // 64)),  # 24 pairs: 24 + 24 x 15 = 384 padded rows, 24 m blocks
])
def test_semaphores(tokens: int, top_k: int, gate_up_split: int, down_split: int, want: tuple[int, int]) -> None:
    cfg = MoeKernelConfig(16, GemmTiles(64, 128, 1, 4, 3, gate_up_split), GemmTiles(64, 128, 1, 4, 3, down_split))
    assert semaphores(cfg, tokens, top_k, 128, 768, 2048) == want


class _Ops(TorchDispatchMode):
    """The aten ops that would launch a GPU kernel (views and allocations left out)."""

    FREE = frozenset({"empty", "empty_strided", "view", "t", "_unsafe_view", "reshape", "slice", "select",
                      "as_strided", "transpose", "expand", "unsqueeze", "detach", "alias", "split", "lift_fresh"})

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._opname not in self.FREE:
            self.ops.append(func._opname)
        return func(*args, **(kwargs or {}))


@contextmanager
def counted() -> Iterator[tuple[list[str], list[str]]]:
    """(torch ops, Triton kernels) launched within: the MoE kernels record instead of running (meta tensors)."""
    from rapidserve.ops import triton_moe_align, triton_moe_gemm, triton_moe_route

    kernels: list[str] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: object) -> Callable[..., None]:
            return lambda *args, **kwargs: kernels.append(self.name)

    with mock.patch.multiple(triton_moe_route, _route_align_kernel=Recorder("route_align"),
                             _route_kernel=Recorder("route")), \
            mock.patch.multiple(triton_moe_align, _align_one_kernel=Recorder("align_one"),
                                _align_count_kernel=Recorder("align_count"),
                                _align_scatter_kernel=Recorder("align_scatter")), \
            mock.patch.multiple(triton_moe_gemm, _gate_up_kernel=Recorder("gate_up"), _down_kernel=Recorder("down")), \
            _Ops() as ops:
        yield ops.ops, kernels


@needs_triton
@pytest.mark.parametrize(("tokens", "want_kernels"), [
    (1, ["route_align", "gate_up", "down"]),  # decode: routing + alignment + zeroed semaphores in one launch
    (16, ["route_align", "gate_up", "down"]),  # 128 pairs: still one program
    (17, ["route", "align_count", "align_scatter", "gate_up", "down"]),  # above: the routing, then two
])
def test_one_moe_layer_launches(tokens: int, want_kernels: list[str]) -> None:
    """The MoE block of a decoder layer (Qwen3-30B-A3B's shape, top-8 of 128) with the Triton bundle, on meta tensors:
    the router's GEMM, then only the Triton kernels above (no softmax, top-k, division, cast, sum or memset of
    torch's); the torch routing it replaces was six launches (`ops.moe.route`: the float cast, softmax, top-k, sum,
    division, int cast) and the top-k sum a seventh."""
    from rapidserve.models.moe import MoeBlock
    from rapidserve.moe_config import MoeConfig
    from rapidserve.ops import triton_ops_bundle

    meta = torch.device("meta")
    block = MoeBlock(MoeConfig(num_experts=128, top_k=8, intermediate_size=768, renormalize=True), 2048,
                     torch.bfloat16, meta)
    x = torch.empty(tokens, 2048, dtype=torch.bfloat16, device=meta)
    with counted() as (ops, kernels):
        out = block(x, triton_ops_bundle(skinny=False))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert ops == ["mm"] and kernels == want_kernels
    with _Ops() as before:
        route(torch.empty(tokens, 128, dtype=torch.bfloat16, device=meta), 8, True)
    assert len(before.ops) == 6, before.ops


@needs_triton
@pytest.mark.parametrize(("tiles", "m_blocks", "n_blocks", "splits", "sms", "want"), [
    (GemmTiles(128, 64, 8, 4, 4), 192, 6, 1, 132, 192 * 6),  # one program a tile
    (GemmTiles(128, 64, 8, 4, 4, 2), 24, 6, 2, 132, 24 * 6 * 2),  # a tile's splits each
    (GemmTiles(128, 64, 8, 4, 4, 1, 0, 1), 192, 6, 1, 132, 132),  # persistent: one an SM
    (GemmTiles(128, 64, 8, 4, 3, 1, 1, 2), 1150, 8, 1, 132, 264),  # two an SM
    (GemmTiles(128, 64, 8, 4, 3, 1, 1, 2), 40, 3, 1, 132, 120),  # at most the tiles
    (GemmTiles(128, 64, 8, 4, 3, 2, 0, 1), 40, 3, 2, 132, 240),  # split K: not persistent (a table refuses both)
])
def test_grid_size(tiles: GemmTiles, m_blocks: int, n_blocks: int, splits: int, sms: int, want: int,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    from rapidserve.ops import triton_moe_grid

    monkeypatch.setattr(triton_moe_grid, "sm_count", lambda device: sms)
    assert triton_moe_grid.grid_size(tiles, m_blocks, n_blocks, splits, torch.device("meta")) == want


@needs_triton
@pytest.mark.parametrize(("block_m", "tiles", "top_k", "want"), [
    (64, GemmTiles(256, 64, 8, 8, 4), 8, 256),  # Qwen3-30B-A3B's prefill down: 512 elements a thread, whole
    (64, GemmTiles(256, 64, 8, 8, 4, reduce_n=128), 8, 128),  # a table's REDUCE_N: halves
    (128, GemmTiles(256, 64, 8, 8, 4), 8, 128),  # BLOCK_M 128: 1024 elements a thread, halves of 512
    (128, GemmTiles(256, 64, 8, 4, 4), 8, 64),  # on 4 warps: quarters
    (128, GemmTiles(256, 64, 8, 8, 4), 2, 256),  # Mixtral's top-2: whole (256 a thread)
    (16, GemmTiles(128, 128, 8, 4, 4), 8, 128),  # decode tiles: whole, as before
    (128, GemmTiles(16, 64, 8, 1, 4), 8, 16),  # never below 16 columns
])
def test_reduce_width(block_m: int, tiles: GemmTiles, top_k: int, want: int) -> None:
    """down's top-k sum takes a table's REDUCE_N columns at a time, else its tile's columns whole unless its partial
    tiles are more than REDUCE_ELEMS elements a thread at once (`triton_moe_gemm.reduce_width`)."""
    from rapidserve.ops.triton_moe_gemm import REDUCE_ELEMS, reduce_width

    assert REDUCE_ELEMS == 512 and reduce_width(block_m, tiles, top_k) == want


@needs_triton
def test_tma_only_where_the_rows_and_platform_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    """`use_tma`: the tiles ask, rows of 16-byte multiples (bf16 K a multiple of 8) at an aligned base, NVIDIA at
    compute capability 9.0 or later, not ROCm."""
    from rapidserve.ops.triton_moe_grid import use_tma

    tma, plain = GemmTiles(128, 64, 8, 4, 4, 1, 1), GemmTiles(128, 64, 8, 4, 4)
    w = torch.empty(8, 1536, 2048, dtype=torch.bfloat16)
    assert use_tma(tma, w) and not use_tma(plain, w)
    assert not use_tma(tma, torch.empty(8, 16, 36, dtype=torch.bfloat16))  # 72-byte rows
    assert not use_tma(tma, torch.empty(8 * 16 * 64 + 1, dtype=torch.bfloat16)[1:].view(8, 16, 64))  # base + 2 bytes
    on_gpu = mock.Mock(wraps=w, device=torch.device("cuda"), shape=w.shape)  # the capability asked of its device
    on_gpu.element_size.return_value, on_gpu.data_ptr.return_value = 2, 0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert use_tma(tma, on_gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # A100: no TMA
    assert not use_tma(tma, on_gpu)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert not use_tma(tma, w)
