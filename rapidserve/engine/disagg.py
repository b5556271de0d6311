"""Disagg mode (`rapidserve serve --mode disagg`): one prefill instance on one GPU, one decode
instance on another, behind the same router and rings as rapid mode (DistServe / Dynamo 1P1D, the
disaggregated baseline).

The message flow is rapid mode's, so the decode worker and its scheduler are unchanged: decode owns
the weights, the KV pool, the block tables and the prefix cache on its GPU (the whole GPU: partition
plan "none"), and hands each admitted request to prefill in a KVReady naming its blocks in that pool.
What differs is prefill's side:
- it loads its own copy of the weights on its GPU and computes into a staging KV pool there, whose
  blocks its own `StagingAllocator` (parallel/staging.py) hands out per job;
- the one-time hand-off from decode carries the IPC handle of decode's KV pool only (shared memory
  on CPU), through which a `KVConnector` (parallel/kv_connector.py: `DevicePeerConnector`, a peer
  copy) moves blocks between the two pools.

One job (a KVReady): when a batch first takes it, it gets staging blocks for all its tokens (local[i]
stands for the KVReady's block_ids[i]) and the blocks of the prefix decode has cached
(`cached_tokens`) are pulled into them; each forward computes into staging and, as soon as it is
queued, the blocks it completed (full blocks, and at the end the last one) are pushed into decode's
blocks. PrefillDone (and a first token that ends the request) is published only once every push of
the job has landed, and its staging blocks are then freed; a job that fails or is dropped has its
pushes waited for and its staging freed before PrefillFailed / Dropped, so decode never frees or
reads a block a push still writes, and no staging block leaks.

Stream ordering (GPU; the connector's docstring gives each copy's steps): forwards run on prefill's
stream S on GPU A. A pull is queued on S's order (its scatter on S, ahead of the forward that reads
it). A push of chunk k waits for S at the point after chunk k's forward, then gathers, copies and
scatters on the connector's own streams, so chunk k+1's forward (queued on S right after) runs
beside chunk k's copy. Chunk k+1 only writes blocks chunk k did not complete (the partial last block
of chunk k is pushed with a later chunk), so a push never reads a block a later forward writes.
The host waits on the pushes' events (`Transfer.wait`) before PrefillDone / PrefillFailed / Dropped,
and before a retry rewrites blocks a failed attempt pushed; staging blocks are reused only after that
wait, and later writes to them are queued on S, behind every earlier forward.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import torch

from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.engine import messages as m
from rapidserve.engine.decode_worker import DecodeWorker
from rapidserve.engine.faults import is_fatal
from rapidserve.engine.prefill_worker import Job, PrefillWorker
from rapidserve.engine.worker_build import BUILDERS, memory_info
from rapidserve.engine.worker_io import Build, WorkerIO
from rapidserve.loader import resolve_model
from rapidserve.parallel.kv_connector import DevicePeerConnector, KVConnector, Transfer, attach_pool, export_pool
from rapidserve.parallel.staging import StagingAllocator
from rapidserve.partition.backend import PartitionBackend
from rapidserve.partition.runtime import DecodePartition, open_streams, resolve_plan
from rapidserve.partition_config import PartitionConfig
from rapidserve.prompt import PromptLimits
from rapidserve.runner import ModelRunner, resolve_device, resolve_dtype


def builders_for(cfg: EngineConfig) -> dict[str, Build]:
    """The role -> builder table of `cfg`'s mode (the launcher's). For disagg its GPUs are checked here,
    in the router, before any worker starts."""
    if cfg.launch.mode != "disagg":
        return BUILDERS
    disagg_devices(cfg)
    return {**BUILDERS, "decode": build_disagg_decode, "prefill": build_disagg_prefill}


def disagg_devices(cfg: EngineConfig) -> tuple[torch.device, torch.device]:
    """(prefill's device, decode's): GPUs 0 and 1, or `ParallelConfig.devices`; on CPU both the CPU."""
    dev = resolve_device(cfg.runner.device)
    if dev.type == "cpu":
        return dev, dev
    gpus = cfg.parallel.devices or (0, 1)
    n = torch.cuda.device_count()
    if len(gpus) != 2 or n < 2 or max(gpus) >= n:
        raise ConfigError(f"--mode disagg runs prefill on GPU {gpus[0]} and decode on GPU {gpus[-1]}, but {n} GPU"
                          f"{'' if n == 1 else 's'} {'is' if n == 1 else 'are'} visible; it needs two (check "
                          "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES), or use --mode rapid on one GPU")
    return torch.device("cuda", gpus[0]), torch.device("cuda", gpus[1])


def instance_config(cfg: EngineConfig) -> EngineConfig:
    """An instance has its GPU to itself: no compute partition (plan "none")."""
    return dataclasses.replace(cfg, partition=PartitionConfig(mode="off", backend="none",
                                                              slo_itl_ms=cfg.partition.slo_itl_ms))


def _load(cfg: EngineConfig, dev: torch.device) -> ModelRunner:
    """This instance's own weights and KV pool on `dev` (made the current GPU: the runner takes it)."""
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # on CPU the two instances share the cores
    source = resolve_model(cfg.model, preset_device=dev, preset_dtype=resolve_dtype(cfg.runner.dtype, dev))
    return ModelRunner(cfg, source, show_progress=False)


