"""Mixture-of-experts ops (issue 40): routing as transformers' Mixtral and Qwen3-MoE routers, the reference experts
against a token-by-token computation, the expert alignment's layout, and the fused Triton grouped GEMMs
(`ops/triton_moe.py`) against the reference: under the Triton interpreter on CPU (in a subprocess; fp32/fp16),
natively on a GPU in tests/test_moe_gpu.py.

Run as a script (``TRITON_INTERPRET=1 python tests/test_moe_ops.py [check ...]``) it performs the interpreter checks
(`interpreter_checks`: the fused experts and their variants, and the decode-size folds of ops/triton_moe_route.py and
ops/triton_moe.py: the Triton routing, split K, the top-k sum in the down GEMM's launch).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from triton_interp import interpreted_checks, run_checks, selected

from rapidserve.ops import get_ops, torch_ops_bundle
from rapidserve.ops.moe import align_block_size, max_padded, moe_experts_ref, moe_layer_ref, route
from rapidserve.ops.moe_tiles import ALL_M, GemmTiles, MoeKernelConfig, rule_config

HAS_TRITON = importlib.util.find_spec("triton") is not None
POISON = -7


def moe_inputs(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype = torch.float32, seed: int = 0,
               renormalize: bool = True, device: str = "cpu",
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [t, h], w13 [e, 2i, h], w2 [e, h, i], routing weights, ids) with activations O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    weights, ids = route(torch.randn(t, e, generator=g) * 2, k, renormalize)
    return (x.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device), weights.to(device),
            ids.to(device))


def naive_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """Token by token, slot by slot, in float64: the definition."""
    i = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(gu[:i]) * gu[i:]))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_transformers_routers(renormalize: bool) -> None:
    """Mixtral's router (always renormalised) and Qwen3-MoE's (norm_topk_prob) pick the same experts with the same
    weights; renormalised top-k is the softmax over the top-k logits."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    qwen = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import MixtralConfig, Qwen3MoeConfig

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(23, 32, generator=g), torch.randn(8, 32, generator=g)
    weights, ids = route(F.linear(x, w), 2, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (23, 2)
    if renormalize:
        ref = mixtral.MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2))
        ref.weight.data.copy_(w)
        _, want_w, want_ids = ref(x)
        top_logits = torch.gather(F.linear(x, w), 1, ids.long())
        torch.testing.assert_close(weights, torch.softmax(top_logits, -1))
    else:
        torch.testing.assert_close(weights, torch.gather(torch.softmax(F.linear(x, w), -1), 1, ids.long()))
    ref = qwen.Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2,
                                                 norm_topk_prob=renormalize))
    ref.weight.data.copy_(w)
    _, want_w, want_ids = ref(x)
    assert torch.equal(ids.long(), want_ids) and torch.equal(weights, want_w)


