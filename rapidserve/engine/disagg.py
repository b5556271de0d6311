"""Disagg mode (`rapidserve serve --mode disagg`): a prefill side on N GPUs and a decode side on M others (NPMD),
behind the same router and rings as rapid mode (DistServe / Dynamo's disaggregated baseline; 1P1D by default).

The message flow is rapid mode's, so the decode worker and its scheduler are unchanged: decode owns
the weights, the KV pool, the block tables and the prefix cache on its GPUs (the whole GPU: partition
plan "none"), and hands each admitted request to prefill in a KVReady naming its blocks in that pool.
What differs is prefill's side:
- it loads its own copy of the weights on its GPUs and computes into a staging KV pool there, whose
  blocks its own `StagingAllocator` (parallel/staging.py) hands out per job;
- the one-time hand-off from decode carries the IPC handle of decode's KV pool only (shared memory
  on CPU), through which a `KVConnector` (parallel/kv_connector.py: `DevicePeerConnector`, a peer
  copy) moves blocks between the two pools.

Tensor parallelism on either side (`--prefill-tensor-parallel-size N`, `--tensor-parallel-size M`; checked by
`ParallelConfig.disagg_problem`: N and M divide the model's KV heads, one divides the other). GPUs: prefill rank
r on `disagg_gpus()[0][r]` (default GPU r), decode rank s on `disagg_gpus()[1][s]` (default GPU N + s). Each side
is a tensor-parallel group of its own (engine/tp_workers.py): rank 0 leads, ranks 1.. follow its calls
(parallel/mirror.py). Every rank's pool (decode's, and prefill's staging pool) holds that rank's KV heads only,
the same block indices on every rank of a side (decode's block tables, prefill's staging blocks: both decided by
the side's leader; each side's ranks agree on their pool's size). Prefill rank r moves blocks only with the decode
ranks whose heads overlap its own, and only the overlapping heads (parallel/kv_routes.py: with N == M, rank r <->
rank r; with N | M, one prefill rank <-> M/N decode ranks, each over a slice of its heads; with M | N the
reverse). At start-up decode rank s hands its pool to each prefill rank it overlaps (`decode_peers`), one pipe
per pair. The prefill leader publishes each of its pulls and pushes to its followers, in order with the forwards
(mirror.KVMove), and each rank moves its own heads; the leader's waits for its moves (below) also wait, through a
fence (mirror.KVFence: the followers wait for theirs, then join one all-reduce the leader reads on the host;
parallel/kv_mirror.py), for every follower's. So each invariant below holds on every rank of both sides.

One job (a KVReady): when a batch first takes it, it gets staging blocks for all its tokens (local[i]
stands for the KVReady's block_ids[i]) and the blocks of the prefix decode has cached
(`cached_tokens`) are pulled into them; each forward computes into staging and, as soon as it is
queued, the blocks it completed (full blocks, and at the end the last one) are pushed into decode's
blocks. PrefillDone (and a first token that ends the request) is published only once every push of
the job has landed on every rank, and its staging blocks are then freed; a job that fails or is dropped has
its pushes waited for and its staging freed before PrefillFailed / Dropped, so decode never frees or
reads a block a push still writes, and no staging block leaks.

Stream ordering (GPU; the connector's docstring gives each copy's steps): forwards run on prefill's
stream S on each prefill GPU. A pull is queued on S's order (its scatter on S, ahead of the forward that reads
it). A push of chunk k waits for S at the point after chunk k's forward, then gathers, copies and
scatters on the connector's own streams, so chunk k+1's forward (queued on S right after) runs
beside chunk k's copy. Chunk k+1 only writes blocks chunk k did not complete (the partial last block
of chunk k is pushed with a later chunk), so a push never reads a block a later forward writes.
The host waits on the pushes' events (`Transfer.wait`; on the leader with followers, the fence) before
PrefillDone / PrefillFailed / Dropped, and before a retry rewrites blocks a failed attempt pushed; staging blocks
are reused only after that wait, and later writes to them are queued on S, behind every earlier forward (a
follower replays the fence before any later forward, in the mirror's order).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.engine import messages as m
from rapidserve.engine.decode_worker import DecodeWorker, fused_graph_key
from rapidserve.engine.faults import is_fatal
from rapidserve.engine.prefill_worker import Job, PrefillWorker
from rapidserve.engine.tp_workers import TPSeat, capture_decode, lead, open_group, send_plan
from rapidserve.engine.worker_build import BUILDERS, memory_info
from rapidserve.engine.worker_io import Build, WorkerIO
from rapidserve.ipc import Receiver
from rapidserve.loader import resolve_model
from rapidserve.parallel.kv_connector import (
    DevicePeerConnector,
    KVConnector,
    ShardedConnector,
    SharedPool,
    Transfer,
    attach_pool,
    export_pool,
)
from rapidserve.parallel.kv_mirror import FollowerKV, MirroredConnector
from rapidserve.parallel.kv_routes import head_routes, prefill_routes
from rapidserve.parallel.mirror import Setup, wait_message
from rapidserve.parallel.staging import StagingAllocator
from rapidserve.partition.backend import PartitionBackend
from rapidserve.partition.plan import PlanWire, open_streams, resolve_plan
from rapidserve.partition.profile import Profile
from rapidserve.partition.roofline import kv_element_bytes
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition_config import PartitionConfig
from rapidserve.prompt import PromptLimits
from rapidserve.runner import ModelRunner, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


def builders_for(cfg: EngineConfig) -> dict[str, Build]:
    """The role -> builder table of `cfg`'s mode (the launcher's). For disagg its GPUs are checked here,
    in the router, before any worker starts."""
    if cfg.launch.mode != "disagg":
        return BUILDERS
    disagg_devices(cfg)
    return {**BUILDERS, "decode": build_disagg_decode, "prefill": build_disagg_prefill}


def _gpus(ids: Sequence[int]) -> str:
    return f"GPU {ids[0]}" if len(ids) == 1 else f"GPUs {', '.join(map(str, ids))}"


def disagg_devices(cfg: EngineConfig) -> tuple[list[torch.device], list[torch.device]]:
    """(the prefill ranks' devices, the decode ranks'): `ParallelConfig.disagg_gpus` (prefill on the first N GPUs,
    decode on the next M); on CPU every rank the CPU. ConfigError when those GPUs are not all visible."""
    dev = resolve_device(cfg.runner.device)
    par = cfg.parallel
    if dev.type == "cpu":
        return [dev] * par.prefill_tp, [dev] * par.tensor_parallel_size
    pre, dec = par.disagg_gpus()
    n = torch.cuda.device_count()
    if max(pre + dec) >= n:
        raise ConfigError(f"--mode disagg runs prefill on {_gpus(pre)} and decode on {_gpus(dec)}, but {n} GPU"
                          f"{'' if n == 1 else 's'} {'is' if n == 1 else 'are'} visible; it needs {len(pre + dec)} "
                          "(check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES), or use --mode rapid on one GPU")
    return [torch.device("cuda", g) for g in pre], [torch.device("cuda", g) for g in dec]


def handoff_pairs(cfg: EngineConfig) -> list[tuple[int, int]]:
    """(decode rank, prefill rank) of every start-up hand-off of decode's pool: the pairs that share KV heads."""
    par = cfg.parallel
    return [(h.decode_rank, h.prefill_rank)
            for h in head_routes(cfg.model_config.num_kv_heads, par.prefill_tp, par.tensor_parallel_size)]


