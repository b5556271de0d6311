"""The tail blocks of the fused MoE GEMMs (issue 40; a tile table's TAIL_BLOCK_M, `ops.moe.TailBlocks`): each
expert's full BLOCK_M tiles in a first launch of each GEMM, the rest of its rows in blocks of TAIL_BLOCK_M in a
second. The alignment's block lists against `tail_blocks_ref` (poisoned buffers, one- and many-program counts,
`route_align` too), and both GEMMs with the lists against the one-launch pointer path on ragged expert row counts
(an expert with no rows, exactly BLOCK_M, BLOCK_M + 1, fewer than TAIL_BLOCK_M, 2 x BLOCK_M - 1): the same bits,
and the reference; down's top-k sum spanning the two launches (top-2 and top-8, split K, TMA and a persistent grid),
top-1 (no sum), `fused_moe` / `routed_moe` under such a config. Under the Triton interpreter on CPU, in a subprocess.

Run as a script (``TRITON_INTERPRET=1 python tests/test_moe_tail.py [check ...]``) it performs the interpreter checks.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

import pytest
import torch
from test_moe_ops import _close_to, moe_inputs
from triton_interp import interpreted_checks, run_checks, selected

from rapidserve.ops.moe import align_block_size, max_padded, moe_experts_ref, tail_blocks_ref, tail_capacity
from rapidserve.ops.moe_plan import semaphores
from rapidserve.ops.moe_tiles import GemmTiles, MoeKernelConfig

HAS_TRITON = importlib.util.find_spec("triton") is not None
POISON = -7


def ragged_ids(counts: list[int], top_k: int, seed: int) -> torch.Tensor:
    """Expert ids [T, top_k] int32 with exactly counts[e] pairs of expert e (sum(counts) = T x top_k): the experts
    listed count times each fill slot 0 of every token, then slot 1, ..., the tokens in a random order (a token may
    meet one expert twice: the kernels allow it)."""
    flat = torch.tensor([e for e, c in enumerate(counts) for _ in range(c)], dtype=torch.int32)
    t = flat.numel() // top_k
    assert t * top_k == flat.numel()
    order = torch.randperm(t, generator=torch.Generator().manual_seed(seed))
    return flat.view(top_k, t)[:, order].t().contiguous()  # slot j of token i: the (j * T + order[i])-th


def test_ragged_ids() -> None:
    ids = ragged_ids([3, 0, 5, 2], 2, 0)
    assert ids.shape == (5, 2) and torch.bincount(ids.flatten().long(), minlength=4).tolist() == [3, 0, 5, 2]


@pytest.mark.parametrize(("pairs", "experts", "block_m", "tail_m"), [
    (1, 8, 32, 16), (5, 8, 64, 16), (513, 8, 128, 16), (2049, 128, 128, 32), (32768, 128, 128, 16),
    (65536, 128, 128, 32), (8192, 8, 64, 32)])
def test_tail_capacity_bounds_any_routing(pairs: int, experts: int, block_m: int, tail_m: int) -> None:
    """The lists' capacities hold the blocks of any routing: the full tiles of every expert's tail-padded run fit
    the tail-padded rows; at most block_m / tail_m - 1 tail blocks an expert that has pairs; one at least."""
    n_main, n_tail = tail_capacity(pairs, experts, block_m, tail_m)
    assert n_main >= 1 and n_tail >= 1
    per = block_m // tail_m
    for counts in ([pairs] + [0] * (experts - 1), [pairs // experts + (e < pairs % experts) for e in range(experts)],
                   [per * tail_m - 1] * (pairs // (per * tail_m - 1)) + [pairs % (per * tail_m - 1)]):
        blocks = [-(-c // tail_m) for c in counts[:max(experts, 1)]]
        assert sum(b // per for b in blocks) <= n_main
        assert sum(b % per for b in blocks) <= n_tail
    assert n_main * block_m <= max(max_padded(pairs, experts, tail_m), block_m)


def test_semaphores_cover_the_larger_list() -> None:
    """gate|up's split-K semaphores with TAIL_BLOCK_M: one a tile of the larger of its two launches (they reuse them,
    each leaving them zero); down's are per token, shared by both launches."""
    split = GemmTiles(64, 128, 1, 4, 3, 2)
    cfg = MoeKernelConfig(128, split, split, 16)
    n_main, n_tail = tail_capacity(256 * 8, 128, 128, 16)  # 2048 pairs: split K within its scratch bound
    assert n_tail > n_main
    assert semaphores(cfg, 256, 8, 128, 768, 2048) == (n_tail * 12, 256 * 32)
    assert semaphores(cfg._replace(tail_m=0), 256, 8, 128, 768, 2048) == (max_padded(2048, 128, 128) // 128 * 12,
                                                                          256 * 32)


