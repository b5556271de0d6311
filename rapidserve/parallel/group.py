"""A tensor-parallel group: the processes that hold one shard each of every layer (issue 17).

One group per role: in rapid mode the decode workers of the N GPUs form one communicator and the
prefill workers another (hybrid: the hybrid workers one), each process a member of exactly one group,
so the two phases' collectives never interleave on one communicator and run concurrently, each on the
stream (and so in the compute partition) its worker made current. A process's group is its
torch.distributed default group: NCCL on NVIDIA, RCCL on ROCm (torch's "nccl" backend is RCCL there,
the same code), gloo on CPU (tests).

Streams: with `async_op=False` (all calls here) torch >= 2.8 launches an NCCL collective on the
caller's current stream (pytorch#150398), not on a side stream of its own; so a collective queued
inside a worker's partition stream runs inside that partition, and one queued during graph capture is
captured on the capture stream. The communicator is made at `TPGroup` creation (eagerly, one
all-reduce), so a later capture never tries to create it.

What NCCL needs inside a partition (green context / CU mask): its kernels launch one CTA per channel and
the CTAs of a rank wait on their peers; a partition of k SMs runs k CTAs at a time, so the launcher caps
NCCL's CTAs (`NCCL_MAX_CTAS`, `engine.tp_workers.tp_env`) at the smallest default partition's SM count.
Everything else is as on a whole GPU.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rapidserve.config import ModelConfig
from rapidserve.parallel.shard import TPLayout, tp_layout

ROLES = ("decode", "prefill", "hybrid")


@dataclass(frozen=True)
class GroupSpec:
    """Where rank `rank` of a `size`-rank group of `role` workers meets the others (picklable: it rides
    the spawn arguments)."""

    role: str
    size: int
    rank: int
    init_method: str  # tcp://127.0.0.1:PORT, one port per role
    backend: str  # nccl | gloo | auto (nccl on a GPU, gloo on the CPU)
    timeout_s: float = 1800.0

    @property
    def leader(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port free on this host now (the group's rendezvous; the router picks one per role)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_specs(role: str, size: int, backend: str) -> list[GroupSpec]:
    """The specs of one role's ranks, sharing a fresh rendezvous port."""
    url = f"tcp://127.0.0.1:{free_port()}"
    return [GroupSpec(role, size, r, url, backend) for r in range(size)]


class TPGroup:
    """This process's tensor-parallel group: its rank, the model shard it holds (`layout`), collectives."""

    def __init__(self, spec: GroupSpec, cfg: ModelConfig, device: torch.device) -> None:
        self.spec = spec
        self.size, self.rank = spec.size, spec.rank
        self.layout: TPLayout = tp_layout(cfg, spec.size, spec.rank)  # ShardError before any rendezvous
        self.device = device
        self.vocab_size = cfg.vocab_size
        kw: dict[str, object] = {}
        if device.type == "cuda":
            kw["device_id"] = device  # eager communicator: made now, not inside a graph capture
        backend = spec.backend if spec.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        self.backend = backend
        dist.init_process_group(backend, init_method=spec.init_method, world_size=spec.size, rank=spec.rank,
                                timeout=datetime.timedelta(seconds=spec.timeout_s), **kw)
        # every rank is here, the communicator works, and each knows the others' processes (the leader waits for
        # its followers' exit at shutdown: engine/tp_workers.stop_followers)
        pids = torch.zeros(spec.size, dtype=torch.int64, device=device)
        pids[spec.rank] = os.getpid()
        self.pids: tuple[int, ...] = tuple(int(p) for p in self.all_reduce(pids).tolist())

    # ---- collectives (in place where they can be; all on the current stream) -------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """[T, V/N] slices of the vocabulary (rank r holds rows r*V/N..) -> [T, V], the padding dropped."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.backend == "gloo":
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x)
            full = torch.cat(parts, dim=-1)
        else:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x)
            full = out.permute(1, 0, 2).reshape(x.shape[0], self.size * x.shape[1])
        return full[:, : self.vocab_size]

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(x, src)
        return x

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' `value`s (e.g. KV blocks: every rank's pool must be the same size)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        """Destroy this process's group (tests; an engine's ranks keep theirs to the end: engine/tp_workers.py)."""
        if dist.is_initialized():
            dist.destroy_process_group()
