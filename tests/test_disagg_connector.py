"""The disagg KV connector (rapidserve/parallel/kv_connector.py): pull and push move exactly the named
blocks, for every layer and both K and V, and leave every other block of both pools untouched.

On CPU two pools stand for the two devices: in one process, and across processes through the real
hand-off (the decode pool exported into shared memory by its owner, attached by a spawned child that
pushes and pulls, the owner checking its own pool). With two GPUs (`gpu` mark) the same checks run
between cuda:0 and cuda:1 through the streams and events."""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch

from rapidserve.kv_pool import KVPool
from rapidserve.parallel.kv_connector import DevicePeerConnector, Landed, SharedPool, attach_pool, export_pool
from tests.fork_context import child_context

LAYERS, HEADS, BS, DIM = 3, 2, 4, 5
TIMEOUT_S = 120


def pool(blocks: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, blocks, HEADS, BS, DIM, generator=g).to(device)


def expect_moved(before: torch.Tensor, after: torch.Tensor, source: torch.Tensor, src: list[int],
                 dst: list[int]) -> None:
    """`after` is `before` with block dst[i] replaced by source's block src[i] (all layers, K and V)."""
    want = before.clone()
    for s, d in zip(src, dst, strict=True):
        want[:, :, d] = source[:, :, s]
    assert torch.equal(after.cpu(), want.cpu())


MOVES = {  # (local blocks, remote blocks)
    "one block": ([2], [5]),
    "several, out of order": ([0, 3, 1], [6, 2, 7]),
    "every local block": ([0, 1, 2, 3], [7, 6, 5, 4]),
    "nothing": ([], []),
}


@pytest.mark.parametrize("max_copy_bytes", [1 << 20, 1], ids=["one copy", "a copy per block"])
@pytest.mark.parametrize("name", list(MOVES))
def test_push_and_pull_move_exactly_the_named_blocks(name: str, max_copy_bytes: int) -> None:
    local_blocks, remote_blocks = MOVES[name]
    local, remote = pool(4, 1), pool(8, 2)
    c = DevicePeerConnector(local, remote, max_copy_bytes=max_copy_bytes)
    l0, r0 = local.clone(), remote.clone()
    t = c.push(local_blocks, remote_blocks)
    t.wait()
    assert t.done()
    expect_moved(r0, remote, l0, local_blocks, remote_blocks)
    assert torch.equal(local, l0)  # the source is untouched
    fresh = pool(8, 3)
    remote.copy_(fresh)
    c.pull(remote_blocks, local_blocks).wait()
    expect_moved(l0, local, fresh, remote_blocks, local_blocks)
    assert torch.equal(remote, fresh)


@pytest.mark.parametrize("local_blocks,remote_blocks,needle", [
    ([0, 1], [2], "2 local blocks for 1 remote"),
    ([4], [0], r"local blocks \[4\] are not in 0..3"),
    ([0], [8], r"remote blocks \[8\] are not in 0..7"),
    ([-1], [0], "not in"),
    ([0, 1], [3, 3], "name a block twice"),
])
def test_bad_block_lists_are_refused_before_anything_moves(local_blocks: list[int], remote_blocks: list[int],
                                                           needle: str) -> None:
    local, remote = pool(4, 1), pool(8, 2)
    r0 = remote.clone()
    c = DevicePeerConnector(local, remote)
    with pytest.raises(ValueError, match=needle):
        c.push(local_blocks, remote_blocks)
    assert torch.equal(remote, r0)


def test_pools_must_match_but_for_their_blocks() -> None:
    with pytest.raises(ValueError, match="not two slices of one length"):  # heads: only as matching slices
        DevicePeerConnector(pool(4, 1), pool(4, 1)[:, :, :, :1].contiguous())
    with pytest.raises(ValueError, match="differ in more than their number of blocks"):
        DevicePeerConnector(pool(4, 1), pool(4, 1)[..., :2].contiguous())
    with pytest.raises(ValueError, match="differ"):
        DevicePeerConnector(pool(4, 1), pool(4, 1).double())
    assert "cpu" in DevicePeerConnector(pool(2, 1), pool(3, 1)).describe()
    assert isinstance(DevicePeerConnector(pool(2, 1), pool(3, 1)).pull([], []), Landed)


