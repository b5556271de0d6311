"""Tensor-parallel seats of the workers (issue 17): what rank r of a role is given, and the followers.

With `--tensor-parallel-size N` the launcher starts, per role (decode and prefill in rapid mode, hybrid
in hybrid mode), N processes, one per GPU: rank 0 is that role's usual worker (it talks to the router
and its peer, schedules and samples: `worker_build`), ranks 1..N-1 are followers that replay its model
calls (rapidserve/parallel/mirror.py). Each gets a `TPSeat`: its group (one communicator per role) and
the mirror rings (the leader: one per follower, to write; a follower: its own, to read).

A follower's start-up repeats its leader's, call for call where the group is involved: load the shard
(the KV budget's trial forward and the pool agreement are collectives), for decode wait for the
leader's partition plan (`Setup`) and capture the same decode graphs in the same order, hand the
weights and pool to the prefill follower on the same GPU (as decode rank 0 does to prefill rank 0), which
captures the same piecewise prefill graphs as its leader (`capture_prefill`; hybrid: decode's, then
prefill's), then follow until the router stops it or dies.

Shutdown, in order: the leader's process hosts the TCP store its group met on (rank 0's), so it goes last.
At its exit the leader sends Stop to its followers and waits for them to exit (`stop_followers`): a
follower that outlived the store had NCCL's watchdog report the lost store (a c10d stack trace) at every
stop. A follower whose mirror ring is full (it is behind, replaying) gets the Stop as soon as it has made
room, within the same 3 s; one that never does is named in the log and left to the router's shutdown.
No rank calls destroy_process_group: NCCL's ncclCommFinalize waits until every CUDA graph that captured the
communicator's kernels is destroyed, and every rank holds its graphs (all-reduces inside) to the end;
the communicator goes with the process.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from rapidserve.batch_limits import config_seats
from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.ipc import Receiver, Sender, ShmRing, pid_alive, ring_name
from rapidserve.parallel.group import GroupSpec, TPGroup, group_specs
from rapidserve.parallel.mirror import KVReplayer, Leader, MirrorMessage, Setup, follow, wait_message
from rapidserve.partition.backend import PartitionBackend
from rapidserve.partition.plan import PlanWire, open_streams
from rapidserve.partition.profile import OVERALLOCATED
from rapidserve.runner import ModelRunner, load_runner, resolve_device
from rapidserve.runner.prefill_graphs import PREFILL_WORKER_MAX_BUCKET


@dataclass(frozen=True)
class TPSeat:
    """Rank `spec.rank` of its role's tensor-parallel group. `rings`: the leader's rings to its followers
    (rank order), or a follower's one inbox ring."""

    spec: GroupSpec
    rings: tuple[str, ...]


MIRROR_SLOT_BYTES = 64 * 1024
DECODE_NCCL_MAX_CTAS = 16
log = logging.getLogger(__name__)
FOLLOWERS_EXIT_S = 3.0  # a leader waits this long for its followers at exit: within WorkerSet.stop's 5 s join


def rank_config(cfg: EngineConfig, rank: int) -> EngineConfig:
    """The config of tensor-parallel rank `rank`: its GPU (`ParallelConfig.gpus()`); the CPU stays the CPU. Disagg
    mode's config is every rank's: its builders pick each rank's GPU (`disagg.disagg_devices`)."""
    dev = cfg.runner.device
    if cfg.parallel.tensor_parallel_size == 1 or dev == "cpu" or cfg.launch.mode == "disagg":
        return cfg
    if dev == "auto" and not torch.cuda.is_available():
        return dataclasses.replace(cfg, runner=dataclasses.replace(cfg.runner, device="cpu"))
    gpu = cfg.parallel.gpus()[rank]
    return dataclasses.replace(cfg, runner=dataclasses.replace(cfg.runner, device=f"cuda:{gpu}"))


def check_tp_gpus(cfg: EngineConfig, visible: int) -> None:
    """ConfigError, in the router before any worker starts, when the ranks' GPUs are not all visible."""
    tp, dev = cfg.parallel.tensor_parallel_size, cfg.runner.device
    if tp == 1 or dev == "cpu" or (dev == "auto" and visible == 0) or cfg.launch.mode == "disagg":
        return  # disagg's GPUs are checked by its builders_for (engine/disagg.py)
    gpus = cfg.parallel.gpus()[:tp]
    if visible <= max(gpus):
        raise ConfigError(f"--tensor-parallel-size {tp} needs GPUs {list(gpus)} but {visible} "
                          f"{'is' if visible == 1 else 'are'} visible; lower --tensor-parallel-size, or pick GPUs "
                          "with CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES")