def build_disagg_decode(cfg: EngineConfig, io: WorkerIO, handoff: Any,
                        seat: Any = None) -> tuple[dict[str, str], DecodeWorker]:
    """Rapid mode's decode worker on its own GPU; the hand-off carries only its KV pool. (`seat`: always None,
    disagg takes no tensor parallelism.)"""
    _, dev = disagg_devices(cfg)
    cfg = instance_config(cfg)
    runner = _load(cfg, dev)
    plan = resolve_plan(cfg, runner.device, runner.dtype)
    parts = open_streams(plan.wire(), runner.device, ("decode",))
    for c in parts.configurations:
        runner.capture_decode_graphs(parts.stream(c.name, "decode"), key=c.name, show_progress=False,
                                     whole_gpu=c.decode_whole)
    handoff.send((os.getpid(), export_pool(runner.kv_pool), plan.wire()))
    handoff.close()
    info = {"kv_blocks": str(runner.kv_pool.num_blocks), "device": str(runner.device), "partition": plan.source,
            "configurations": ",".join(parts.names), "mode": "disagg", **memory_info(runner)}
    return info, DecodeWorker(cfg, runner, io, DecodePartition(cfg.partition, plan, cfg.model_config,
                                                                 cfg.scheduler.max_num_batched_tokens), parts)


def build_disagg_prefill(cfg: EngineConfig, io: WorkerIO, handoff: Any,
                         seat: Any = None) -> tuple[dict[str, str], DisaggPrefillWorker]:
    """Its own weights and staging pool on its GPU (loaded while decode loads), then decode's pool."""
    dev, decode_dev = disagg_devices(cfg)
    cfg = instance_config(cfg)
    runner = _load(cfg, dev)
    if not handoff.poll(cfg.launch.startup_timeout_s):
        raise TimeoutError(f"no KV pool from the decode worker in {cfg.launch.startup_timeout_s:.0f} s")
    owner_pid, shared, wire = handoff.recv()
    handoff.close()
    io.peer_pids.append(int(owner_pid))  # the owner of the decode pool: we end with it
    remote = attach_pool(shared, runner.kv_pool, decode_dev)
    connector = DevicePeerConnector(runner.kv_pool.tensor, remote)
    parts = open_streams(wire, runner.device, ("prefill",))
    worker = DisaggPrefillWorker(cfg, runner, io, parts, wire.initial, connector, int(remote.shape[2]))
    info = {"device": str(runner.device), "mode": "disagg", "staging_blocks": str(runner.kv_pool.num_blocks),
            "kv_connector": connector.describe(), **memory_info(runner)}
    return info, worker


@dataclass
class Staged:
    """A job's staging blocks: local[i] stands for decode's remote[i]."""

    local: list[int]
    remote: list[int]
    pushed: int  # blocks [0, pushed) are in decode's pool, or on their way (committed pushes)
    tried: int  # pushed by the attempt in progress (> pushed until that attempt succeeds)
    transfers: list[Transfer] = field(default_factory=list)

    def wait(self) -> None:
        for t in self.transfers:
            t.wait()
        self.transfers.clear()


