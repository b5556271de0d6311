"""Moving KV blocks between two paged pools on different devices: the disagg baseline's KV connector.

In disagg mode (engine/disagg.py) the prefill instance computes into its own staging pool and the
decode instance owns the pool it decodes from. A `KVConnector` moves whole blocks (every layer, K
and V) between the two, named by block index on each side:

- `pull(remote_blocks, local_blocks)`: decode pool -> staging (the prompt's cached prefix);
- `push(local_blocks, remote_blocks)`: staging -> decode pool (the blocks a forward wrote);
- `describe()`: one line for logs and the worker's Ready.

Both return a `Transfer`, which can be asked whether it has landed and waited for. The one
transport here, `DevicePeerConnector`, copies between two tensors this process can address: on GPUs
a cross-device copy (NVLink, or PCIe peer-to-peer, or staged through the host by the driver where
the GPUs cannot reach each other), on CPU a plain copy between two pools (the decode pool attached
from shared memory). Another transport (RDMA / NIXL between hosts, a host-memory tier) implements
the same three calls over the same block indices.

Pool layout (kv_pool.py): `[layers, K|V, blocks, kv_heads, block_size, head_dim]`, so the blocks of
a transfer are one `index_select` on dim 2, gathered into a contiguous buffer that crosses the link
in one copy, and scattered with `index_copy_` on the far side (in pieces of at most `max_copy_bytes`,
which bounds the buffers). Under tensor parallelism (parallel/kv_routes.py) each pool holds its rank's KV heads
and a connector moves one slice of them (dim 3: `local_heads` of the staging pool <-> `remote_heads` of the
decode pool, as long as each other); `ShardedConnector` is one rank's connectors to every decode rank it
shares heads with, moving the same blocks through each. An fp8 pool (`--kv-cache-dtype fp8`) is moved as
bytes (a uint8 view): both pools have the one dtype (checked), and the layers' scales are the same on both
instances (the config's; per layer, not per head, so a head slice needs no scales of its own).

Stream ordering on GPUs (device A: local, staging; device B: remote, decode's pool). The connector
has two streams of its own: `copy_stream` on A, `remote_stream` on B. torch runs a cross-device copy
on the SOURCE device's current stream, after the destination device's current stream has reached
its queued work, and makes that stream wait for the copy; the steps below also order it explicitly.
- push: (1) copy_stream waits for A's current stream (the caller's compute stream), so the forward
  that wrote the blocks is done before (2) the gather reads them on copy_stream; (3) the peer copy
  into a buffer on B runs on copy_stream; (4) remote_stream waits for copy_stream; (5) the scatter
  into the decode pool runs on remote_stream; (6) the Transfer's event is recorded on remote_stream.
  Nothing on A's current stream waits for a push: the caller's next forward overlaps it. The caller
  must not write the pushed staging blocks again (nor free them for reuse) before `wait()`.
- pull: (1) the gather from the decode pool runs on remote_stream; (2) the peer copy into a buffer on
  A runs on remote_stream, after A's current stream has reached its queued work (torch's barrier); (3)
  A's current stream waits for remote_stream; (4) the scatter into staging runs on A's current
  stream, so every later kernel queued there (the prefill forward) reads the pulled blocks in order;
  the event is recorded there. The caller must not change the pulled decode-pool blocks meanwhile
  (decode never writes a cached block).
- Buffers: each is used on the stream that allocated it, except the far-side buffer of a copy, which
  the copy writes from the other stream: `record_stream` keeps the allocator from reusing it before
  that stream is past the copy. Block indices go to the devices from pinned host memory without
  blocking (a pageable copy would wait for the stream's queued work, stalling the overlap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rapidserve.kv_pool import KVPool, check_ipc_shareable_allocator

BLOCK_DIM = 2  # the pool's block dimension
HEAD_DIM = 3  # the pool's KV-head dimension
DEFAULT_MAX_COPY_BYTES = 256 * 2**20


class Transfer(Protocol):
    """A queued copy of blocks: `done()` asks without blocking, `wait()` blocks until it has landed."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class KVConnector(Protocol):
    """Moves whole KV blocks between this process's staging pool and a remote (decode) pool."""

    def pull(self, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> Transfer:
        """Copy remote block remote_blocks[i] into local block local_blocks[i], for every i; later work on
        the local device's current stream sees them."""
        ...

    def push(self, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> Transfer:
        """Copy local block local_blocks[i] into remote block remote_blocks[i], for every i, after the
        work queued so far on the local device's current stream; `wait()` once they are in the remote pool."""
        ...

    def describe(self) -> str: ...


class Landed:
    """A transfer that finished before it was returned (CPU copies; nothing to move)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


@dataclass(frozen=True)
class EventTransfer:
    """A transfer that lands when `event` completes (recorded after its last copy)."""

    event: torch.cuda.Event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


@dataclass(frozen=True)
class SharedPool:
    """The decode pool as the start-up hand-off carries it: on a GPU, pickled as a CUDA/HIP IPC handle
    of its allocation (never a copy); on CPU, a tensor in POSIX shared memory (runner/model_sharing.py says how
    the pipe's pickler does both). Only the pool travels, not the weights."""

    kv: torch.Tensor
    block_size: int


def export_pool(pool: KVPool) -> SharedPool:
    """The decode pool, ready for the hand-off. Keep `pool` (and this process) alive while the other
    process uses it. Stream ordering: the device is synchronized first, so the pool's zero-fill and
    every write before this call have landed before a handle exists."""
    check_ipc_shareable_allocator(pool.tensor.device)
    if pool.tensor.device.type == "cuda":
        torch.cuda.synchronize(pool.tensor.device)
    else:
        pool.tensor.share_memory_()  # in place: the decode worker's views follow
    return SharedPool(pool.tensor, pool.block_size)


def attach_pool(shared: SharedPool, like: KVPool, device: torch.device, kv_heads: int | None = None) -> torch.Tensor:
    """The remote pool's tensor, checked against the staging pool `like` (same layers, block size, head size and
    dtype, `kv_heads` KV heads (default: as many as `like`); any number of blocks) and the device it must be on."""
    kv = shared.kv
    if not isinstance(kv, torch.Tensor) or kv.dim() != 6:
        got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"the decode pool is {got}, expected a 6-D tensor")
    want = list(like.tensor.shape)
    want[BLOCK_DIM] = kv.shape[BLOCK_DIM]
    if kv_heads is not None:
        want[HEAD_DIM] = kv_heads
    if list(kv.shape) != want or shared.block_size != like.block_size or kv.dtype != like.tensor.dtype:
        raise ValueError(f"the decode pool {tuple(kv.shape)} {kv.dtype} (block size {shared.block_size}) does not "
                         f"match the staging pool {tuple(like.tensor.shape)} {like.tensor.dtype} but for its blocks")
    if kv.device != device:
        raise ValueError(f"the decode pool is on {kv.device}, expected {device} (the same GPUs must be visible to "
                         "both workers, under the same indices)")
    if not kv.is_contiguous():
        raise ValueError("the decode pool is not contiguous")
    if kv.device.type == "cpu" and not kv.is_shared():
        raise ValueError("the decode pool is not in shared memory, so this process got a copy: send export_pool()")
    return kv


class DevicePeerConnector:
    """`KVConnector` by plain tensor copies between two pools this process can address (module doc:
    the stream ordering on GPUs). `local`, `remote`: 6-D pools alike but for their number of blocks; with
    `local_heads` / `remote_heads` ([start, stop) of dim 3, as long as each other) only those heads of each
    move (tensor parallelism: parallel/kv_routes.py); the pools may then hold different numbers of heads."""

    def __init__(self, local: torch.Tensor, remote: torch.Tensor, max_copy_bytes: int = DEFAULT_MAX_COPY_BYTES,
                 local_heads: tuple[int, int] | None = None, remote_heads: tuple[int, int] | None = None) -> None:
        if local.dim() != 6 or remote.dim() != 6:
            raise ValueError(f"pools {tuple(local.shape)} and {tuple(remote.shape)} must be 6-D")
        lh = local_heads or (0, local.shape[HEAD_DIM])
        rh = remote_heads or (0, remote.shape[HEAD_DIM])
        if not (0 <= lh[0] < lh[1] <= local.shape[HEAD_DIM] and 0 <= rh[0] < rh[1] <= remote.shape[HEAD_DIM]
                and lh[1] - lh[0] == rh[1] - rh[0]):
            raise ValueError(f"heads {list(lh)} of the local pool {tuple(local.shape)} and {list(rh)} of the remote "
                             f"pool {tuple(remote.shape)} are not two slices of one length")
        local, remote = local[:, :, :, lh[0]:lh[1]], remote[:, :, :, rh[0]:rh[1]]
        shape_l, shape_r = list(local.shape), list(remote.shape)
        shape_l[BLOCK_DIM] = shape_r[BLOCK_DIM] = 0
        if shape_l != shape_r or local.dtype != remote.dtype:
            raise ValueError(f"pools {tuple(local.shape)} {local.dtype} and {tuple(remote.shape)} {remote.dtype} "
                             "differ in more than their number of blocks")
        if local.device.type != remote.device.type:
            raise ValueError(f"one pool is on {local.device}, the other on {remote.device}")
        self.heads = (lh, rh)
        self.local, self.remote = _as_copyable(local), _as_copyable(remote)
        self.cuda = local.device.type == "cuda"
        if self.cuda and local.device == remote.device:
            raise ValueError(f"both pools are on {local.device}: on one GPU the rapid mode shares one pool in place")
        block_bytes = local[:, :, :1].numel() * local.element_size()
        self.blocks_per_copy = max(1, max_copy_bytes // block_bytes)
        self.copy_stream = torch.cuda.Stream(local.device) if self.cuda else None
        self.remote_stream = torch.cuda.Stream(remote.device) if self.cuda else None

    def describe(self) -> str:
        (l0, l1), (r0, r1) = self.heads
        heads = f", KV heads {l0}..{l1 - 1} <-> {r0}..{r1 - 1}"
        if not self.cuda:
            return f"peer copy {self.local.device} <-> {self.remote.device} (pools in this host's memory{heads})"
        a, b = self.local.device, self.remote.device
        peer = torch.cuda.can_device_access_peer(a.index or 0, b.index or 0)
        how = "peer-to-peer (NVLink or PCIe)" if peer else "no peer access: staged through host memory by the driver"
        return f"peer copy {a} <-> {b}, {how}{heads}"

    def push(self, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> Transfer:
        self._check(local_blocks, remote_blocks)
        if not local_blocks:
            return Landed()
        if not self.cuda:
            _copy_blocks(self.local, local_blocks, self.remote, remote_blocks)
            return Landed()
        assert self.copy_stream is not None and self.remote_stream is not None
        compute = torch.cuda.current_stream(self.local.device)
        self.copy_stream.wait_stream(compute)  # (1) the forward that wrote the blocks, before the gather
        with torch.cuda.stream(self.copy_stream), torch.cuda.stream(self.remote_stream):
            for src, dst in self._pieces(local_blocks, remote_blocks):
                gathered = self.local.index_select(BLOCK_DIM, _index(src, self.local.device))  # (2) copy_stream
                there = torch.empty(gathered.shape, dtype=gathered.dtype, device=self.remote.device)
                there.copy_(gathered, non_blocking=True)  # (3) on copy_stream, the source device's current
                there.record_stream(self.copy_stream)  # allocated for remote_stream, written on copy_stream
                self.remote_stream.wait_stream(self.copy_stream)  # (4)
                self.remote.index_copy_(BLOCK_DIM, _index(dst, self.remote.device), there)  # (5) remote_stream
            event = torch.cuda.Event()
            event.record(self.remote_stream)  # (6)
        return EventTransfer(event)

    def pull(self, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> Transfer:
        self._check(local_blocks, remote_blocks)
        if not local_blocks:
            return Landed()
        if not self.cuda:
            _copy_blocks(self.remote, remote_blocks, self.local, local_blocks)
            return Landed()
        assert self.remote_stream is not None
        compute = torch.cuda.current_stream(self.local.device)
        with torch.cuda.stream(self.remote_stream):  # B's current stream; A's stays the caller's
            for src, dst in self._pieces(remote_blocks, local_blocks):
                gathered = self.remote.index_select(BLOCK_DIM, _index(src, self.remote.device))  # (1)
                here = torch.empty(gathered.shape, dtype=gathered.dtype, device=self.local.device)
                here.copy_(gathered, non_blocking=True)  # (2) on remote_stream, after compute's queued work
                here.record_stream(self.remote_stream)  # allocated for compute, written on remote_stream
                compute.wait_stream(self.remote_stream)  # (3)
                self.local.index_copy_(BLOCK_DIM, _index(dst, self.local.device), here)  # (4) on compute
        event = torch.cuda.Event()
        event.record(compute)
        return EventTransfer(event)

    def _pieces(self, src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
        n = self.blocks_per_copy
        return [(list(src[i: i + n]), list(dst[i: i + n])) for i in range(0, len(src), n)]

    def _check(self, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> None:
        """Bad indices fail here, on the host: on a GPU they would be a device-side assert (fatal)."""
        if len(local_blocks) != len(remote_blocks):
            raise ValueError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote ones")
        for what, blocks, pool in (("local", local_blocks, self.local), ("remote", remote_blocks, self.remote)):
            n = pool.shape[BLOCK_DIM]
            bad = [b for b in blocks if not 0 <= b < n]
            if bad:
                raise ValueError(f"{what} blocks {bad[:8]} are not in 0..{n - 1}")
            if len(set(blocks)) != len(blocks):
                raise ValueError(f"{what} blocks {list(blocks)} name a block twice")


@dataclass(frozen=True)
class Transfers:
    """Several transfers as one: landed when all have."""

    parts: tuple[Transfer, ...]

    def done(self) -> bool:
        return all(t.done() for t in self.parts)

    def wait(self) -> None:
        for t in self.parts:
            t.wait()


class ShardedConnector:
    """One tensor-parallel prefill rank's `KVConnector`: a connector (a head slice: parallel/kv_routes.py) to each
    decode rank it shares heads with; a pull or push moves the same blocks through every one, so each of this
    rank's heads comes from (goes to) the one decode rank that holds it. The stream ordering is each part's."""

    def __init__(self, parts: Sequence[KVConnector]) -> None:
        if not parts:
            raise ValueError("a sharded connector needs at least one decode rank")
        self.parts = list(parts)

    def describe(self) -> str:
        return "; ".join(p.describe() for p in self.parts)

    def pull(self, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> Transfer:
        return Transfers(tuple(p.pull(remote_blocks, local_blocks) for p in self.parts))

    def push(self, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> Transfer:
        return Transfers(tuple(p.push(local_blocks, remote_blocks) for p in self.parts))


def _as_copyable(pool: torch.Tensor) -> torch.Tensor:
    """The pool as the copies take it: an fp8 pool viewed as bytes (uint8, the same memory and shape), whose
    `index_copy_` torch does not implement for float8 dtypes; blocks are moved bit for bit either way."""
    return pool.view(torch.uint8) if pool.dtype.is_floating_point and pool.element_size() == 1 else pool


def _copy_blocks(src: torch.Tensor, src_blocks: Sequence[int], dst: torch.Tensor, dst_blocks: Sequence[int]) -> None:
    """CPU: gather, then scatter; done on return."""
    gathered = src.index_select(BLOCK_DIM, torch.tensor(list(src_blocks), dtype=torch.int64))
    dst.index_copy_(BLOCK_DIM, torch.tensor(list(dst_blocks), dtype=torch.int64), gathered)


def _index(blocks: list[int], device: torch.device) -> torch.Tensor:
    """Block indices on `device`, copied on its current stream from pinned memory, without blocking."""
    return torch.tensor(blocks, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
