"""ModelRunner: turns scheduled batches into forward passes on a device.

Two calls for the engine: `prefill(items, stream, carry, graph_key)` and `decode(items, stream, graph_key)`.
Each builds the flat token batch and its AttentionMetadata (inputs.py), runs the model on the stream it is
handed and returns float32 logits (prefill: one row per item that asks for logits; decode: one per item).
On CUDA/ROCm, decode replays graphs captured per batch-size bucket on the stream of a given key
(decode_graphs.py), and a prefill that fits a token bucket replays piecewise graphs (prefill_graphs.py) of its
key: a graph keeps the compute partition of the stream it was captured on (docs/measured.md), so the engine
captures one set per partition configuration. No capture on CPU.
Sampling is separate (`sample`, `sample_next`: sampling.py), so the engine decides what to do with logits.

`ModelRunner` is composed of the parts in this package, each a class of the methods of one concept over the
runner's state: `BatchInputs` (inputs.py), `DecodeGraphs` (decode_graphs.py), `Sampling` (sampling.py),
`Mirrored` (tp.py: the tensor-parallel hooks) and `KVSizing` (kv_sizing.py: what sizes the KV pool). This module
holds start-up (device and dtype as device.py resolves them, weights, the KV pool), the prefill and decode
forwards, the block-wise prefill tasks (prefill_task.py) and stream ordering.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from rapidserve.attention import get_attention_backend, with_pdl
from rapidserve.block_manager import BlockManager
from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.kv_events import KVEventLog
from rapidserve.kv_pool import KVPool, check_ipc_shareable_allocator, kv_cache_dtype
from rapidserve.loader import ModelSource, rank_weights, resolve_model
from rapidserve.logit_controls import ControlPlan, TokenState
from rapidserve.models.registry import causal_lm_class
from rapidserve.ops import fp8_ops, get_ops, with_launch
from rapidserve.ops.fp8 import check_fp8_weights_device
from rapidserve.ops.pdl import pdl_device
from rapidserve.ops.pdl_table import OFF
from rapidserve.prompt import PromptLimits
from rapidserve.runner.decode_graphs import DecodeGraph, DecodeGraphs
from rapidserve.runner.device import resolve_device, resolve_dtype
from rapidserve.runner.inputs import Carry, DecodeItem, PrefillItem
from rapidserve.runner.kv_sizing import KVSizing
from rapidserve.runner.prefill_graphs import PrefillGraphs, usable_buckets
from rapidserve.runner.prefill_task import Guard, PrefillTask, TaskInputs, TaskKind, TaskPublisher
from rapidserve.runner.sampling import Sampling
from rapidserve.runner.tp import Mirrored, direct
from rapidserve.sampler import Sampler

if TYPE_CHECKING:
    from rapidserve.parallel.group import TPGroup
    from rapidserve.parallel.mirror import Leader
    from rapidserve.runner.model_sharing import SharedState

log = logging.getLogger(__name__)


def load_runner(cfg: EngineConfig, tp: TPGroup | None = None, step_processes: int = 1) -> ModelRunner:
    """Resolve `cfg.model` and load it (with `tp`: this rank's shard) on the configured device; `step_processes`:
    this engine's processes that run full-size steps on this GPU (runner/kv_budget.py)."""
    dev = resolve_device(cfg.runner.device)
    source = resolve_model(cfg.model, preset_device=dev, preset_dtype=resolve_dtype(cfg.runner.dtype, dev))
    return ModelRunner(cfg, source, show_progress=False, tp=tp, step_processes=step_processes)


class ModelRunner(DecodeGraphs, Sampling, Mirrored, KVSizing):
    def __init__(self, cfg: EngineConfig, source: ModelSource | None, kv_pool: KVPool | None = None,
                 show_progress: bool = True, attached: SharedState | None = None, tp: TPGroup | None = None,
                 step_processes: int = 1) -> None:
        """Load `source` and allocate a KV pool (or use `kv_pool`); or, in the prefill worker, use the
        weights and pool another process shares (`attached`), without a copy. With `tp` this process is
        one rank of a tensor-parallel group: it loads and computes its shard (its KV heads in its pool),
        and every rank must make the same calls in the same order (rapidserve/parallel/mirror.py).
        `step_processes`: this engine's processes running full-size steps on this GPU, each keeping its activation
        peak (2 for rapid mode's decode worker, whose prefill worker does too), which a GPU pool's budget keeps."""
        self.cfg, self.tp, self.step_processes = cfg, tp, step_processes
        self._baseline_used = 0  # in use on the device before this runner allocated (runner/kv_budget.py)
        self._baseline_reserved = 0  # what this process's allocator held then (an earlier engine's tensors)
        self.leader: Leader | None = None  # tensor parallelism: the followers hear of every call (mirror.py)
        self._prefill_graphs: PrefillGraphs | None = None  # piecewise prefill graphs (capture_prefill_graphs)
        self.mcfg = cfg.model_config
        self.device = resolve_device(cfg.runner.device)
        self.dtype = resolve_dtype(cfg.runner.dtype, self.device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            check_ipc_shareable_allocator(self.device)
            free, total = torch.cuda.mem_get_info()
            self._baseline_used = total - free  # other processes, and this one's CUDA context
            self._baseline_reserved = torch.cuda.memory_reserved()
        self.block_size = cfg.cache.block_size
        self.max_model_len = cfg.max_model_len
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.ops = get_ops(self.device)
        quant = cfg.quantization
        if quant.enabled:  # a GPU without fp8 is refused (as the config builder does), before any weight is read
            check_fp8_weights_device(self.device, True, quant.describe(),
                                     source is not None and source.quantization is not None)
            self.ops = fp8_ops(self.ops, self.device)  # the CPU's reference path
            log.info("quantization: %s; fp8 linear: %s", quant.describe(), self.ops.fp8_linear.__name__)
            if source is not None and source.quantization is not None and source.quantization != quant:
                raise ConfigError(f"the model's FP8 scheme ({source.quantization.describe()}) is not the config's "
                                  f"({quant.describe()}): build the config from this model")
            if source is not None and source.quantization is None and not quant.online:
                raise ConfigError(f"the config asks for an FP8 checkpoint ({quant.describe()}) but the model's "
                                  "weights are float: build the config from this model")
        elif source is not None and source.quantization is not None:
            raise ConfigError(f"the model is an FP8 checkpoint ({source.quantization.describe()}) and the config's "
                              "quantization is none: build the config from this model")
        if source is not None and cfg.cache.kv_scales is not None and source.kv_scales != cfg.cache.kv_scales:
            raise ConfigError("the config's fp8 KV cache scales are not the model's (its checkpoint carries "
                              f"{'none' if source.kv_scales is None else 'others'}): build the config from this model")
        self.kv_dtype = kv_cache_dtype(cfg.cache, self.dtype, self.device)  # ConfigError on a GPU without fp8
        fp8_kv = self.kv_dtype != self.dtype
        self.attn = get_attention_backend(cfg.runner.attention_backend, self.device, self.kv_dtype)
        log.info("attention backend: %s%s", self.attn.name, f" ({self.attn.kv_note})" if self.attn.kv_note else "")
        kv_scales = cfg.cache.layer_kv_scales(self.mcfg.num_layers) if fp8_kv else None
        kv = {"kv_dtype": self.kv_dtype if fp8_kv else None, "kv_scales": kv_scales}
        # Programmatic dependent launch (rapidserve/ops/pdl.py): the model's own bundles launch without it (prefill,
        # mixed steps, block-wise prefill tasks, piecewise prefill graphs: never measured with it); a decode step binds
        # the table's choice for its rows over them (decode_graphs.py, `decode_launch`).
        self.pdl_device = pdl_device(self.device)
        self._launch_bundles = {}
        model_ops, model_attn = with_launch(self.ops, OFF), with_pdl(self.attn, False)
        t0 = time.perf_counter()
        if attached is not None:
            from rapidserve.runner.model_sharing import attach_model

            self.model, self.kv_pool = attach_model(self.mcfg, model_ops, model_attn, self.dtype, self.device,
                                                    max(self.max_model_len, 1), attached, tp, quant, **kv)
        else:
            if source is None:
                raise ValueError("ModelRunner needs a model source or attached shared weights")
            cpu_blocks = self._cpu_kv_blocks() if kv_pool is None else None  # before anything max_model_len sizes
            self.model = causal_lm_class(self.mcfg)(self.mcfg, model_ops, model_attn, self.dtype, self.device,
                                                    max_positions=max(self.max_model_len, 1), tp=tp, quant=quant,
                                                    **kv)
            log.info("loading weights: %s", source.description)
            self._load(source, show_progress)
            if self.device.type == "cuda":
                # The load's temporaries (each checkpoint or random tensor on the device, the fp8 quantizer's
                # float copies) are freed but cached: left so, the next small persistent allocations split them
                # and the rest of each segment is held, neither released nor usable by the pool (kv_budget.py).
                torch.cuda.empty_cache()
            log.info("weights loaded in %.1f s", time.perf_counter() - t0)
            self.kv_pool = kv_pool if kv_pool is not None else self._allocate_kv_pool(cpu_blocks)
            log.info("KV cache: %d blocks of %d tokens, %s (%s)", self.kv_pool.num_blocks, self.block_size,
                     self.kv_dtype, self.kv_sizing)
        if self.device.type == "cuda":
            # Stream ordering: the weights, the pool's zero-fill and (attached) the RoPE table were
            # written on the current stream; the engine computes on partition streams that do not wait
            # for it, so start-up ends with them written.
            torch.cuda.synchronize(self.device)
        self.load_seconds = time.perf_counter() - t0
        self.sampler = Sampler(self.device, cfg.runner.seed)
        self.tokens = TokenState(self.device)  # penalty / bad-word slots (logit_controls.py), owned by the worker
        self._unrecorded: tuple[torch.Tensor, ControlPlan] | None = None  # sample_next(record=False)'s tokens
        self._graphs: dict[str, dict[int, DecodeGraph]] = {}
        self._graph_pool: object | None = None
        self._static: dict[str, torch.Tensor] = {}
        self._task_ids = 0  # block-wise prefill tasks made so far (their ids, for the followers)
        self._tasks: dict[int, PrefillTask] = {}  # a follower's tasks begun and not ended (replay_task)

    def block_manager(self) -> BlockManager:
        """The block tables and prefix cache over this runner's pool (for the one process that owns them).
        The cache's hashes start from the model's name, dtype, fp8 scheme and KV cache format (fp8 and its scales):
        whatever changes the K/V changes them. With --kv-events-config it logs the cache's block events
        (rapidserve/kv_events.py) for its owner to send."""
        quant, cache = self.cfg.quantization, self.cfg.cache
        fp8 = (f"|{quant!r}" if quant.enabled else "") + (
            f"|kv {self.kv_dtype} {cache.layer_kv_scales(self.mcfg.num_layers)}" if cache.fp8_kv else "")
        salt = f"{self.cfg.model}|{self.dtype}|{self.block_size}{fp8}".encode()
        kv = self.cfg.kv_events
        events = KVEventLog(self.block_size, kv.none_hash) if kv.publishing else None
        return BlockManager(self.kv_pool.num_blocks, self.block_size,
                            enable_caching=self.cfg.cache.enable_prefix_caching, salt=salt, events=events)

    @property
    def limits(self) -> PromptLimits:
        """What a prompt must be here; its `context_cap` is where every request stops ("length")."""
        pool = self.kv_pool.num_blocks * self.block_size
        return PromptLimits(self.mcfg.vocab_size, self.max_model_len, pool)

    # ---- start-up ---------------------------------------------------------------------------
    def _load(self, source: ModelSource, show_progress: bool) -> None:
        weights: Iterator[tuple[str, torch.Tensor]] = (
            source.weights() if self.tp is None else rank_weights(source, self.tp.layout))
        bar = tqdm(weights, total=source.num_tensors, desc=f"loading {source.description}",
                   unit="tensor", disable=not show_progress, leave=False)
        self.model.load_weights(bar)

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, items: Sequence[PrefillItem], stream: torch.cuda.Stream | None = None,
                carry: Carry | None = None, graph_key: str = "default") -> torch.Tensor:
        """One prefill forward; on `stream` if given, ordered with the caller's stream (`_run_on`).
        `carry` feeds leading one-token items (a mixed step's decodes) the previous step's sampled
        tokens from the device: its rows index those items, which are also their token positions.
        A forward that fits a token bucket replays the piecewise prefill graphs captured under `graph_key`
        (`capture_prefill_graphs`; the key of the partition whose stream is current), if any."""
        return self._run_on(stream, lambda: self._prefill_on(self.kv_pool, items, carry, graph_key))

    def _prefill_on(self, pool: KVPool, items: Sequence[PrefillItem], carry: Carry | None = None,
                    graph_key: str = "default") -> torch.Tensor:
        if carry is not None and carry.rows:
            top = max(d for d, _ in carry.rows)
            if top >= len(items) or any(len(items[i].token_ids) != 1 for i in range(top + 1)):
                raise ValueError("carry rows must index the leading one-token items")
        arrays = self._prefill_arrays(items)
        if self.leader is None:
            return self._prefill_run(pool, arrays, carry, graph_key)
        self.leader.forward("prefill", arrays, graph_key, carry)
        return self._published(lambda: self._prefill_run(pool, arrays, carry, graph_key))

    def _prefill_run(self, pool: KVPool, arrays: Sequence[np.ndarray], carry: Carry | None,
                     graph_key: str = "default") -> torch.Tensor:
        ids, positions, _, slots, _, cu, want = arrays
        meta = self._prefill_meta(arrays)
        graphs = self._prefill_graphs
        bucket = graphs.bucket(graph_key, len(ids)) if graphs is not None and pool is self.kv_pool else None
        if graphs is not None and bucket is not None:
            hidden = graphs.run(graph_key, bucket, ids, positions, slots, meta, carry)
        else:
            tokens = self._dev(ids)
            if carry is not None:
                carry.apply(tokens)
            hidden = self.model(tokens, self._dev(positions), pool.layers, meta)
        last = self._dev(cu[1:][want] - 1)  # asynchronous: a blocking copy here would wait for the forward
        return self.model.compute_logits(hidden.index_select(0, last))

    # ---- block-wise prefill (DRIFT: prefill_task.py) --------------------------------------------
    def prefill_task(self, items: Sequence[PrefillItem]) -> PrefillTask:
        """A prefill forward over `items` to be launched a layer block at a time (`PrefillTask.step`): its
        inputs are built now and its embedding queued on the current stream. Under tensor parallelism the
        task and each of its blocks are published to the followers (`Forward` kinds prefill_begin,
        prefill_block, prefill_end, with the task's id), so they replay the same collectives in order."""
        arrays = self._prefill_arrays(items)
        self._task_ids += 1
        if self.leader is None:
            return self._new_task(arrays, self._task_ids, None, direct)
        leader = self.leader
        leader.forward("prefill_begin", arrays, "default", None, task=self._task_ids)

        def publish(kind: TaskKind, task: int, layers: tuple[int, int]) -> None:
            leader.forward(kind, [], "default", None, task=task, layers=layers)

        return self._published(lambda: self._new_task(arrays, self._task_ids, publish, self._published))

    def _new_task(self, arrays: Sequence[np.ndarray], task_id: int, publish: TaskPublisher | None,
                  guard: Guard) -> PrefillTask:
        ids, positions, _, _, _, cu, want = arrays
        meta = self._prefill_meta(arrays)
        inputs = TaskInputs(self._dev(ids), self._dev(positions), meta, self._dev(cu[1:][want] - 1))
        return PrefillTask(self.model, self.kv_pool.layers, inputs, task_id, publish, guard)

    # ---- decode -------------------------------------------------------------------------------
    def decode(self, items: Sequence[DecodeItem], stream: torch.cuda.Stream | None = None,
               graph_key: str = "default", carry: Carry | None = None) -> torch.Tensor:
        """One decode step. `carry` feeds some rows the previous step's sampled tokens straight from
        the device, without waiting for them. On `stream` if given, ordered with the caller's stream
        (`_run_on`); the engine's workers instead make the partition stream current themselves and
        pass no stream."""
        return self._run_on(stream, lambda: self._decode_now(items, graph_key, carry))

    def _decode_now(self, items: Sequence[DecodeItem], graph_key: str, carry: Carry | None) -> torch.Tensor:
        arrays = self._decode_arrays(items, self.max_blocks_per_seq)
        if self.leader is None:
            return self._decode_run(arrays, graph_key, carry)
        self.leader.forward("decode", arrays, graph_key, carry)
        return self._published(lambda: self._decode_run(arrays, graph_key, carry))

    # ---- piecewise prefill graphs (prefill_graphs.py) -------------------------------------------
    def capture_prefill_graphs(self, stream: torch.cuda.Stream | None = None, key: str = "default",
                               show_progress: bool = True, eager: bool = False,
                               max_bucket: int | None = None) -> None:
        """Capture the piecewise prefill graphs (prefill_graphs.py) of every token bucket of
        `cfg.runner.prefill_graph_tokens` on `stream` under `key` (up to the first bucket that holds a whole
        step's `max_num_batched_tokens`); `prefill(..., graph_key=key)` then replays
        them for forwards that fit a bucket. Nothing on CPU, with graphs off (`use_cuda_graphs`, no buckets), or
        with a backend whose kernels cannot be captured. `eager`: record the pieces as plain calls instead of
        graphs (on any device): the CPU tests of the piecewise path. `max_bucket`: only the buckets up to it (the
        prefill worker's PREFILL_WORKER_MAX_BUCKET); the first capture of a runner fixes its buckets. Tensor
        parallelism: the capture runs the pieces' collectives, so every rank captures the same keys in the same
        order before it leads or follows (engine/worker_build.py, engine/tp_workers.py), and a follower replays the
        leader's key."""
        rc = self.cfg.runner
        capturable = self.device.type == "cuda" and rc.use_cuda_graphs and self.attn.graph_safe
        if not rc.prefill_graph_tokens or not (capturable or eager):
            return
        wanted = [b for b in rc.prefill_graph_tokens if max_bucket is None or b <= max_bucket]
        if not wanted:
            return
        if self._prefill_graphs is None:
            sizes = usable_buckets(wanted, self.cfg.scheduler.max_num_batched_tokens)
            self._prefill_graphs = PrefillGraphs(self.model, self.kv_pool.layers, sizes)
        log.info("capturing piecewise prefill graphs [%s]: token buckets %s", key,
                 ",".join(map(str, self._prefill_graphs.sizes)))
        t0 = time.perf_counter()
        self._prefill_graphs.capture(key, stream, show_progress, eager=eager)
        log.info("prefill graphs [%s] captured in %.1f s", key, time.perf_counter() - t0)

    # ---- helpers ------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until nothing launched on this device still runs (raises if the device is broken)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def mark(self) -> torch.cuda.Event | None:
        """An event after everything queued so far on the current stream (None on CPU, where work is
        done on return): synchronizing it waits for that work only."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _run_on(self, stream: torch.cuda.Stream | None, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`fn()` with `stream` current, ordered as if it ran on the caller's stream.

        Stream ordering: `stream` first waits for the caller's stream (inputs the caller wrote, e.g.
        `input_ids` or an earlier step's KV, are ready), and the caller's stream waits for `stream`
        afterwards (the caller reads the logits after they are written). The logits were allocated
        on `stream` and are freed by the caller: `record_stream` keeps the allocator from handing
        their memory to a later allocation on `stream` before the caller's uses of them are done.
        """
        if stream is None or self.device.type != "cuda":
            return fn()
        caller = torch.cuda.current_stream(self.device)
        if stream.cuda_stream == caller.cuda_stream:
            return fn()
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            out = fn()
        caller.wait_stream(stream)
        out.record_stream(caller)
        return out
