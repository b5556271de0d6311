"""`rapidserve profile`: measure the decode/prefill partition table of a GPU and model.

For each configuration (overallocated plus the splits the device's granularity allows), each decode
batch bucket and each context bucket it measures:
* the decode step alone: replays of the step's decode graph on the configuration's decode stream
  (CUDA events around each replay; eager steps and wall time on CPU), p50/p95;
* the decode step beside a running prefill: the same replays while a second thread runs prefill
  forwards of `prefill_tokens` tokens on the configuration's prefill stream, p50/p95;
* the prefill throughput (tokens/s) under that configuration, over the same window.

Both phases run in one process here (two threads, each on its own stream of the split); the engine
runs them in two processes under MPS, which docs/measured.md measured within ~7% of one process (3.14 vs
2.93 ms for a 32/100 split). The decode sequences' block tables wrap around the pool, so any
batch x context fits; the bytes still come from HBM (the pool is far larger than L2).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

from rapidserve.partition.backend import PartitionBackend, on_stream
from rapidserve.partition.profile import (
    DEFAULT_BATCH_BUCKETS,
    Configuration,
    Entry,
    Profile,
    model_label,
    model_shape,
)
from rapidserve.runner import DecodeItem, ModelRunner, PrefillItem


@dataclass(frozen=True)
class ProfileSpec:
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    context_buckets: tuple[int, ...] = (512, 2048, 8192)
    prefill_tokens: int = 4096
    decode_reps: int = 20  # replays timed for "alone"
    min_window_s: float = 0.25  # the prefill thread runs at least this long
    min_prefill_forwards: int = 3  # and this many forwards, the first (a warm-up) untimed

    def __post_init__(self) -> None:
        for name in ("batch_buckets", "context_buckets"):
            v = getattr(self, name)
            if not v or list(v) != sorted(set(v)) or v[0] <= 0:
                raise ValueError(f"{name}={v} must be strictly ascending positive integers")
        if self.prefill_tokens <= 0 or self.decode_reps < 3:
            raise ValueError("prefill_tokens must be > 0 and decode_reps >= 3")
        if self.min_prefill_forwards < 2:
            raise ValueError("min_prefill_forwards must be >= 2 (the first is a warm-up, not timed)")


@dataclass
class Measurement:
    """What one (configuration, batch, context) cell measured, before it becomes an Entry."""

    alone_ms: list[float]
    beside_ms: list[float]
    prefill_tokens_per_s: float


@dataclass
class ProfileRun:
    profile: Profile
    solo_prefill_tokens_per_s: float  # prefill alone on the whole device
    seconds: float
    notes: list[str] = field(default_factory=list)


def percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


class Profiler:
    def __init__(self, runner: ModelRunner, backend: PartitionBackend, spec: ProfileSpec) -> None:
        self.runner, self.backend, self.spec = runner, backend, spec
        self.cuda = runner.device.type == "cuda"
        self.num_blocks = runner.kv_pool.num_blocks
        self.bs = runner.block_size

    # ---- inputs -----------------------------------------------------------------------------
    def _table(self, first: int, tokens: int) -> list[int]:
        n = -(-tokens // self.bs)
        return [(first + j) % self.num_blocks for j in range(n)]

    def decode_items(self, batch: int, context: int) -> list[DecodeItem]:
        nb = -(-context // self.bs)
        return [DecodeItem(1 + i % 1000, context - 1, self._table(i * nb, context)) for i in range(batch)]

    def prefill_items(self) -> list[PrefillItem]:
        n = self.spec.prefill_tokens
        rng = np.random.default_rng(0)
        ids = rng.integers(1, min(self.runner.mcfg.vocab_size, 30000), n).tolist()
        return [PrefillItem(ids, 0, self._table(self.num_blocks // 2, n))]

    # ---- timing -----------------------------------------------------------------------------
    def _decode_step(self, config: str, items: list[DecodeItem]) -> Callable[[], float]:
        """A callable that runs one decode step on the configuration's stream and returns its ms."""
        stream = self.backend.stream(config, "decode")
        runner = self.runner
        with on_stream(stream):
            runner.decode(items, graph_key=config)  # fills the graph's inputs (and warms up)
        graph = runner.decode_graph(len(items), config)
        if self.cuda:
            import torch

            def run_cuda() -> float:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with on_stream(stream):
                    a.record()
                    if graph is not None:
                        graph.replay()
                    else:
                        runner.decode(items, graph_key=config)
                    b.record()
                b.synchronize()
                return float(a.elapsed_time(b))

            return run_cuda

        def run_cpu() -> float:
            t0 = time.perf_counter()
            runner.decode(items, graph_key=config)
            return (time.perf_counter() - t0) * 1e3

        return run_cpu

    def _sync(self, stream: Any) -> None:
        if stream is not None:
            stream.synchronize()

    def prefill_loop(self, config: str, items: list[PrefillItem], started: threading.Event,
                     stop: threading.Event, out: list[Any]) -> None:
        """Prefill forwards until `stop` (at least `min_prefill_forwards` and `min_window_s`); appends tokens/s
        to `out`, or the exception that ended it."""
        try:
            self._prefill_loop(config, items, started, stop, out)
        except BaseException as e:  # noqa: BLE001 - handed to the measuring thread
            out.append(e)
        finally:
            started.set()

    def _prefill_loop(self, config: str, items: list[PrefillItem], started: threading.Event,
                      stop: threading.Event, out: list[Any]) -> None:
        stream = self.backend.stream(config, "prefill")
        tokens = sum(len(it.token_ids) for it in items)
        n, t0 = 0, time.perf_counter()
        with on_stream(stream):
            while True:
                self.runner.prefill(items)
                self._sync(stream)
                if n == 0:
                    started.set()
                    t0 = time.perf_counter()  # the first forward warms up; time the others
                n += 1
                dt = time.perf_counter() - t0
                if n >= self.spec.min_prefill_forwards and dt >= self.spec.min_window_s and stop.is_set():
                    break
                if dt > 30:  # a stuck measurement must not hang the profiler
                    break
        out.append(tokens * (n - 1) / max(time.perf_counter() - t0, 1e-9))

    def measure(self, config: str, batch: int, context: int, pitems: list[PrefillItem]) -> Measurement:
        step = self._decode_step(config, self.decode_items(batch, context))
        step()
        alone = [step() for _ in range(self.spec.decode_reps)]
        started, stop = threading.Event(), threading.Event()
        tps: list[Any] = []
        th = threading.Thread(target=self.prefill_loop, args=(config, pitems, started, stop, tps), daemon=True)
        th.start()
        started.wait(60)
        beside: list[float] = []
        t0 = time.perf_counter()
        while th.is_alive():
            beside.append(step())
            if len(beside) >= self.spec.decode_reps and time.perf_counter() - t0 >= self.spec.min_window_s:
                stop.set()
        th.join()
        if tps and isinstance(tps[0], BaseException):
            raise tps[0]
        if not beside:
            beside = [step()]
        return Measurement(alone, beside, float(tps[0]))

    def solo_prefill(self, config: str, pitems: list[PrefillItem]) -> float:
        started, stop = threading.Event(), threading.Event()
        tps: list[Any] = []
        stop.set()
        self.prefill_loop(config, pitems, started, stop, tps)
        if isinstance(tps[0], BaseException):
            raise tps[0]
        return float(tps[0])