def instance_config(cfg: EngineConfig) -> EngineConfig:
    """An instance has its GPU to itself: no compute partition (plan "none")."""
    return dataclasses.replace(cfg, partition=PartitionConfig(mode="off", backend="none",
                                                              slo_itl_ms=cfg.partition.slo_itl_ms))


def _load(cfg: EngineConfig, dev: torch.device, seat: TPSeat | None) -> ModelRunner:
    """This rank's own weights (its shard, in its group) and KV pool on `dev` (made the current GPU: the group
    and the runner take it)."""
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:  # on CPU every rank of both sides shares the cores
        ranks = cfg.parallel.prefill_tp + cfg.parallel.tensor_parallel_size
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // ranks))
    source = resolve_model(cfg.model, preset_device=dev, preset_dtype=resolve_dtype(cfg.runner.dtype, dev))
    return ModelRunner(cfg, source, show_progress=False, tp=open_group(cfg, seat))


def _rank(seat: TPSeat | None) -> int:
    return 0 if seat is None else seat.spec.rank


def _hand_pool(handoff: Sequence[Any], runner: ModelRunner, rank: int, wire: PlanWire) -> None:
    """Decode rank `rank`'s pool to each prefill rank it shares heads with (`handoff`: a pipe to each)."""
    shared = export_pool(runner.kv_pool)
    for conn in handoff:
        conn.send((os.getpid(), rank, shared, wire))
        conn.close()


