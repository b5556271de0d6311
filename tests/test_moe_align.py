"""The Triton expert alignment of the fused MoE layer (issue 40, `ops/triton_moe_align.py`): its two paths (one
program; per-block counts then the scatter) against `ops.moe.align_block_size` bit for bit and against the layout's
definition (`test_moe_ops.check_alignment`), on a table of expert counts (1 to 256), pair counts (1 to thousands),
BLOCK_M sizes and routings (uniform, one expert taking every pair, most experts empty, a skewed mix), into buffers
filled with a poison value first (so a row or block left unwritten fails). Under the Triton interpreter on CPU (a
subprocess), natively on a GPU through tests/test_moe_gpu.py (`check_fused` calls `check_paths`).

Run as a script (``TRITON_INTERPRET=1 python tests/test_moe_align.py``) it performs the interpreter checks.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys

import pytest
import torch
from triton_interp import exit_passed, run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
POISON = -7
EXPERTS = (1, 8, 60, 128, 256)
# 2049, the thousands: the least count at which E = 128 sums its count table in two tile steps (NB = 33 programs >
# NB_TILE = 32) and E = 256 scatters a program's pairs in four (block 64 = 4 * SUB) with a table of three; its last
# block holds one pair. 513 is the least at which E = 256 crosses NB_TILE (NB = 17 > 16) and E = 8 takes two programs.
PAIRS = (1, 5, 16, 127, 128, 129, 513, 1024, 2049)
BLOCK_MS = (16, 32, 64, 128)
ROUTINGS = ("uniform", "one", "few", "skewed")


def routing(kind: str, pairs: int, e: int, seed: int) -> torch.Tensor:
    """Expert ids [pairs, 1] int32: "uniform" at random; "one": every pair to one expert (the last); "few": only the
    experts 3, 10, 17, ... (the rest empty); "skewed": 3 in 4 pairs to expert e // 2, the rest at random."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (pairs,), generator=g)
    if kind == "one":
        ids = torch.full((pairs,), e - 1)
    elif kind == "few":
        ids = (3 + 7 * torch.randint(0, 1 + (e - 1 - 3) // 7, (pairs,), generator=g)) if e > 3 else ids * 0
    elif kind == "skewed":
        ids = torch.where(torch.rand(pairs, generator=g) < 0.75, e // 2, ids)
    return ids.to(torch.int32).view(-1, 1)


def cases() -> list[tuple[int, int, int, str]]:
    """(E, pairs, BLOCK_M, routing): every E with every pair count, BLOCK_M and routing taken in turn (so each E
    meets each of them), plus the largest pair count at the BLOCK_Ms and routings it did not meet for E = 128, 256."""
    out = []
    for e in EXPERTS:
        for i, pairs in enumerate(PAIRS):
            out.append((e, pairs, BLOCK_MS[(i + e) % len(BLOCK_MS)], ROUTINGS[(i + e // 8) % len(ROUTINGS)]))
    out += [(128, PAIRS[-1], 32, "one"), (128, PAIRS[-1], 128, "few"), (256, PAIRS[-1], 64, "skewed"),
            (256, PAIRS[-1], 16, "one")]
    return out


# The interpreter's table: `cases()` less the cases whose only difference from another is their size (the same
# constexpr variant of every kernel, no launch edge of their own) and that cost the most programs there: E = 60 and
# E = 128 above 129 pairs and E = 256 at 1024 (each meets every BLOCK_M and routing below that, and the two-launch
# path with several programs), the four extras at the largest count. Every E, pair count, BLOCK_M, routing and every
# edge of PAIRS's comment stays (tests below); the GPU runs the whole table (tests/test_moe_gpu.py).
INTERPRETER_SKIPS = frozenset({(60, 513), (60, 1024), (60, 2049), (128, 513), (128, 1024), (256, 1024)})


def interpreter_cases() -> list[tuple[int, int, int, str]]:
    """The cases the interpreter runs (INTERPRETER_SKIPS' comment)."""
    main = cases()[:len(EXPERTS) * len(PAIRS)]
    return [c for c in main if (c[0], c[1]) not in INTERPRETER_SKIPS]


def check_paths(ids: torch.Tensor, e: int, bm: int, case: object = None) -> None:
    """Both paths of `align_into`, into poisoned buffers: equal to `align_block_size`, and the documented layout."""
    from test_moe_ops import check_alignment

    from rapidserve.ops.moe import Alignment, align_block_size
    from rapidserve.ops.triton_moe_align import align_into, empty_alignment

    want = align_block_size(ids, e, bm)
    for one_program in (True, False):
        out = Alignment(*(t.fill_(POISON) for t in empty_alignment(ids.numel(), e, bm, ids.device)))
        got = align_into(ids, e, bm, out, one_program)
        for name, a, b in zip(Alignment._fields, got, want, strict=True):
            assert torch.equal(a, b), (case, one_program, name, a, b)
    check_alignment(ids.cpu(), e, bm, *(a.cpu() for a in want))


def check_table(device: str, table: list[tuple[int, int, int, str]] | None = None) -> int:
    """Every case of `table` (default: `cases()`); returns how many ran."""
    full = cases()
    table = full if table is None else table
    for e, pairs, bm, kind in table:  # seeded by the case's place in `cases()`: the same ids on either table
        check_paths(routing(kind, pairs, e, seed=full.index((e, pairs, bm, kind))).to(device), e, bm,
                    (e, pairs, bm, kind))
    return len(table)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("e", [1, 2, 8, 60, 128, 256, 512, 4096, 8192])
def test_program_split(e: int) -> None:
    """The two-launch path's split: a block of pairs is a power of two of one-hot tiles (SUB * E_P <= TILE, SUB a
    power of two), the least such block of at least sqrt(pairs) pairs, so at most ceil(sqrt(pairs)) programs."""
    import triton

    from rapidserve.ops import triton_moe_align as al

    sub = al.sub_pairs(e)
    assert sub >= 1 and sub & (sub - 1) == 0 and (sub * triton.next_power_of_2(e) <= al.TILE or sub == 1)
    for pairs, root in ((1, 1), (2, 2), (129, 12), (4096, 64), (4097, 65), (65536, 256), (1 << 20, 1024)):
        block = al.pairs_per_program(pairs, e)
        tiles = block // sub
        assert block % sub == 0 and tiles & (tiles - 1) == 0 and block >= root, (pairs, block)
        assert tiles == 1 or block // 2 < root  # the least
        assert -(-pairs // block) <= root


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_buffers_of_another_size_are_refused() -> None:
    from rapidserve.ops.triton_moe_align import align_into, empty_alignment

    ids = routing("uniform", 10, 8, 0)
    for pairs, bm in ((200, 16), (10, 32)):
        with pytest.raises(ValueError, match="allocate them with empty_alignment"):
            align_into(ids, 8, 16, empty_alignment(pairs, 8, bm, ids.device))


def test_case_table_covers_the_brief() -> None:
    table = cases()
    assert {c[0] for c in table} == set(EXPERTS) and {c[2] for c in table} == set(BLOCK_MS)
    assert {c[3] for c in table} == set(ROUTINGS) and {c[1] for c in table} == set(PAIRS)
    for e in EXPERTS:  # each E meets both paths' sizes and every routing
        mine = [c for c in table if c[0] == e]
        assert {c[3] for c in mine} == set(ROUTINGS) and len({c[2] for c in mine}) >= 3
    few = routing("few", 500, 60, 1).unique().tolist()
    assert len(few) < 60 // 5 and all(x % 7 == 3 for x in few)  # most experts empty
    assert routing("one", 9, 60, 0).unique().tolist() == [59]
    assert list(itertools.chain(*routing("skewed", 400, 128, 2).tolist())).count(64) > 250


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_case_table_reaches_the_two_launch_edges() -> None:
    """The pair counts of PAIRS's comment: more programs than one tile of the count table sums (E = 128 at the
    largest count, E = 256 from 513 on), several scatter steps a program, a last block of one pair, two programs."""
    import triton

    from rapidserve.ops import triton_moe_align as al

    def programs(pairs: int, e: int) -> int:
        return -(-pairs // al.pairs_per_program(pairs, e))

    def nb_tile(e: int) -> int:
        return max(al.TILE // triton.next_power_of_2(e), 1)

    assert programs(PAIRS[-1], 128) > nb_tile(128) >= programs(1024, 128)
    assert programs(513, 256) > nb_tile(256) >= programs(PAIRS[5], 256)
    assert al.pairs_per_program(PAIRS[-1], 256) == 4 * al.sub_pairs(256)
    assert PAIRS[-1] % al.pairs_per_program(PAIRS[-1], 128) == 1 and programs(513, 8) == 2


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_interpreter_table_keeps_every_variant_and_edge() -> None:
    """The interpreter's table: every (E, BLOCK_M) constexpr variant of the full table, every E at every routing and
    every BLOCK_M, every pair count, several programs of the two-launch path for each E > 1, and PAIRS's edges."""
    import triton

    from rapidserve.ops import triton_moe_align as al

    table = interpreter_cases()
    assert set(table) <= set(cases()) and {c[1] for c in table} == set(PAIRS)
    assert {(c[0], c[2]) for c in table} == {(c[0], c[2]) for c in cases()}
    for e in EXPERTS:
        mine = [c for c in table if c[0] == e]
        assert {c[2] for c in mine} == set(BLOCK_MS) and {c[3] for c in mine} == set(ROUTINGS), e
        assert e == 1 or max(-(-c[1] // al.pairs_per_program(c[1], e)) for c in mine) > 1, e
    pairs = {(c[0], c[1]) for c in table}
    assert {(128, PAIRS[-1]), (256, 513), (256, PAIRS[-1]), (8, 513)} <= pairs  # the edges' cases (test above)
    assert -(-PAIRS[-1] // al.pairs_per_program(PAIRS[-1], 128)) > max(al.TILE // triton.next_power_of_2(128), 1)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_alignment_interpreter() -> None:
    out = run_interpreted(__file__, timeout=900)
    assert f"alignment: {len(interpreter_cases())} cases ok" in out


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 before running the interpreter checks")
    from rapidserve.ops.triton_moe_align import align_into, empty_alignment

    for one_program in (True, False):  # no pairs: the total 0, nothing else to write
        out = empty_alignment(0, 8, 16, torch.device("cpu"))
        out.num_post.fill_(POISON)
        got = align_into(torch.zeros(0, 2, dtype=torch.int32), 8, 16, out, one_program)
        assert got.sorted_ids.numel() == got.expert_ids.numel() == 0 and got.num_post.tolist() == [0]
    print(f"alignment: {check_table('cpu', interpreter_cases())} cases ok")
    exit_passed()