def mirror_ring_bytes(cfg: EngineConfig) -> int:
    """Room for a few of the largest calls: a decode step's block tables (its seats x the longest table,
    int32: `batch_limits.config_seats`, at most the largest decode graph, not max_num_seqs) or a prefill's per-token
    arrays, plus slack."""
    blocks = -(-cfg.max_model_len // cfg.cache.block_size)
    rows = config_seats(cfg)
    decode = rows * (blocks * 4 + 64)
    tokens = max(cfg.scheduler.max_num_batched_tokens, cfg.max_model_len)
    prefill = tokens * 40 + rows * blocks * 4
    return 4 * max(decode, prefill) + (1 << 20)


def tp_env(role: str) -> dict[str, str | None]:
    """Environment of a tensor-parallel worker of `role` (a variable the user set wins):
    - NCCL's NVLink multicast (NVLS) off: it needs a driver feature a shared host may not allow, and the
      all-reduces here are small;
    - no NCCL heartbeat monitor: a follower whose leader died outlives its TCP store until it notices (at a
      stop the leader waits for its followers' exit: `stop_followers`), which it would report every second;
    - decode: at most 16 CTAs per NCCL kernel, one per SM of the smallest default decode partition (an
      eighth of an H100/H200's 132 SMs), so a collective queued inside a partition never waits for SMs it
      cannot get (parallel/group.py). Prefill's partitions are the larger side of every split (and hybrid
      runs on the whole GPU): NCCL's own choice."""
    want = {"NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    if role == "decode":
        want["NCCL_MAX_CTAS"] = str(DECODE_NCCL_MAX_CTAS)
    return {k: os.environ.get(k, v) for k, v in want.items()}


def role_sizes(cfg: EngineConfig, roles: tuple[str, ...]) -> dict[str, int]:
    """How many tensor-parallel ranks each role runs: -tp each; disagg's prefill side its own size
    (`ParallelConfig.prefill_tp`)."""
    par = cfg.parallel
    return {r: par.prefill_tp if r == "prefill" and cfg.launch.mode == "disagg" else par.tensor_parallel_size
            for r in roles}


def tp_seats(cfg: EngineConfig, eid: str, sizes: dict[str, int], rings: dict[str, ShmRing]) -> dict[str, list[TPSeat]]:
    """Every rank's seat of each role of more than one rank (`sizes`: `role_sizes`), creating the mirror rings
    (added to `rings` under their labels, so the launcher unlinks them with the others); a role of one rank has
    none (no group)."""
    slots = max(16, -(-mirror_ring_bytes(cfg) // MIRROR_SLOT_BYTES))
    out: dict[str, list[TPSeat]] = {}
    for role, tp in sizes.items():
        if tp == 1:
            continue
        specs = group_specs(role, tp, "auto")
        names = []
        for r in range(1, tp):
            label = f"tp-{role}-{r}"
            rings[label] = ShmRing.create(ring_name(eid, label), slots, MIRROR_SLOT_BYTES)
            names.append(rings[label].name)
        out[role] = [TPSeat(specs[0], tuple(names))] + [TPSeat(specs[r], (names[r - 1],)) for r in range(1, tp)]
    return out


def open_group(cfg: EngineConfig, seat: TPSeat | None) -> TPGroup | None:
    """This process's group (None without tensor parallelism): made before the model, on its GPU."""
    if seat is None:
        return None
    device = resolve_device(cfg.runner.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return TPGroup(seat.spec, cfg.model_config, device)


def stream_names(parts: PartitionBackend, role: str) -> dict[int, str]:
    """cuda_stream handle -> configuration name of this worker's partition streams."""
    out: dict[int, str] = {}
    for name in parts.names:
        s = parts.stream(name, role)  # type: ignore[arg-type]
        if s is not None:
            out[int(s.cuda_stream)] = name
    return out


def capture_decode(runner: ModelRunner, parts: PartitionBackend, fused_key: str = "") -> None:
    """The decode worker's graphs, one set per partition configuration (a graph keeps the compute of the stream
    it was captured on), in the plan's order; then, when its policy runs fused steps (`fused_key`, the plan's
    `PlanWire.fused_graphs`), the piecewise prefill graphs of those steps on that configuration's decode stream,
    every bucket (runner/prefill_graphs.py). Every decode rank calls this with the same plan (`Setup`), so the
    captures' collectives pair up."""
    for c in parts.configurations:
        runner.capture_decode_graphs(parts.stream(c.name, "decode"), key=c.name, show_progress=False,
                                     whole_gpu=c.decode_whole)
    if fused_key:
        runner.capture_prefill_graphs(parts.stream(fused_key, "decode"), key=fused_key, show_progress=False)


def capture_hybrid(runner: ModelRunner) -> None:
    """Hybrid mode's graphs, on every rank in this order: decode's, then the piecewise prefill graphs, on the current
    stream, under the key of its one configuration (the whole GPU, `overallocated`: the decode worker's graph key)."""
    runner.capture_decode_graphs(show_progress=False, key=OVERALLOCATED)
    runner.capture_prefill_graphs(show_progress=False, key=OVERALLOCATED)


def capture_prefill(cfg: EngineConfig, runner: ModelRunner, parts: PartitionBackend) -> None:
    """The rapid prefill worker's piecewise prefill graphs (its buckets up to PREFILL_WORKER_MAX_BUCKET), one set
    per partition configuration (a graph keeps its stream's compute), in the configurations' order: under tensor
    parallelism every prefill rank calls this with the same plan, so the captures' collectives pair up. None for
    drift's block-wise prefill."""
    if cfg.partition.policy == "drift":
        return
    for c in parts.configurations:
        runner.capture_prefill_graphs(parts.stream(c.name, "prefill"), key=c.name, show_progress=False,
                                      max_bucket=PREFILL_WORKER_MAX_BUCKET)


def lead(runner: ModelRunner, seat: TPSeat | None, parts: PartitionBackend | None, role: str) -> None:
    """Make `runner` publish its calls to the followers from now on (after start-up's own collectives)."""
    if seat is None or runner.tp is None:
        return
    senders = [Sender(ShmRing.attach(n), MirrorMessage) for n in seat.rings]
    runner.leader = Leader(runner.tp, senders, stream_names(parts, role) if parts is not None else {})
    atexit.register(stop_followers, runner.leader, f"the {role} leader exited")  # the followers end first


def wait_exited(pids: Sequence[int], timeout_s: float, alive: Callable[[int], bool] = pid_alive,
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Whether every process of `pids` has exited (a zombie counts as exited) within `timeout_s`."""
    deadline = clock() + timeout_s
    while True:
        if not any(alive(p) for p in pids):
            return True
        if clock() >= deadline:
            return False
        sleep(0.01)


@dataclass(frozen=True)
class FollowersStopped:
    """How a leader's Stop went, by follower rank (1..N-1). `missed`: alive but never took the Stop (its ring
    stayed full until the deadline, or was closed); `lingering`: took it but had not exited when the wait
    ended. Both are left to the router's shutdown (`WorkerSet.stop` terminates, then kills). A follower that
    had already exited is in neither."""

    missed: tuple[int, ...] = ()
    lingering: tuple[int, ...] = ()

    @property
    def orderly(self) -> bool:
        """Every follower was gone before the leader (the host of the group's TCP store)."""
        return not self.missed and not self.lingering


def stop_followers(leader: Leader, reason: str, timeout_s: float = FOLLOWERS_EXIT_S,
                   alive: Callable[[int], bool] = pid_alive, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> FollowersStopped:
    """At the leader's exit: Stop to every follower, then wait for those that took it to exit before this
    process, the host of the group's TCP store, goes. One deadline, `timeout_s`, bounds both: a follower whose
    ring is full takes the Stop once it has replayed enough to make room; one that has exited is not waited
    for. The ranks that never took it, or took it and still run, are named in the log and in the result."""
    deadline = clock() + timeout_s
    pids = leader.tp.pids[1:]
    sent = leader.stop(reason, timeout_s=timeout_s, clock=clock, sleep=sleep,
                       follower_gone=lambda rank: not alive(pids[rank - 1]))
    wait_exited([pid for pid, ok in zip(pids, sent, strict=True) if ok], max(0.0, deadline - clock()), alive,
                clock, sleep)
    out = FollowersStopped(
        missed=tuple(r for r, (pid, ok) in enumerate(zip(pids, sent, strict=True), 1) if not ok and alive(pid)),
        lingering=tuple(r for r, (pid, ok) in enumerate(zip(pids, sent, strict=True), 1) if ok and alive(pid)))
    if out.missed:
        log.warning("TP ranks %s never took the leader's Stop (%s): their mirror rings stayed full for %.1f s, so "
                    "they were still replaying earlier calls or are stuck in one (a collective another rank never "
                    "joined: see that rank's log); the router's shutdown terminates them", list(out.missed),
                    reason, timeout_s)
    if out.lingering:  # not an error: the store may outlive them briefly; NCCL may then log a lost store
        log.info("TP ranks %s took the leader's Stop (%s) but had not exited %.1f s later; the router's shutdown "
                 "terminates them", list(out.lingering), reason, timeout_s)
    return out


def send_plan(seat: TPSeat | None, wire: PlanWire) -> None:
    """Decode rank 0: the partition plan to the decode followers (they capture graphs per configuration)."""
    if seat is None:
        return
    data = msgspec.msgpack.encode(wire)
    for n in seat.rings:
        sender = Sender(ShmRing.attach(n), MirrorMessage)
        try:
            sender.send(Setup(data), timeout=60.0)
        finally:
            sender.close()  # this mapping only; `lead` attaches the rings for serving


# ---- followers ------------------------------------------------------------------------------------
FollowerStart = Callable[[str, TPSeat, EngineConfig, Receiver[Any], Any, list[int]],
                         tuple[ModelRunner, PartitionBackend | None, KVReplayer | None]]


def run_follower(role: str, seat: TPSeat, cfg: EngineConfig, parent_pid: int, handoff: Any,
                 env: dict[str, str | None], start: FollowerStart | None = None) -> None:
    """The entry point of a follower process (forked from the fork server): build the shard (`start`, default
    `start_follower`: rapid and hybrid mode's; disagg's is `disagg.start_disagg_follower`), then replay the leader's
    calls. A failure ends the process; the router sees a dead worker and restarts the engine."""
    from rapidserve.engine.worker_io import apply_env, no_named_locks, run_exit_handlers, worker_signals

    apply_env(env)
    worker_signals()
    no_named_locks()
    inbox = Receiver(ShmRing.attach(seat.rings[0]), MirrorMessage)
    peers = [parent_pid]  # the processes whose end ends ours (start adds the owners of memory it attached)
    start_ppid = os.getppid()  # the fork server, which ends with the router (worker_io.WorkerIO.others_alive)
    try:
        runner, parts, kv = (start or start_follower)(role, seat, cfg, inbox, handoff, peers)

        def stream_of(name: str | None) -> Any:
            return parts.stream(name, role) if parts is not None and name is not None else None  # type: ignore[arg-type]

        def alive() -> bool:
            return os.getppid() == start_ppid and all(pid_alive(p) for p in peers)

        follow(runner, inbox, stream_of, alive, kv=kv)  # until Stop, while the leader (and its TCP store) waits
    except SystemExit:
        pass
    finally:
        # No destroy_process_group (see the module's docstring): the communicator goes with the process.
        inbox.close()
        run_exit_handlers()


def start_follower(role: str, seat: TPSeat, cfg: EngineConfig, inbox: Receiver[Any], handoff: Any,
                   peers: list[int]) -> tuple[ModelRunner, PartitionBackend | None, KVReplayer | None]:
    """Rapid and hybrid mode's follower start-up, call for call as its leader's (module docstring)."""
    tp = open_group(cfg, seat)
    assert tp is not None
    parts: PartitionBackend | None = None
    if role == "prefill":
        if not handoff.poll(cfg.launch.startup_timeout_s):
            raise TimeoutError(f"no weights from decode rank {tp.rank} in {cfg.launch.startup_timeout_s:.0f} s")
        owner_pid, shared, wire = handoff.recv()
        handoff.close()
        peers.append(int(owner_pid))
        runner = ModelRunner(cfg, None, attached=shared, show_progress=False, tp=tp)
        parts = open_streams(wire, runner.device, ("prefill",))
        capture_prefill(cfg, runner, parts)  # as the leader (worker_build.build_prefill), in its order
    else:
        runner = load_runner(cfg, tp, step_processes=2 if role == "decode" else 1)  # as its leader's
        if role == "decode":
            setup = wait_message(inbox, Setup, cfg.launch.startup_timeout_s)
            wire = msgspec.msgpack.decode(setup.plan, type=PlanWire)
            parts = open_streams(wire, runner.device, ("decode",))
            capture_decode(runner, parts, wire.fused_graphs)  # as the leader (worker_build.build_decode)
            from rapidserve.runner.model_sharing import export_shared

            handoff.send((os.getpid(), export_shared(runner.model, runner.kv_pool), wire))
            handoff.close()
        else:
            capture_hybrid(runner)  # as the leader (worker_build.build_hybrid)
    return runner, parts, None