def test_attach_pool_checks_what_the_hand_off_brought() -> None:
    staging = KVPool(pool(4, 1), BS)
    decode = KVPool(pool(9, 2), BS)
    shared = export_pool(decode)
    assert decode.tensor.is_shared()  # moved into shared memory in place
    assert attach_pool(shared, staging, torch.device("cpu")) is decode.tensor
    with pytest.raises(ValueError, match="not in shared memory"):
        attach_pool(SharedPool(pool(9, 2), BS), staging, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not match the staging pool"):
        attach_pool(SharedPool(decode.tensor, 8), staging, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not match the staging pool"):
        attach_pool(export_pool(KVPool(pool(9, 2)[:1].contiguous(), BS)), staging, torch.device("cpu"))
    with pytest.raises(ValueError, match="expected meta"):
        attach_pool(shared, staging, torch.device("meta"))


PUSH = ([1, 3], [6, 0])  # child's local blocks -> the owner's blocks
PULL = ([2, 6], [0, 2])  # the owner's blocks -> child's local blocks


def _child(inbox: Any, outbox: Any) -> None:
    """The prefill stand-in: attaches the owner's pool, pushes and pulls, reports its local pool."""
    try:
        shared = inbox.get(timeout=TIMEOUT_S)
        local = KVPool(pool(4, 11), BS)
        remote = attach_pool(shared, local, torch.device("cpu"))
        c = DevicePeerConnector(local.tensor, remote)
        c.push(*PUSH).wait()
        c.pull(*PULL).wait()
        outbox.put(("ok", local.tensor.numpy().copy()))
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
    inbox.get(timeout=TIMEOUT_S)  # the owner outlives our use of its memory


def test_push_and_pull_across_processes_through_the_hand_off() -> None:
    owner = KVPool(pool(8, 12), BS)
    before = owner.tensor.clone()
    ctx = child_context()  # a fork of the engine's fork server, as the prefill worker starts
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_child, args=(inbox, outbox), daemon=True)
    proc.start()
    try:
        inbox.put(export_pool(owner))
        reply = outbox.get(timeout=TIMEOUT_S)
        inbox.put("bye")
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert reply[0] == "ok", reply[1]
    child_local = torch.from_numpy(reply[1])
    start = pool(4, 11)
    expect_moved(before, owner.tensor, start, *PUSH)  # the owner sees exactly the pushed blocks
    expect_moved(start, child_local, owner.tensor, *PULL)  # and the child pulled exactly those


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs")
def test_peer_copy_between_two_gpus_behind_a_running_forward() -> None:
    """The push waits for work queued before it on the caller's stream (a stand-in forward writing the
    blocks), runs beside later work, and its event covers the scatter; the pull is seen by work queued
    after it on the caller's stream."""
    a, b = torch.device("cuda:0"), torch.device("cuda:1")
    local, remote = pool(64, 1, "cuda:0"), pool(128, 2, "cuda:1")
    c = DevicePeerConnector(local, remote, max_copy_bytes=4 * local[:, :, :1].numel() * 4)  # several pieces
    assert "cuda:0 <-> cuda:1" in c.describe()
    compute = torch.cuda.Stream(a)
    src, dst = list(range(0, 64, 2)), list(range(127, 63, -2))
    # Warm up as a serving engine is after its first request: the first push allocates the pinned host
    # buffers of its block indices and the device buffers of its pieces, and a first pinned (cudaHostAlloc)
    # or device allocation may wait for the device, which would let the push below finish behind the
    # sleep before the check (it did, on two H200s, 2026-11-27); the caching allocators reuse them after.
    with torch.cuda.stream(compute):
        c.push(src, dst).wait()
        c.pull(src[:2], [1, 3]).wait()
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)
    r0 = remote.clone()
    # The write's index lives on the GPU before the sleep: indexing with a Python list copies it from
    # pageable memory and blocks the host until the stream drains (the sleep included), which would let
    # the whole push finish before the check below (it did, on two H200s).
    src_on_a = torch.tensor(src, device=a)
    torch.cuda.synchronize(a)
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)  # ~0.1 s ahead of the write: the push must wait for both
        local.index_fill_(2, src_on_a, 7.0)
        t = c.push(src, dst)
        later = local[:, :, 1:2] * 2  # queued after the push, not behind it
    assert not t.done()  # the sleep is still running
    t.wait()
    want = r0.clone()
    want[:, :, dst] = 7.0
    assert torch.equal(remote, want)
    del later
    with torch.cuda.stream(compute):
        remote[:, :, 5] = 3.0  # (on b's current stream: torch orders it before the pull's copy)
        torch.cuda.synchronize(b)
        c.pull([5, 9], [1, 3]).wait()
        seen = local[:, :, [1, 3]].clone()  # queued after the pull on the caller's stream
    torch.cuda.synchronize(a)
    assert torch.equal(seen[:, :, 0], torch.full_like(seen[:, :, 0], 3.0))
    assert torch.equal(seen[:, :, 1].cpu(), remote[:, :, 9].cpu())