class DisaggPrefillWorker(PrefillWorker):
    """The prefill worker over its own staging pool; the KV moves to decode's through `connector`.

    `Job.blocks` holds the job's staging blocks once a batch has taken it (decode's, from KVReady,
    before that); the staging record holds decode's."""

    def __init__(self, cfg: EngineConfig, runner: ModelRunner, io: WorkerIO, backend: PartitionBackend,
                 partition: str, connector: KVConnector, decode_blocks: int) -> None:
        super().__init__(cfg, runner, io, backend, partition)
        self.connector = connector
        self.bs = runner.block_size
        # the stop rule's context cap is decode's (its pool's capacity), not this staging pool's
        self.context_cap = PromptLimits(cfg.model_config.vocab_size, cfg.max_model_len,
                                        decode_blocks * self.bs).context_cap
        self.staging = StagingAllocator(runner.kv_pool.num_blocks)
        self.staged: dict[int, Staged] = {}  # by id(job), while the job is in waiting_prefill
        need = -(-self.context_cap // self.bs)
        if not self.staging.fits(need):
            raise ConfigError(f"the staging KV pool on {runner.device} has {self.staging.num_blocks} blocks but one "
                              f"request may need {need} ({self.context_cap} tokens): raise --num-kv-blocks or "
                              "--gpu-memory-utilization, or lower --max-model-len")

    # ---- staging: taken with the batch, freed with the job ------------------------------------
    def take_batch(self, hold: AbstractSet[str] = frozenset()) -> list[tuple[Job, int]]:
        """The base batch, cut before the first job that finds no staging room (it waits for jobs ahead
        of it to end; the one at the head always fits, since staging holds a longest request)."""
        kept: list[tuple[Job, int]] = []
        for job, n in super().take_batch(hold):
            if not self._stage(job):
                break
            kept.append((job, n))
        return kept

    def _stage(self, job: Job) -> bool:
        if id(job) in self.staged:
            return True
        n = -(-len(job.tokens) // self.bs)
        local = self.staging.allocate(id(job), n)
        if local is None:
            return False
        s = Staged(local, list(job.blocks[:n]), job.done_tokens // self.bs, job.done_tokens // self.bs)
        self.staged[id(job)] = s
        job.blocks = local
        cached = -(-job.done_tokens // self.bs)  # the prefix decode has: into staging, ahead of the forward
        try:
            s.transfers.append(self.connector.pull(s.remote[:cached], local[:cached]))
        except Exception as e:  # noqa: BLE001 - this request fails alone
            if is_fatal(e):
                raise
            self._fail(job, e)
            return False
        return True

    def _release(self, job: Job) -> None:
        """Wait for the job's transfers, then free its staging blocks (idempotent)."""
        s = self.staged.pop(id(job), None)
        if s is not None:
            s.wait()
            self.staging.free(id(job))

    # ---- the seams of PrefillWorker._compute --------------------------------------------------
    def _compute(self, batch: list[tuple[Job, int]]) -> None:
        for job, _ in batch:
            s = self.staged[id(job)]
            if s.tried != s.pushed:  # a retry: the failed attempt's pushes read blocks this forward rewrites
                s.wait()
                s.tried = s.pushed
        if batch:
            super()._compute(batch)

    def forward_queued(self, batch: list[tuple[Job, int]]) -> None:
        """Push the blocks this forward completed: full ones, and the last one with the job's last chunk."""
        for job, n in batch:
            s = self.staged[id(job)]
            upto = job.done_tokens + n
            end = len(s.local) if upto == len(job.tokens) else upto // self.bs
            if end > s.tried:
                s.transfers.append(self.connector.push(s.local[s.tried:end], s.remote[s.tried:end]))
                s.tried = end

    def computed(self, batch: list[tuple[Job, int]], finished: list[Job]) -> None:
        """The attempt succeeded: its pushes count. Finished jobs wait for theirs (PrefillDone follows)
        and give their staging back."""
        for job in finished:
            self.staged[id(job)].wait()
        for job, _ in batch:
            s = self.staged[id(job)]
            s.pushed = s.tried
        for job in finished:
            self._release(job)

    # ---- job ends other than done ---------------------------------------------------------------
    def _fail(self, job: Job, e: BaseException) -> None:
        self.runner.synchronize()  # a forward that raised may still be writing its staging blocks
        self._release(job)
        super()._fail(job, e)

    def handle(self, msg: object) -> None:
        if isinstance(msg, m.Drop):  # before Dropped: nothing of ours still writes the blocks decode frees
            for job in [j for j in self.waiting_prefill if j.req.req_id == msg.req_id]:
                self._release(job)
        super().handle(msg)

    def heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= self.cfg.launch.stats_interval_s:
            self._last_beat = now
            self.io.to_router.try_send(m.Heartbeat("prefill", len(self.waiting_prefill), self.staging.in_use))