@pytest.mark.parametrize(("t", "e", "k"), [(1, 8, 2), (7, 16, 4), (30, 8, 1), (5, 4, 4)])
def test_reference_experts_are_the_definition(t: int, e: int, k: int) -> None:
    x, w13, w2, weights, ids = moe_inputs(t, e, k, 24, 40, seed=t)
    got = moe_experts_ref(x, w13, w2, weights, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), naive_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def check_alignment(ids: torch.Tensor, e: int, bm: int, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                    num_post: torch.Tensor) -> None:
    """The layout `ops.moe.Alignment` documents, checked from its definition."""
    flat = ids.reshape(-1).tolist()
    pairs, p = len(flat), max_padded(len(flat), e, bm)
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    assert sorted_ids.shape == (p,) and expert_ids.shape == (p // bm,) and num_post.shape == (1,)
    rows, blocks, total = sorted_ids.tolist(), expert_ids.tolist(), int(num_post)
    want_total = sum(-(-flat.count(x) // bm) * bm for x in range(e))
    assert total == want_total and total % bm == 0 and total <= p
    start = 0
    for x in range(e):  # expert by expert, in expert order, each run starting on a block
        mine = [n for n, v in enumerate(flat) if v == x]
        run = -(-len(mine) // bm) * bm
        assert rows[start:start + len(mine)] == mine  # its pairs in pair order
        assert rows[start + len(mine):start + run] == [pairs] * (run - len(mine))  # then the sentinel
        assert blocks[start // bm:(start + run) // bm] == [x] * (run // bm)
        start += run
    assert rows[total:] == [pairs] * (p - total) and blocks[total // bm:] == [-1] * ((p - total) // bm)


ALIGN_CASES = [(1, 8, 2, 16), (3, 128, 8, 16), (37, 8, 2, 16), (37, 8, 2, 64), (64, 16, 4, 32), (700, 8, 2, 64),
               (5, 4, 4, 16), (2, 3, 1, 32)]


@pytest.mark.parametrize(("t", "e", "k", "bm"), ALIGN_CASES)
def test_torch_alignment_layout(t: int, e: int, k: int, bm: int) -> None:
    _, _, _, _, ids = moe_inputs(t, e, k, 8, 8, seed=t + e)
    check_alignment(ids, e, bm, *align_block_size(ids, e, bm))


@pytest.mark.parametrize(("pairs", "e", "bm", "want"), [
    (2, 8, 16, 32),  # at most two experts have pairs: 2 + 2 * 15
    (16, 8, 16, 144),  # 16 + 8 * 15 = 136, rounded up to a block
    (1, 128, 16, 16),
    (8, 128, 16, 128),  # one decode token of Qwen3-30B-A3B: 8 experts, 8 + 8 * 15
    (65536, 128, 64, 65536 + 128 * 63 + 0),  # a long prefill: every expert may pad
])
def test_max_padded(pairs: int, e: int, bm: int, want: int) -> None:
    assert max_padded(pairs, e, bm) == want


def test_bundles_pick_the_experts_path() -> None:
    assert get_ops(torch.device("cpu")).moe_experts is moe_experts_ref
    assert torch_ops_bundle().moe_experts is moe_experts_ref
    if HAS_TRITON:
        from rapidserve.ops import triton_moe, triton_ops_bundle
        assert triton_ops_bundle(skinny=False).moe_experts is triton_moe.fused_moe
        assert triton_ops_bundle(skinny=True).moe_experts is triton_moe.fused_moe


@pytest.mark.parametrize(("pairs", "e", "want"), [(8, 128, (16, 64, 128)), (2, 8, (16, 64, 128)),
                                                  (256, 8, (32, 64, 64)), (16384, 8, (64, 128, 64)),
                                                  (65536, 128, (64, 128, 64))])
def test_tile_rule(pairs: int, e: int, want: tuple[int, int, int]) -> None:
    """The untuned rule (`moe_tiles.rule_config`): both GEMMs on the same tiles, m blocks fastest."""
    cfg = rule_config(pairs, e, hip=False)
    assert (cfg.block_m, cfg.gate_up.block_n, cfg.gate_up.block_k) == want
    assert cfg.down == cfg.gate_up and cfg.gate_up.group_m == ALL_M


@pytest.mark.parametrize(("pairs", "e", "want"), [(8, 128, (16, 64, 64, 4, 2)), (2, 8, (16, 64, 64, 4, 2)),
                                                  (256, 8, (32, 64, 64, 4, 2)), (16384, 8, (64, 128, 64, 8, 2))])
def test_tile_rule_on_rocm(pairs: int, e: int, want: tuple[int, ...]) -> None:
    """ROCm: decode's small runs step K by 64 (128 took one 4-wave workgroup a gfx942 CU, by its LDS: flagged by
    bench/amd_compile_check.py), and every tile has two stages."""
    assert rule_config(pairs, e, hip=True) == MoeKernelConfig.same(*want)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_moe_config_falls_back_to_the_rule_without_a_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """No packaged table names the CPU or the meta device: `moe_config` is the rule there (ROCm's on ROCm)."""
    from rapidserve.ops.triton_moe import moe_config

    for device in (torch.device("cpu"), torch.device("meta")):
        assert moe_config(8, 128, 768, 2048, torch.bfloat16, device) == rule_config(8, 128, hip=False)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert moe_config(256, 8, 64, 64, torch.float16, torch.device("meta")) == rule_config(256, 8, hip=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize(("mutate", "match"), [
    (lambda a: {**a, "x": a["x"].t()}, "contiguous last dim"),
    (lambda a: {**a, "w13": a["w13"][:, :-1]}, r"w13 must be a contiguous \[E, 2I, 24\]"),
    (lambda a: {**a, "w2": a["w2"][:, :, :-1].contiguous()}, r"w2 must be a contiguous \[8, 24, 40\]"),
    (lambda a: {**a, "x": a["x"].half()}, "same dtype"),
    (lambda a: {**a, "ids": a["ids"][:2]}, r"both be \[5, top_k\]"),
    (lambda a: {**a, "weights": a["weights"].half()}, "must be float32"),
])
def test_fused_moe_refuses_bad_inputs(mutate, match: str) -> None:  # noqa: ANN001 - a table of lambdas
    from rapidserve.ops.triton_moe import fused_moe

    x, w13, w2, weights, ids = moe_inputs(5, 8, 2, 24, 40)
    args = mutate({"x": x, "w13": w13, "w2": w2, "weights": weights, "ids": ids})
    with pytest.raises(ValueError, match=match):
        fused_moe(args["x"], args["w13"], args["w2"], args["weights"], args["ids"])


def check_fused(dtypes: list[torch.dtype], device: str) -> None:
    """`fused_moe` == `moe_experts_ref` (the same routing) over batch sizes, expert counts and all three tile
    configurations (decode runs of a few rows, prefill runs), through both alignment paths (one program up to
    ALIGN_ONE_PROGRAM pairs, two launches above), and with every token routed to one expert of 60 (top-1: one long
    run, the other experts empty); both alignment paths equal the torch one exactly (tests/test_moe_align.py)."""
    from test_moe_align import check_paths

    from rapidserve.ops.triton_moe import ALIGN_ONE_PROGRAM, fused_moe

    for t, e, k, bm in ALIGN_CASES[:-1]:
        _, _, _, _, ids = moe_inputs(t, e, k, 8, 8, seed=t + e, device=device)
        check_paths(ids, e, bm, (t, e, k, bm))
    cases = [(1, 8, 2, 64, 96, None), (1, 16, 4, 64, 32, None), (9, 8, 2, 48, 80, None), (40, 8, 2, 64, 64, None),
             (600, 8, 2, 32, 48, None),  # 1200 pairs: the two-launch alignment
             (33, 16, 4, 40, 24, MoeKernelConfig.same(32, 32, 32, 4, 2)),
             (70, 4, 2, 64, 64, MoeKernelConfig.same(64, 64, 32, 4, 2)),
             (3, 8, 2, 200, 72, MoeKernelConfig.same(16, 32, 64, 4, 2)),  # K and N not multiples of the tiles
             (5, 128, 8, 32, 24, MoeKernelConfig.same(16, 16, 32, 4, 2))]  # Qwen3's routing: runs of a pair or two
    for dtype in dtypes:
        for t, e, k, h, i, cfg in cases:
            x, w13, w2, weights, ids = moe_inputs(t, e, k, h, i, dtype, seed=t * e, device=device)
            if e == 128:  # 40 pairs over 128 experts: runs of one pair and of two (each its own padded block)
                runs = torch.bincount(ids.flatten().cpu(), minlength=e)
                assert set(runs[runs > 0].tolist()) == {1, 2}, runs
            got = fused_moe(x, w13, w2, weights, ids, cfg)
            want = moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
            assert got.dtype == dtype and got.shape == x.shape
            atol = 2e-5 if dtype == torch.float32 else (2e-2 if dtype == torch.bfloat16 else 4e-3)
            case = (t, e, k, dtype)
            torch.testing.assert_close(got.float(), want, atol=atol, rtol=2e-2,
                                       msg=lambda m, case=case: f"{case} {m}")
        x, w13, w2, weights, ids = moe_inputs(300, 60, 1, 32, 48, dtype, seed=3, device=device)
        ids = torch.full_like(ids, 41)
        assert ids.numel() > ALIGN_ONE_PROGRAM
        got = fused_moe(x, w13, w2, weights, ids, MoeKernelConfig.same(16, 32, 32, 4, 2))
        want = moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
        atol = 2e-5 if dtype == torch.float32 else (2e-2 if dtype == torch.bfloat16 else 4e-3)
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=2e-2)
        # an empty batch: nothing launched
        x, w13, w2, weights, ids = moe_inputs(0, 8, 2, 16, 16, dtype, device=device)
        assert fused_moe(x, w13, w2, weights, ids).shape == (0, 16)


def check_variants(dtypes: list[torch.dtype], device: str) -> None:
    """The kernels' variants give the same bits: the unmasked K loop (EVEN_K) and the masked one, and the program
    order (GROUP_M of 1, 4 with a short last group, and every m block in one); every output row written (the
    buffers start as NaN), the semaphores down sums the top-k rows with left zero (and reused by the next launch);
    per-GEMM tiles (gate|up and down on different ones) against the reference."""
    from rapidserve.ops.moe_tiles import GemmTiles
    from rapidserve.ops.triton_moe import align, fused_moe, launch_down, launch_gate_up

    for dtype in dtypes:
        x, w13, w2, weights, ids = moe_inputs(9, 8, 2, 64, 64, dtype, seed=5, device=device)
        al = align(ids, 8, 16)
        assert al.expert_ids.numel() == 9  # m blocks: 4 + 4 + 1 with GROUP_M 4
        sems = torch.zeros(9 * 2, dtype=torch.int32, device=device)  # 9 tokens x 2 column blocks of 32
        acts, outs = [], []
        for group_m, even_k in [(ALL_M, True), (ALL_M, False), (1, True), (4, True), (4, False)]:
            tiles = GemmTiles(32, 32, group_m, 4, 2)
            act = torch.full((18, 64), float("nan"), dtype=dtype, device=device)
            launch_gate_up(x, w13, act, al, 2, 16, tiles, even_k)
            out = torch.full((9, 64), float("nan"), dtype=dtype, device=device)
            launch_down(act, w2, out, weights.reshape(-1).contiguous(), al, 2, 16, tiles, even_k, sems)
            assert not sems.any()
            acts.append(act)
            outs.append(out)
        assert not outs[0].isnan().any()
        for i in range(1, len(outs)):
            assert torch.equal(acts[i], acts[0]) and torch.equal(outs[i], outs[0]), (dtype, i)
        want = moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
        atol = 2e-5 if dtype == torch.float32 else 4e-3
        torch.testing.assert_close(outs[0].float(), want, atol=atol, rtol=2e-2)
        split = MoeKernelConfig(16, GemmTiles(16, 64, 2, 4, 2), GemmTiles(64, 16, 1, 4, 3))
        torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, split).float(), want, atol=atol, rtol=2e-2)


def check_prefill_variants(dtypes: list[torch.dtype], device: str) -> None:
    """The prefill variants of ops/triton_moe_gemm.py against the pointer-load, one-program-a-tile launch: the weights
    by TMA descriptors, a persistent grid of 1 or 2 programs an SM (OFF_GPU_SMS "SMs" here: a few programs
    looping over many tiles), both; down's top-k sum in column chunks (REDUCE_N 32 of down's BLOCK_N 128, top-8
    of 16 experts) and whole. Bits equal everywhere but TMA in fp32, where the interpreter's matmul of the
    transposed tile rounds differently (close); every row written (NaN-poisoned outputs); a K tail (hidden 40
    over BLOCK_K 32) and an N that is no multiple of BLOCK_N (intermediate 24 over 16: the descriptor's box runs
    into the next expert's rows, not stored); rows of 12 bytes cannot take a descriptor (`use_tma` falls back).
    Then `fused_moe` on such tables against the reference."""
    from rapidserve.ops.triton_moe import align, fused_moe, launch_down, launch_gate_up
    from rapidserve.ops.triton_moe_gemm import reduce_width
    from rapidserve.ops.triton_moe_grid import grid_size, sm_count, use_tma

    for dtype in dtypes:
        for t, e, k, h, i, warps in [(9, 8, 2, 64, 64, 4), (11, 4, 2, 40, 24, 4), (6, 16, 8, 128, 32, 1)]:
            x, w13, w2, weights, ids = moe_inputs(t, e, k, h, i, dtype, seed=t + k, device=device)
            al = align(ids, e, 16)
            base = GemmTiles(16, 32, 4, warps, 2)
            down_base = base._replace(block_n=128, reduce_n=32 if k == 8 else 0)  # top-8: 4 chunks of 32 columns
            assert reduce_width(16, down_base, k) == (32 if k == 8 else 128)
            results = []
            # under the interpreter the first shape (no K or N tail, top-2) runs the base launch and TMA with a
            # persistent grid at once; the tails' and top-8's shapes (and a GPU, every shape) run each variant apart
            combos = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
            if (h, i) == (64, 64) and device == "cpu":
                combos = [(0, 0), (1, 1)]
            for tma, persistent in combos:
                tiles = base._replace(tma=tma, persistent=persistent)
                assert use_tma(tiles, w13) == bool(tma) and use_tma(tiles, w2) == bool(tma)
                down = down_base._replace(tma=tma, persistent=persistent)
                act = torch.full((t * k, i), float("nan"), dtype=dtype, device=device)
                launch_gate_up(x, w13, act, al, k, 16, tiles)
                out = torch.full((t, h), float("nan"), dtype=dtype, device=device)
                launch_down(act, w2, out, weights.reshape(-1).contiguous(), al, k, 16, down)
                results.append((tma, act, out))
            _, act0, out0 = results[0]
            assert not act0.isnan().any() and not out0.isnan().any()
            for tma, act, out in results[1:]:
                case = (dtype, t, e, k, tma)
                if tma and dtype == torch.float32:
                    _close_to(act, act0, case)
                    _close_to(out, out0, case)
                else:
                    assert torch.equal(act, act0) and torch.equal(out, out0), case
            _close_to(out0, moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids), (dtype, t, e, k))
            prefill = MoeKernelConfig(16, GemmTiles(16, 32, 2, warps, 2, 1, 1, 1),
                                      down_base._replace(group_m=2, tma=1))
            _close_to(fused_moe(x, w13, w2, weights, ids, prefill),
                      moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids), (dtype, t, e, k, "fused"))
        sms = sm_count(torch.device(device))  # OFF_GPU_SMS (3 "SMs": 6 programs, fewer than 36 tiles) off a GPU
        assert device != "cpu" or sms == 3
        assert grid_size(GemmTiles(16, 32, 4, 4, 2, 1, 0, 2), 9, 4, 1, torch.device(device)) == min(36, 2 * sms)
    x, w13, w2, _, _ = moe_inputs(2, 4, 2, 6, 8, torch.float16, device=device)  # rows of 6 halves: 12 bytes
    assert not use_tma(GemmTiles(16, 16, 1, 4, 2, 1, 1), w13)


def _close_to(got: torch.Tensor, want: torch.Tensor, what: object) -> None:
    atol = 2e-5 if got.dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=2e-2, msg=lambda m: f"{what}: {m}")


def check_route(device: str) -> None:
    """`triton_moe_route.route` and `route_align` (both paths) against `ops.moe.route` and `align_block_size`: the
    same ids, the weights to fp32 rounding; E not a power of two, k = 1 and k = E, tokens past one routing tile (40
    tokens of 128 experts: tiles of 32), bf16 logits (distinct: ties may order either way); the zeros written over a
    poisoned buffer on both paths."""
    from rapidserve.ops.triton_moe_route import route as triton_route
    from rapidserve.ops.triton_moe_route import route_align

    g = torch.Generator().manual_seed(0)
    for t, e, k, renorm, bf16 in [(1, 8, 2, True, False), (7, 6, 3, False, False), (5, 4, 4, True, False),
                                  (9, 16, 1, False, True), (40, 128, 2, True, True)]:
        logits = torch.randn(t, e, generator=g) * 3
        if bf16:  # sixteenths in [-4, 4): exact in bf16, no two alike in a row
            logits = ((torch.stack([torch.randperm(e, generator=g) for _ in range(t)]) - e // 2) / 16 * (64 / e))
            logits = logits.to(torch.bfloat16)
        logits = logits.to(device)
        want_w, want_ids = route(logits, k, renorm)
        got_w, got_ids = triton_route(logits, k, renorm)
        case = (t, e, k, renorm, logits.dtype)
        assert torch.equal(got_ids, want_ids), case
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
        for one_program in (True, False) if t in (7, 40) else ():
            zero = torch.full((37,), POISON, dtype=torch.int32, device=device)
            w, ids, al = route_align(logits, k, renorm, 16, zero, one_program)
            assert torch.equal(ids, want_ids) and not zero.any(), (case, one_program)
            torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)
            for name, a, b in zip(al._fields, al, align_block_size(want_ids, e, 16), strict=True):
                assert torch.equal(a, b), (case, one_program, name)


def check_split(device: str) -> None:
    """Split K in both GEMMs and the fused top-k sum against the reference: 5 tokens of top-2 over 4 experts (runs
    of a few tokens, none a multiple of BLOCK_M 16), hidden 40 (gate|up's second split ends in a K tail), down's K in
    2 splits; the standalone launches on one set of zeroed semaphores (left zero by each, so the next launch may take
    them) giving the bits of `fused_moe` (the sum's order is fixed); one slot with a split (down's fp32 partials, a
    sum of the splits only); a token sent twice to one expert (two rows of one run, counted by one vector atomic)."""
    from rapidserve.ops.triton_moe import align, fused_moe, launch_down, launch_gate_up

    split = MoeKernelConfig(16, GemmTiles(32, 16, 1, 4, 2, 2), GemmTiles(64, 16, 2, 4, 2, 2))
    x, w13, w2, weights, ids = moe_inputs(5, 4, 2, 40, 32, seed=2, device=device)
    got = fused_moe(x, w13, w2, weights, ids, split)
    _close_to(got, moe_experts_ref(x, w13, w2, weights, ids), "split")
    al = align(ids, 4, 16)
    sems = torch.zeros(5 * 1, dtype=torch.int32, device=device)  # down's: 5 tokens x 1 n block; gate|up's: 5 x 1 tiles
    act, out = torch.empty(10, 32, device=device), torch.empty(5, 40, device=device)
    launch_gate_up(x, w13, act, al, 2, 16, split.gate_up, sems=sems)
    assert not sems.any()  # as it was: the next launch may take it
    launch_down(act, w2, out, weights.reshape(-1), al, 2, 16, split.down, sems=sems)
    assert not sems.any() and torch.equal(out, got)
    x, w13, w2, weights, ids = moe_inputs(3, 4, 1, 32, 32, seed=4, device=device)
    _close_to(fused_moe(x, w13, w2, weights, ids, split), moe_experts_ref(x, w13, w2, weights, ids), "top-1")
    x, w13, w2, weights, ids = moe_inputs(3, 4, 2, 32, 32, seed=5, device=device)
    ids[1] = ids[1, 0]  # token 1: both slots on one expert
    _close_to(fused_moe(x, w13, w2, weights, ids, split), moe_experts_ref(x, w13, w2, weights, ids), "twice")


def check_routed(device: str) -> None:
    """`routed_moe` (routing in the kernels) against `moe_layer_ref` (the torch routing, then the reference): a
    decode size (one program) with split K, and 70 tokens of top-2 (140 pairs: the routing launch, then the
    two-launch alignment); no tokens."""
    from rapidserve.ops.triton_moe import routed_moe

    split = MoeKernelConfig(16, GemmTiles(32, 16, 1, 4, 2, 2), GemmTiles(32, 16, 1, 4, 2, 2))
    for t, e, k, renorm, cfg in [(3, 6, 3, False, split), (70, 4, 2, True, MoeKernelConfig.same(64, 32, 32, 4, 2))]:
        x, w13, w2, _, _ = moe_inputs(t, e, k, 32, 32, seed=t, device=device)
        logits = (torch.randn(t, e, generator=torch.Generator().manual_seed(t)) * 2).to(device)
        got = routed_moe(x, logits, w13, w2, k, renorm, cfg)
        _close_to(got, moe_layer_ref(x, logits, w13, w2, k, renorm), (t, e, k, renorm, cfg))
    x, w13, w2, _, _ = moe_inputs(0, 8, 2, 16, 16, device=device)
    assert routed_moe(x, torch.zeros(0, 8, device=device), w13, w2, 2, True).shape == (0, 16)


def interpreter_checks() -> dict[str, Callable[[], None]]:
    """The Triton kernels' checks on CPU (fp32 and fp16 where the dtype matters), run by name in one subprocess."""
    both = [torch.float32, torch.float16]
    return {"fused": lambda: check_fused(both, "cpu"), "variants": lambda: check_variants(both, "cpu"),
            "prefill_variants": lambda: check_prefill_variants(both, "cpu"), "route": lambda: check_route("cpu"),
            "split": lambda: check_split("cpu"), "routed": lambda: check_routed("cpu")}


@pytest.fixture(scope="module")
def interpreted(request: pytest.FixtureRequest) -> dict[str, str]:
    return interpreted_checks(__file__, selected(request, "check"), timeout=900)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("check", ["fused", "variants", "prefill_variants", "route", "split", "routed"])
def test_fused_moe_interpreter(interpreted: dict[str, str], check: str) -> None:
    """The alignment kernel, both grouped GEMMs (and their variants: TMA, persistent grids, the chunked top-k sum),
    the routing kernels, split K and the fused top-k sum under TRITON_INTERPRET=1."""
    assert interpreted[check] == "", interpreted[check]


if __name__ == "__main__":
    sys.exit(run_checks(interpreter_checks(), sys.argv[1:]))