def test_experts_refuses_a_tail_config_without_its_lists() -> None:
    """`experts` under a TAIL_BLOCK_M takes the lists (its semaphores are sized for their launches: gate|up's for the
    larger list, fewer than one launch at BLOCK_M over the same pairs needs), and without one takes none."""
    from rapidserve.ops.moe import align_block_size
    from rapidserve.ops.triton_moe import experts

    x, w13, w2, weights, ids = moe_inputs(64, 8, 2, 32, 32)
    tiles = GemmTiles(32, 16, 4, 4, 2)
    cfg = MoeKernelConfig(32, tiles, tiles, 16)
    sems = torch.zeros(sum(semaphores(cfg, 64, 2, 8, 32, 32)), dtype=torch.int32)
    with pytest.raises(ValueError, match="TAIL_BLOCK_M 16 needs the block lists"):
        experts(x, w13, w2, weights, align_block_size(ids, 8, 32), 2, cfg, sems)
    with pytest.raises(ValueError, match="TAIL_BLOCK_M 0 needs"):
        experts(x, w13, w2, weights, align_block_size(ids, 8, 16), 2, cfg._replace(tail_m=0), sems, None,
                tail_blocks_ref(ids, 8, 32, 16))


# (counts an expert, top_k, BLOCK_M, TAIL_BLOCK_M): ragged runs: none, exactly BLOCK_M, BLOCK_M + 1, fewer than the
# tail block, 2 x BLOCK_M - 1, a multiple of the tail block
RAGGED = [([32, 0, 33, 5, 63, 16, 1, 10], 2, 32, 16),
          ([64, 0, 65, 3, 127, 32, 17, 4], 8, 64, 16),
          ([0, 64, 1, 95, 32, 0, 20, 4], 1, 64, 32)]


def check_lists() -> None:
    """`align_tails` (the two-launch alignment at the tail block, writing the lists) into poisoned buffers: the
    alignment equal to `align_block_size` at the tail block, the lists to `tail_blocks_ref`; one program and many
    (2049 pairs over 128 experts: 33 programs, each a share of the lists); `route_align` with lists; no pairs."""
    from rapidserve.ops.triton_moe_align import align_into, empty_alignment, empty_tails
    from rapidserve.ops.triton_moe_route import route_align

    cases = [(ragged_ids(c, k, i), len(c), bm, tm) for i, (c, k, bm, tm) in enumerate(RAGGED)]
    g = torch.Generator().manual_seed(7)
    cases += [(torch.randint(0, 128, (2049, 1), generator=g, dtype=torch.int32), 128, 128, 16),
              (torch.randint(0, 8, (700, 2), generator=g, dtype=torch.int32), 8, 128, 32),
              (torch.full((300, 1), 5, dtype=torch.int32), 8, 64, 16)]
    for ids, e, bm, tm in cases:
        pairs = ids.numel()
        out = empty_alignment(pairs, e, tm, ids.device)
        tails = empty_tails(pairs, e, bm, tm, ids.device)
        for buf in (*out, *tails[:5]):
            buf.fill_(POISON)
        align_into(ids, e, tm, out, zero=None, tails=tails)
        want = align_block_size(ids, e, tm)
        assert all(torch.equal(a, b) for a, b in zip(out, want, strict=True)), (e, pairs, bm, tm)
        ref = tail_blocks_ref(ids, e, bm, tm)
        for name, a, b in zip(ref._fields, tails[:5], ref[:5], strict=False):
            assert torch.equal(a, b), (name, e, pairs, bm, tm, a, b)
    ids, e, bm, tm = cases[0]
    logits = torch.randn(ids.shape[0], e, generator=g)
    tails = empty_tails(ids.numel(), e, bm, tm, ids.device)
    _, got_ids, al = route_align(logits, ids.shape[1], True, tm, tails=tails)
    assert all(torch.equal(a, b) for a, b in zip(al, align_block_size(got_ids, e, tm), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(tails[:5], tail_blocks_ref(got_ids, e, bm, tm)[:5], strict=True))
    tails = empty_tails(0, 8, 64, 16, ids.device)
    align_into(torch.zeros(0, 2, dtype=torch.int32), 8, 16, empty_alignment(0, 8, 16, ids.device), tails=tails)
    assert tails.counts.tolist() == [0, 0] and (tails.main_experts == -1).all() and (tails.tail_experts == -1).all()


def _within_ulps(got: torch.Tensor, want: torch.Tensor, what: object, ulps: int = 2) -> None:
    """`got` equals `want` to `ulps` units in the last place of their dtype (relative to the tensor's largest value).
    The same bits held on the Triton interpreter until torch 2.13 / Triton 3.9 (2026-12-02): the interpreter computes
    tl.dot with the host's matmul, whose blocking now varies with the tile's rows, so a row computed in a 16-row tail
    block and in a 32-row block may differ by one ulp (seen: fp32 1.2e-7 to 1.4e-6, fp16 one ulp of 3.56); the GPU's
    kernels run each tile's dot alike."""
    eps = torch.finfo(want.dtype).eps
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=ulps * eps, atol=ulps * eps * max(scale, 1.0),
                               msg=lambda m: f"{what}: {m}")


