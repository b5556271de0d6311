"""Disagg mode's NPMD routing (parallel/kv_routes.py), head-sliced block moves (parallel/kv_connector.py) and the
prefill leader's mirrored, fenced moves (parallel/kv_mirror.py), without processes: 4P4D, 2P4D, 4P1D... on CPU
tensors, each rank's pool a tensor of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from rapidserve.parallel.kv_connector import DevicePeerConnector, KVConnector, Landed, ShardedConnector, Transfer
from rapidserve.parallel.kv_mirror import FollowerKV, MirroredConnector
from rapidserve.parallel.kv_routes import HeadRoute, decode_peers, head_range, head_routes, prefill_routes
from rapidserve.parallel.mirror import Follower, KVFence, KVMove


@pytest.mark.parametrize("kv,n,m,want", [
    (2, 1, 1, [HeadRoute(0, 0, (0, 2), (0, 2), (0, 2))]),  # 1P1D: everything, as before
    (8, 4, 4, [HeadRoute(r, r, (2 * r, 2 * r + 2), (0, 2), (0, 2)) for r in range(4)]),  # 4P4D: r <-> r
    (2, 2, 1, [HeadRoute(0, 0, (0, 1), (0, 1), (0, 1)), HeadRoute(1, 0, (1, 2), (0, 1), (1, 2))]),  # 2P1D
    (2, 1, 2, [HeadRoute(0, 0, (0, 1), (0, 1), (0, 1)), HeadRoute(0, 1, (1, 2), (1, 2), (0, 1))]),  # 1P2D
    (8, 2, 4, [HeadRoute(0, 0, (0, 2), (0, 2), (0, 2)), HeadRoute(0, 1, (2, 4), (2, 4), (0, 2)),
               HeadRoute(1, 2, (4, 6), (0, 2), (0, 2)), HeadRoute(1, 3, (6, 8), (2, 4), (0, 2))]),
    (8, 4, 2, [HeadRoute(0, 0, (0, 2), (0, 2), (0, 2)), HeadRoute(1, 0, (2, 4), (0, 2), (2, 4)),
               HeadRoute(2, 1, (4, 6), (0, 2), (0, 2)), HeadRoute(3, 1, (6, 8), (0, 2), (2, 4))]),
])
def test_head_routes(kv: int, n: int, m: int, want: list[HeadRoute]) -> None:
    assert head_routes(kv, n, m) == want


@pytest.mark.parametrize("kv,n,m", [(8, 4, 4), (8, 2, 4), (8, 4, 2), (8, 8, 1), (8, 1, 8), (8, 8, 8), (4, 2, 2)])
def test_every_head_moves_once_between_the_ranks_that_hold_it(kv: int, n: int, m: int) -> None:
    routes = head_routes(kv, n, m)
    for h in range(kv):  # each model head: exactly one route, from its prefill rank to its decode rank
        (only,) = [x for x in routes if x.heads[0] <= h < x.heads[1]]
        assert head_range(kv, n, only.prefill_rank)[0] <= h < head_range(kv, n, only.prefill_rank)[1]
        assert head_range(kv, m, only.decode_rank)[0] <= h < head_range(kv, m, only.decode_rank)[1]
    for r in range(n):  # a prefill rank's routes cover its pool's heads once, in order
        mine = prefill_routes(kv, n, m, r)
        assert [x.prefill_heads for x in mine] == [(i * (kv // max(n, m)), (i + 1) * (kv // max(n, m)))
                                                    for i in range(len(mine))] or len(mine) == 1
        assert sum(b - a for a, b in (x.prefill_heads for x in mine)) == kv // n
        assert len(mine) == max(1, m // n)
    for s in range(m):
        assert len(decode_peers(kv, n, m, s)) == max(1, n // m)


@pytest.mark.parametrize("kv,tp,rank", [(2, 4, 0), (6, 4, 1), (2, 2, 2), (2, 0, 0)])
def test_head_range_refuses_a_rank_without_whole_heads(kv: int, tp: int, rank: int) -> None:
    with pytest.raises(ValueError, match="cannot hold a whole share"):
        head_range(kv, tp, rank)


# ---- the moves themselves, each rank's pool a tensor of its own ----------------------------------------------
LAYERS, BS, HD = 2, 4, 3


def shards(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each rank's pool of a [layers, 2, blocks, heads, bs, hd] pool split over `tp` ranks by heads."""
    return [t.contiguous() for t in full.chunk(tp, dim=3)]


def connectors(staging: list[torch.Tensor], decode: list[torch.Tensor], kv: int) -> list[KVConnector]:
    n, m = len(staging), len(decode)
    out: list[KVConnector] = []
    for r in range(n):
        parts: list[KVConnector] = [DevicePeerConnector(staging[r], decode[h.decode_rank], local_heads=h.prefill_heads,
                                                        remote_heads=h.decode_heads)
                                    for h in prefill_routes(kv, n, m, r)]
        out.append(parts[0] if len(parts) == 1 else ShardedConnector(parts))
    return out


