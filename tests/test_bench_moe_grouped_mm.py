"""bench/moe_candidate_kernels.py's torch._grouped_mm candidate (issue 40, bench/moe_candidates.py's "torch_gmm"),
on the CPU, where torch's fallback of _grouped_mm runs: its output against `moe_experts_ref` (expert counts, top-k
1 / 2 / 8, idle experts, one token; float32 and bfloat16), the grouping it hands _grouped_mm on a routing whose
groups are known, that the whole call runs on the meta device (so it reads nothing on the host and no shape depends
on the routing: what a CUDA graph capture needs), and where it says it is not measured."""

from __future__ import annotations

import pytest
import torch

from bench import moe_candidate_kernels as mck
from rapidserve.ops.moe import moe_experts_ref, route


def layer(e: int, h: int, i: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("e", "k", "t", "idle"), [
    (4, 1, 7, 0), (8, 2, 1, 0), (8, 2, 9, 3), (16, 8, 5, 0), (16, 8, 1, 4), (32, 8, 33, 8)])
def test_matches_the_reference(dtype: torch.dtype, e: int, k: int, t: int, idle: int) -> None:
    """The candidate's output equals the reference's (both from the same x and weights; the reference in float32)
    within the benchmark's tolerance, and much closer in float32; `idle` experts get no token (their logits
    -inf), the last ones at the end of `offs`, an empty group in the middle too where there are several."""
    w13, w2 = layer(e, 32, 16, dtype, seed=e * 100 + k * 10 + t)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 32, generator=g).to(dtype)
    logits = torch.randn(t, e, generator=g)
    if idle:
        logits[:, e - idle + 1:] = float("-inf")
        logits[:, 1] = float("-inf")  # an empty group between used ones
    weights, ids = route(logits, k, True)
    used = set(ids.unique().tolist())
    assert not idle or (1 not in used and len(used) <= e - idle)
    want = moe_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    cand = mck.grouped_mm("cpu", dtype)
    assert cand.run is not None and cand.name == "torch_gmm" and cand.why == ""
    got = cand.run(x, w13, w2, weights, ids)
    assert got.shape == (t, 32) and got.dtype == dtype
    err = float((got.float() - want).abs().max() / want.abs().max())
    assert err < (1e-5 if dtype == torch.float32 else 1.5e-2), err


def test_group_pairs_on_known_groups() -> None:
    """Pairs t * k + j sorted by expert, each expert's in pair order; offs the cumulative ends, int32, one per
    expert, repeated where an expert (1, 4) has none."""
    ids = torch.tensor([[2, 0], [0, 3], [3, 2]], dtype=torch.int32)
    order, offs = mck.group_pairs(ids, 5)
    assert order.tolist() == [1, 2, 0, 5, 3, 4]
    assert offs.dtype == torch.int32 and offs.tolist() == [2, 2, 4, 6, 6]
    many = torch.tensor([[5, 1, 5, 0]] * 4, dtype=torch.int32)  # more pairs of one expert than a sort's small case
    order, offs = mck.group_pairs(many, 7)
    assert order.tolist() == [3, 7, 11, 15, 1, 5, 9, 13, 0, 2, 4, 6, 8, 10, 12, 14]
    assert offs.tolist() == [4, 8, 8, 8, 8, 16, 16]


def test_no_host_reads() -> None:
    """The whole call on meta tensors (bfloat16, as CUDA's kernel; _grouped_mm's meta checks CUDA's dtype and
    16-byte strides): an op that read a value on the host (.item(), bincount's max, a nonzero) or sized its output
    by the routing would fail here; the output has the reference's shape and dtype."""
    e, h, i, t, k = 8, 64, 32, 6, 2
    w13 = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device="meta")
    w2 = torch.empty(e, h, i, dtype=torch.bfloat16, device="meta")
    x = torch.empty(t, h, dtype=torch.bfloat16, device="meta")
    weights = torch.empty(t, k, device="meta")
    ids = torch.empty(t, k, dtype=torch.int32, device="meta")
    out = mck.grouped_mm_experts(x, w13, w2, weights, ids)
    assert out.device.type == "meta" and out.shape == (t, h) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):  # the meta checks do run: 24-byte bf16 rows
        mck.grouped_mm_experts(x[:, :12], w13[..., :12], w2[:, :12], weights, ids)


def test_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not offered where _grouped_mm would not run its CUTLASS kernel (another GPU, float16), nor without it."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    old = mck.grouped_mm("cuda", torch.bfloat16)
    assert old.run is None and "sm_90 / sm_100 only (this GPU: sm_80)" in old.why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    hopper = mck.grouped_mm("cuda", torch.bfloat16)
    assert hopper.run is mck.grouped_mm_experts and hopper.describe is not None
    assert hopper.describe(1, 8, torch.empty(0), torch.empty(0)) == f"cutlass grouped (torch {torch.__version__})"
    half = mck.grouped_mm("cuda", torch.float16)
    assert half.run is None and half.why == "torch._grouped_mm runs CUTLASS in bfloat16 only (this run: float16)"
    monkeypatch.delattr(torch, "_grouped_mm")
    gone = mck.grouped_mm("cpu", torch.float32)
    assert gone.run is None and gone.why == f"torch {torch.__version__} has no _grouped_mm"