def check_gemms(dtypes: list[torch.dtype]) -> None:
    """Both GEMMs with the lists (`launch_gate_up` / `launch_down`, tails=) against the one-launch pointer path at
    BLOCK_M on the RAGGED runs, NaN-poisoned outputs: the same numbers (a row's products and a token's top-k sum,
    in slot order, do not depend on the launch that computed them; to two ulps on the interpreter, `_within_ulps`),
    and the reference; the variants on the lists: split K in both GEMMs (gate|up's semaphores reused by its two
    launches, down's spanning them), and TMA on a persistent grid (fp32 under TMA: close, as in test_moe_ops); then
    `fused_moe` and `routed_moe` with TAIL_BLOCK_M."""
    from rapidserve.ops.triton_moe import align, align_tails, fused_moe, launch_down, launch_gate_up, routed_moe

    for dtype in dtypes:
        for i, (counts, k, bm, tm) in enumerate(RAGGED):
            e = len(counts)
            ids = ragged_ids(counts, k, i)
            t = ids.shape[0]
            x, w13, w2, weights, _ = moe_inputs(t, e, k, 32, 32, dtype, seed=i)
            flat = weights.reshape(-1).contiguous()
            base = GemmTiles(32, 16, 4, 4, 2)
            results = []
            for name, tiles, tails in [("base", base, False), ("tails", base, True),
                                       ("split", base._replace(split_k=2), True),
                                       ("tma persistent", base._replace(tma=1, persistent=1), True)]:
                sems = torch.zeros(4096, dtype=torch.int32)
                if tails:
                    al, tb = align_tails(ids, e, bm, tm)
                else:
                    al, tb = align(ids, e, bm), None
                act = torch.full((t * k, 32), float("nan"), dtype=dtype)
                out = torch.full((t, 32), float("nan"), dtype=dtype)
                launch_gate_up(x, w13, act, al, k, bm, tiles, sems=sems, tails=tb)
                assert not sems.any(), name
                launch_down(act, w2, out, flat, al, k, bm, tiles, sems=sems, tails=tb)
                assert not sems.any(), name
                assert not act.isnan().any() and not out.isnan().any(), name
                results.append((name, act, out))
            _, act0, out0 = results[0]
            for name, act, out in results[1:]:
                case = (dtype, counts, name)
                if name == "tails" or (name == "tma persistent" and dtype != torch.float32):
                    _within_ulps(act, act0, case)
                    _within_ulps(out, out0, case)
                else:  # split K: fp32 partial sums in another order; TMA in fp32: the interpreter's transposed matmul
                    _close_to(act, act0, case)
                    _close_to(out, out0, case)
            _close_to(out0, moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids), (dtype, counts))
            cfg = MoeKernelConfig(bm, base, base._replace(block_n=16), tm)
            ref = moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
            _close_to(fused_moe(x, w13, w2, weights, ids, cfg), ref, (dtype, counts, "fused"))
    x, w13, w2, _, _ = moe_inputs(70, 4, 2, 32, 32, seed=3)
    logits = torch.randn(70, 4, generator=torch.Generator().manual_seed(3)) * 2
    cfg = MoeKernelConfig(32, GemmTiles(32, 16, 4, 4, 2), GemmTiles(32, 16, 4, 4, 2), 16)
    plain = routed_moe(x, logits, w13, w2, 2, True, cfg._replace(tail_m=0))
    assert torch.equal(routed_moe(x, logits, w13, w2, 2, True, cfg), plain)


def interpreter_checks() -> dict[str, Callable[[], None]]:
    return {"lists": check_lists, "gemms": lambda: check_gemms([torch.float32, torch.float16])}


@pytest.fixture(scope="module")
def interpreted(request: pytest.FixtureRequest) -> dict[str, str]:
    return interpreted_checks(__file__, selected(request, "check"), timeout=900)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("check", ["lists", "gemms"])
def test_moe_tail_interpreter(interpreted: dict[str, str], check: str) -> None:
    """The block lists and both GEMMs on them under TRITON_INTERPRET=1."""
    assert interpreted[check] == "", interpreted[check]


if __name__ == "__main__":
    sys.exit(run_checks(interpreter_checks(), sys.argv[1:]))