def _connect(cfg: EngineConfig, runner: ModelRunner, handoff: Sequence[Any], rank: int,
             owners: list[int]) -> tuple[KVConnector, int, PlanWire]:
    """Prefill rank `rank`'s connector to the decode pools it shares heads with (one pipe each, by decode rank),
    the decode pool's number of blocks and decode's plan; the pools' owners are added to `owners`."""
    par = cfg.parallel
    routes = prefill_routes(cfg.model_config.num_kv_heads, par.prefill_tp, par.tensor_parallel_size, rank)
    decode_devs = disagg_devices(cfg)[1]
    parts: list[KVConnector] = []
    blocks, wire = 0, None
    for route, conn in zip(routes, handoff, strict=True):
        if not conn.poll(cfg.launch.startup_timeout_s):
            raise TimeoutError(f"no KV pool from decode rank {route.decode_rank} in "
                               f"{cfg.launch.startup_timeout_s:.0f} s")
        owner_pid, sender, shared, wire = conn.recv()
        conn.close()
        assert isinstance(shared, SharedPool)
        if sender != route.decode_rank:
            raise RuntimeError(f"prefill rank {rank} got decode rank {sender}'s pool for rank {route.decode_rank}'s")
        owners.append(int(owner_pid))
        remote = attach_pool(shared, runner.kv_pool, decode_devs[route.decode_rank],
                             kv_heads=cfg.model_config.num_kv_heads // par.tensor_parallel_size)
        blocks = int(remote.shape[2])
        parts.append(DevicePeerConnector(runner.kv_pool.tensor, remote, local_heads=route.prefill_heads,
                                         remote_heads=route.decode_heads))
    assert wire is not None
    return (parts[0] if len(parts) == 1 else ShardedConnector(parts)), blocks, wire


def build_disagg_decode(cfg: EngineConfig, io: WorkerIO, handoff: Sequence[Any], seat: TPSeat | None = None,
                        profile: Profile | None = None) -> tuple[dict[str, str], DecodeWorker]:
    """Rapid mode's decode worker on its own GPU (rank 0 of the decode side, with its followers under `seat`); the
    hand-off carries only its KV pool, to each prefill rank it shares heads with. `profile`: as build_decode's."""
    dev = disagg_devices(cfg)[1][0]
    cfg = instance_config(cfg)
    runner = _load(cfg, dev, seat)
    plan = resolve_plan(cfg, runner.device, runner.dtype, profile)
    wire = msgspec.structs.replace(plan.wire(), fused_graphs=fused_graph_key(cfg, plan))
    send_plan(seat, wire)  # decode followers capture the same graphs, in this order
    parts = open_streams(wire, runner.device, ("decode",))
    capture_decode(runner, parts, wire.fused_graphs)
    _hand_pool(handoff, runner, 0, wire)
    lead(runner, seat, parts, "decode")
    info = {"kv_blocks": str(runner.kv_pool.num_blocks), "device": str(runner.device), "partition": plan.source,
            "configurations": ",".join(parts.names), "mode": "disagg",
            "ranks": f"{cfg.parallel.prefill_tp}P{cfg.parallel.tensor_parallel_size}D", **memory_info(runner)}
    return info, DecodeWorker(cfg, runner, io, DecodePartition(
        cfg.partition, plan, cfg.model_config, cfg.scheduler.max_num_batched_tokens,
        tensor_parallel_size=cfg.parallel.tensor_parallel_size, kv_bytes=kv_element_bytes(cfg.cache),
        quant=cfg.quantization), parts)


def build_disagg_prefill(cfg: EngineConfig, io: WorkerIO, handoff: Sequence[Any],
                         seat: TPSeat | None = None) -> tuple[dict[str, str], DisaggPrefillWorker]:
    """Its own weights and staging pool on its GPU (loaded while decode loads), then decode's pools; with
    followers (`seat`) its connector publishes every move to them (parallel/kv_mirror.py)."""
    dev = disagg_devices(cfg)[0][0]
    cfg = instance_config(cfg)
    runner = _load(cfg, dev, seat)
    connector, decode_blocks, wire = _connect(cfg, runner, handoff, 0, io.peer_pids)  # we end with their owners
    parts = open_streams(wire, runner.device, ("prefill",))
    lead(runner, seat, parts, "prefill")
    if runner.leader is not None:
        connector = MirroredConnector(connector, runner.leader)
    worker = DisaggPrefillWorker(cfg, runner, io, parts, wire.initial, connector, decode_blocks)
    info = {"device": str(runner.device), "mode": "disagg", "staging_blocks": str(runner.kv_pool.num_blocks),
            "kv_connector": connector.describe(), **memory_info(runner)}
    return info, worker


def start_disagg_follower(role: str, seat: TPSeat, cfg: EngineConfig, inbox: Receiver[Any], handoff: Sequence[Any],
                          peers: list[int]) -> tuple[ModelRunner, PartitionBackend | None, FollowerKV | None]:
    """A follower of either side (tp_workers.run_follower's `start`), call for call as its leader's start-up:
    decode loads its shard, captures the plan's graphs and hands its pool to the prefill ranks it shares heads
    with; prefill loads its own shard and attaches the decode pools it moves heads with."""
    rank = seat.spec.rank
    pre, dec = disagg_devices(cfg)
    cfg = instance_config(cfg)
    if role == "decode":
        runner = _load(cfg, dec[rank], seat)
        setup = wait_message(inbox, Setup, cfg.launch.startup_timeout_s)
        wire = msgspec.msgpack.decode(setup.plan, type=PlanWire)
        parts = open_streams(wire, runner.device, ("decode",))
        capture_decode(runner, parts, wire.fused_graphs)  # as the leader (build_disagg_decode)
        _hand_pool(handoff, runner, rank, wire)
        return runner, parts, None
    runner = _load(cfg, pre[rank], seat)
    connector, _, wire = _connect(cfg, runner, handoff, rank, peers)
    return runner, open_streams(wire, runner.device, ("prefill",)), FollowerKV(connector)


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
        # the stop rule's context cap is decode's (its pool's capacity) ...
        self.context_cap = PromptLimits(cfg.model_config.vocab_size, cfg.max_model_len,
                                        decode_blocks * self.bs).context_cap
        self.staging = StagingAllocator(runner.kv_pool.num_blocks)
        self.staged: dict[int, Staged] = {}  # by id(job), while the job is in waiting_prefill
        need = -(-self.context_cap // self.bs)
        if not self.staging.fits(need) and cfg.scheduler.fit_max_model_len:
            # ... and under --max-model-len auto at most this staging pool's: the router caps every request there
            # (WorkerSet.pool_tokens reads this worker's Ready "staging_blocks"), so a preempted request, prefilled
            # again whole, always fits
            self.context_cap = self.staging.num_blocks * self.bs
            log.warning("--max-model-len auto: the staging KV pool on %s holds %d tokens, fewer than the %d the "
                        "model and decode's pool allow: a request's prompt and output may reach %d tokens",
                        runner.device, self.context_cap, need * self.bs, self.context_cap)
        elif not self.staging.fits(need):
            raise ConfigError(f"the staging KV pool on {runner.device} has {self.staging.num_blocks} blocks but one "
                              f"request may need {need} ({self.context_cap} tokens): raise --num-kv-blocks or "
                              "--gpu-memory-utilization, lower --max-model-len, or give --max-model-len auto (the "
                              "length then fits the smaller pool)")

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