def entry_of(config: str, batch: int, context: int, m: Measurement) -> Entry:
    return Entry(config, batch, context, percentile(m.alone_ms, 50), percentile(m.alone_ms, 95),
                 percentile(m.beside_ms, 50), percentile(m.beside_ms, 95), m.prefill_tokens_per_s)


def prepare(runner: ModelRunner, backend: PartitionBackend, spec: ProfileSpec,
            show_progress: bool = True) -> tuple[Profiler, list[PrefillItem]]:
    """Capture the decode graphs of every configuration; the profiler and its prefill inputs."""
    for c in backend.configurations:
        runner.capture_decode_graphs(backend.stream(c.name, "decode"), key=c.name, show_progress=show_progress,
                                     whole_gpu=c.decode_whole)
    prof = Profiler(runner, backend, spec)
    return prof, prof.prefill_items()


def run_profile(runner: ModelRunner, backend: PartitionBackend, spec: ProfileSpec, gpu: str, model: str,
                show_progress: bool = True) -> ProfileRun:
    """Capture decode graphs per configuration, then measure every cell. Progress bar on stderr."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    configs: list[Configuration] = backend.configurations
    prof, pitems = prepare(runner, backend, spec, show_progress)
    solo = prof.solo_prefill(configs[0].name, pitems)
    cells = [(c.name, b, x) for c in configs for b in spec.batch_buckets for x in spec.context_buckets]
    entries = []
    for name, b, x in tqdm(cells, desc=f"profiling {model}", unit="cell", disable=not show_progress):
        entries.append(entry_of(name, b, x, prof.measure(name, b, x, pitems)))
    profile = Profile(gpu=gpu, model=model_label(model), num_compute_units=backend.granularity.total,
                      configurations=list(configs), batch_buckets=list(spec.batch_buckets),
                      context_buckets=list(spec.context_buckets), entries=entries,
                      created=datetime.now(timezone.utc).isoformat(timespec="seconds"), source="measured",
                      prefill_tokens=spec.prefill_tokens, quantization=runner.cfg.quantization.method,
                      kv_cache_dtype=runner.cfg.cache.kv_cache_dtype,
                      model_shape=model_shape(runner.cfg.model_config))  # a shard's: profile_cmd records the whole's
    return ProfileRun(profile, solo, time.perf_counter() - t0)
