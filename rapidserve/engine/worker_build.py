"""How each worker role is built inside its process, for `worker_io.run_worker(role, build, ...)`.

Each `build_*` loads or attaches the model, prepares the compute partition's streams and graphs, and
returns what its Ready message tells the router plus the worker whose loop then runs.

- decode: loads the weights, allocates the KV pool, captures the decode graphs of every partition
  configuration (and, when its policy runs fused steps, their piecewise prefill graphs), and hands the IPC handles
  of weights and pool to prefill through a one-time pipe (the send returns once prefill has read it all; prefill
  starts at the same time and waits).
- prefill: attaches decode's weights and pool in place (no copy) and ends with decode, their owner;
  under `--policy drift` it is the block-wise `DriftPrefillWorker`, fed the plan's prefill time models.
- hybrid: the decode worker alone, its own weights and pool, every step fused (the baseline; no partition, no
  prefill worker).

With tensor parallelism each builder gets its `TPSeat` (engine/tp_workers.py): it joins its role's
group before loading, and once start-up's own collectives are done its runner publishes every call to
the followers (`lead`); decode first sends them the partition plan.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import torch

from rapidserve.config import EngineConfig
from rapidserve.engine.decode_worker import DecodeWorker, fused_graph_key
from rapidserve.engine.drift_prefill import DriftPrefillWorker
from rapidserve.engine.prefill_worker import PrefillWorker
from rapidserve.engine.tp_workers import (
    TPSeat,
    capture_decode,
    capture_hybrid,
    capture_prefill,
    lead,
    open_group,
    send_plan,
)
from rapidserve.engine.worker_io import WorkerIO
from rapidserve.partition.drift import LinearModel
from rapidserve.partition.plan import PartitionPlan, open_streams, resolve_plan
from rapidserve.partition.profile import OVERALLOCATED, Configuration, Profile
from rapidserve.partition.roofline import kv_element_bytes
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition.step_policies import AlwaysFused
from rapidserve.runner import ModelRunner, load_runner
from rapidserve.runner.model_sharing import export_shared

log = logging.getLogger(__name__)


def build_decode(cfg: EngineConfig, io: WorkerIO, handoff: Any, seat: TPSeat | None = None,
                 profile: Profile | None = None) -> tuple[dict[str, str], DecodeWorker]:
    """`profile`: the file `cfg.partition.profile` names, parsed at start-up (launch.role_builder); None: the plan
    reads whichever profile applies itself."""
    _share_cpu_cores(cfg)
    runner = load_runner(cfg, open_group(cfg, seat), step_processes=2)  # the prefill worker's steps: its own peak
    log.info("choosing the compute partition plan (from a measured profile, or a roofline of peaks measured now)")
    plan = resolve_plan(cfg, runner.device, runner.dtype, profile)
    log.info("partition plan: %s", plan.source)
    wire = msgspec.structs.replace(plan.wire(), fused_graphs=fused_graph_key(cfg, plan))
    send_plan(seat, wire)  # decode followers capture the same graphs, in this order
    parts = open_streams(wire, runner.device, ("decode",))
    capture_decode(runner, parts, wire.fused_graphs)
    handoff.send((os.getpid(), export_shared(runner.model, runner.kv_pool), wire))
    handoff.close()
    lead(runner, seat, parts, "decode")
    info = {"kv_blocks": str(runner.kv_pool.num_blocks), "device": str(runner.device), "partition": plan.source,
            "configurations": ",".join(parts.names), "fused_graphs": wire.fused_graphs or "none",
            **memory_info(runner)}
    return info, DecodeWorker(cfg, runner, io, DecodePartition(
        cfg.partition, plan, cfg.model_config, cfg.scheduler.max_num_batched_tokens,
        tensor_parallel_size=cfg.parallel.tensor_parallel_size, kv_bytes=kv_element_bytes(cfg.cache),
        quant=cfg.quantization), parts)


def build_prefill(cfg: EngineConfig, io: WorkerIO, handoff: Any,
                  seat: TPSeat | None = None) -> tuple[dict[str, str], PrefillWorker]:
    _share_cpu_cores(cfg)
    log.info("waiting for the decode worker's weights")
    if not handoff.poll(cfg.launch.startup_timeout_s):
        raise TimeoutError(f"no weights from the decode worker in {cfg.launch.startup_timeout_s:.0f} s")
    owner_pid, shared, wire = handoff.recv()
    handoff.close()
    log.info("attaching the decode worker's weights and KV cache (no copy)")
    io.peer_pids.append(int(owner_pid))  # the owner of the shared memory: we end with it
    runner = ModelRunner(cfg, None, attached=shared, show_progress=False, tp=open_group(cfg, seat))
    parts = open_streams(wire, runner.device, ("prefill",))
    capture_prefill(cfg, runner, parts)
    lead(runner, seat, parts, "prefill")
    info = {"device": str(runner.device), **memory_info(runner)}
    if cfg.partition.policy == "drift":  # block-wise prefill, preemption (engine/drift_prefill.py)
        models = {k: LinearModel(*v) for k, v in wire.prefill_models.items()}
        return info, DriftPrefillWorker(cfg, runner, io, parts, wire.initial, models)
    return info, PrefillWorker(cfg, runner, io, parts, wire.initial)


def build_hybrid(cfg: EngineConfig, io: WorkerIO, handoff: Any,
                 seat: TPSeat | None = None) -> tuple[dict[str, str], DecodeWorker]:
    """The decode worker alone, every step fused (`AlwaysFused`): no prefill worker, no partition (the current
    stream, one configuration: the whole GPU)."""
    runner = load_runner(cfg, open_group(cfg, seat))
    capture_hybrid(runner)
    lead(runner, seat, None, "hybrid")
    info = {"kv_blocks": str(runner.kv_pool.num_blocks), "device": str(runner.device), "mode": "hybrid",
            **memory_info(runner)}
    plan = PartitionPlan("none", [Configuration(OVERALLOCATED, 0, 0)], None, "hybrid: one worker, the whole GPU")
    return info, DecodeWorker(cfg, runner, io, DecodePartition(cfg.partition, plan), None, AlwaysFused())


BUILDERS = {"decode": build_decode, "prefill": build_prefill, "hybrid": build_hybrid}


def _share_cpu_cores(cfg: EngineConfig) -> None:
    """On CPU the two RAPID workers share the cores: half each."""
    if cfg.runner.device == "cpu" or not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))


def memory_info(runner: ModelRunner) -> dict[str, str]:
    """What this process holds: its own device allocations, and the weights and KV it uses."""
    own = torch.cuda.memory_allocated(runner.device) if runner.device.type == "cuda" else 0
    pool = runner.kv_pool.tensor
    return {"device_allocated_bytes": str(own), "weight_bytes": str(runner.model.weight_bytes()),
            "kv_bytes": str(pool.numel() * pool.element_size())}