@pytest.mark.parametrize("kv,n,m", [(8, 4, 4), (8, 2, 4), (8, 4, 1), (8, 1, 8), (4, 2, 2), (2, 2, 1), (2, 1, 2)])
def test_pushes_then_pulls_move_each_ranks_heads(kv: int, n: int, m: int) -> None:
    """Every prefill rank pushes its blocks [0, 1, 2] of staging into decode blocks [5, 3, 1], with only its
    routes: the decode side, put back together, holds the whole model's KV there and nothing else changed. Then
    decode blocks [5, 3] are pulled into staging blocks [4, 6]: each prefill rank gets exactly its heads."""
    g = torch.Generator().manual_seed(kv * 100 + n * 10 + m)
    model_staging = torch.randn(LAYERS, 2, 8, kv, BS, HD, generator=g)
    model_decode = torch.randn(LAYERS, 2, 7, kv, BS, HD, generator=g)
    staging, decode = shards(model_staging, n), shards(model_decode, m)
    conns = connectors(staging, decode, kv)
    for c in conns:
        c.push([0, 1, 2], [5, 3, 1]).wait()
    got = torch.cat(decode, dim=3)
    want = model_decode.clone()
    want[:, :, [5, 3, 1]] = model_staging[:, :, [0, 1, 2]]
    assert torch.equal(got, want)
    for c in conns:
        c.pull([5, 3], [4, 6]).wait()
    back = torch.cat(staging, dim=3)
    want_staging = model_staging.clone()
    want_staging[:, :, [4, 6]] = model_staging[:, :, [0, 1]]
    assert torch.equal(back, want_staging)


def test_a_head_slice_must_match_its_other_side() -> None:
    a, b = torch.zeros(LAYERS, 2, 4, 2, BS, HD), torch.zeros(LAYERS, 2, 4, 1, BS, HD)
    with pytest.raises(ValueError, match="not two slices of one length"):
        DevicePeerConnector(a, b)  # two heads into one
    with pytest.raises(ValueError, match="not two slices of one length"):
        DevicePeerConnector(a, b, local_heads=(1, 3), remote_heads=(0, 1))
    assert "KV heads 1..1 <-> 0..0" in DevicePeerConnector(a, b, local_heads=(1, 2)).describe()


# ---- the leader's mirrored moves and fences -------------------------------------------------------------------
class FakeGroup:
    size = 3
    device = torch.device("cpu")


class FakeLeader:
    """Records what a `mirror.Leader` would publish."""

    def __init__(self) -> None:
        self.tp = FakeGroup()
        self.sent: list[Any] = []

    def kv_move(self, kind: str, local: Sequence[int], remote: Sequence[int]) -> None:
        self.sent.append(KVMove(kind, list(local), list(remote)))  # type: ignore[arg-type]

    def kv_fence(self) -> None:
        self.sent.append(KVFence())


class Pending:
    def __init__(self) -> None:
        self.landed = False

    def done(self) -> bool:
        return self.landed

    def wait(self) -> None:
        self.landed = True


class Recording:
    """A connector whose transfers land only when waited for; refuses block 99 as a real one refuses bad blocks."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, list[int], list[int]]] = []
        self.transfers: list[Pending] = []

    def describe(self) -> str:
        return "recording"

    def _move(self, kind: str, local: Sequence[int], remote: Sequence[int]) -> Transfer:
        if 99 in local or 99 in remote:
            raise ValueError("blocks [99] are not in 0..9")
        if not local:
            return Landed()
        self.moves.append((kind, list(local), list(remote)))
        self.transfers.append(Pending())
        return self.transfers[-1]

    def pull(self, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> Transfer:
        return self._move("pull", local_blocks, remote_blocks)

    def push(self, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> Transfer:
        return self._move("push", local_blocks, remote_blocks)


def test_leader_publishes_each_move_after_its_own_and_fences_once_per_wait() -> None:
    own, leader = Recording(), FakeLeader()
    c = MirroredConnector(own, leader)  # type: ignore[arg-type]
    pull = c.pull([7, 8], [0, 1])
    pushes = [c.push([0], [7]), c.push([1], [8])]
    assert leader.sent == [KVMove("pull", [0, 1], [7, 8]), KVMove("push", [0], [7]), KVMove("push", [1], [8])]
    assert not pull.done()
    with pytest.raises(ValueError, match="99"):  # refused by the leader's own connector: published to nobody
        c.push([99], [3])
    assert len(leader.sent) == 3
    assert isinstance(c.push([], []), Landed) and len(leader.sent) == 3  # nothing to move: nothing published
    for t in pushes + [pull]:  # a job's transfers: the first wait fences every move published so far
        t.wait()
    assert leader.sent[3:] == [KVFence()] and all(t.landed for t in own.transfers) and pull.done()
    late = c.push([2], [9])
    assert not late.done()
    late.wait()
    assert leader.sent[4:] == [KVMove("push", [2], [9]), KVFence()]


class FollowerRunner:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.reduced = 0

        class Group:
            def all_reduce(_, x: torch.Tensor) -> torch.Tensor:
                self.reduced += 1
                return x

        self.tp = Group()

    def replay(self, msg: Any, sampled: Any) -> None:
        raise AssertionError("no forward here")


def test_follower_replays_moves_and_joins_the_fence_after_they_landed() -> None:
    own = Recording()
    runner = FollowerRunner()
    kv = FollowerKV(own)
    f = Follower(runner, lambda name: None, kv)  # type: ignore[arg-type]
    assert f.apply(KVMove("pull", [0, 1], [7, 8])) and f.apply(KVMove("push", [0], [7]))
    assert own.moves == [("pull", [0, 1], [7, 8]), ("push", [0], [7])]
    assert not any(t.landed for t in own.transfers) and runner.reduced == 0
    assert f.apply(KVFence())
    assert all(t.landed for t in own.transfers) and runner.reduced == 1 and not kv.pending
    with pytest.raises(RuntimeError, match="moves no KV"):
        Follower(runner, lambda name: None).apply(KVFence())  # type: ignore[arg-type]
