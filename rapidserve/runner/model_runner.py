"""ModelRunner: turns scheduled batches into forward passes on a device.

Two calls for the engine: `prefill(items, stream, carry, graph_key)` and `decode(items, stream, graph_key)`.
Each builds the flat token batch and its AttentionMetadata, runs the model on the stream it is handed
and returns float32 logits (prefill: one row per item that asks for logits; decode: one per item).
On CUDA/ROCm, decode replays graphs captured per batch-size bucket on the stream of a given key, and a
prefill that fits a token bucket replays piecewise graphs (prefill_graphs.py) of its key: a
graph keeps the compute partition of the stream it was captured on (docs/measured.md), so the engine
captures one set per partition configuration. No capture on CPU.
Sampling is separate (`sample`), so the engine decides what to do with logits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from rapidserve.attention import AttentionMetadata, get_attention_backend, split_decode_rows
from rapidserve.block_manager import BlockManager
from rapidserve.config import ConfigError, EngineConfig
from rapidserve.kv_pool import KVPool, check_ipc_shareable_allocator, num_blocks_for_budget, pool_spec
from rapidserve.loader import ModelSource, rank_weights, resolve_model
from rapidserve.logit_controls import (
    ControlPlan,
    HistoryOf,
    TokenState,
    apply_controls,
    plan_controls,
    record_tokens,
)
from rapidserve.models.transformer import CausalLM
from rapidserve.ops import cublas_linears, get_ops
from rapidserve.parallel.shard import shard_config
from rapidserve.prompt import PromptLimits
from rapidserve.runner.prefill_graphs import PrefillGraphs, usable_buckets
from rapidserve.runner.prefill_task import (
    TASK_KINDS,
    Guard,
    PrefillTask,
    TaskInputs,
    TaskKind,
    TaskPublisher,
    replay_task,
)
from rapidserve.sampler import Sampler, SamplerOutput, token_generators
from rapidserve.sampling_params import SamplingParams
from rapidserve.sequence import early_stop_bans
from rapidserve.structured import GrammarMask, apply_grammar_mask

if TYPE_CHECKING:
    from rapidserve.parallel.group import TPGroup
    from rapidserve.parallel.mirror import Forward, Leader
    from rapidserve.runner.model_sharing import SharedState

_T = TypeVar("_T")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PrefillItem:
    token_ids: Sequence[int]  # the new tokens of this step (a whole prompt or a chunk of it)
    start_pos: int  # tokens of the sequence already in the cache
    block_table: Sequence[int]  # covers start_pos + len(token_ids) tokens
    need_logits: bool = True


@dataclass(frozen=True)
class DecodeItem:
    token_id: int
    position: int  # of token_id; the context after this step is position + 1 tokens
    block_table: Sequence[int]


@dataclass(frozen=True)
class Carry:
    """Tokens of a step still in flight, fed to the next decode step without waiting for them: row
    `dst` of the step takes `token_ids[src]` for each `(dst, src)` in `rows` (the items' token ids of
    those rows are placeholders).

    Stream ordering: the step reading them runs on the current stream. The step in flight ran on
    this stream, or on another one the caller synchronized before switching, so `token_ids` are
    written before this read. They were allocated on that stream and may be freed while this step
    still reads them: record_stream keeps the allocator from reusing the memory there first (a no-op
    when it is this stream). Caveat, not measured: the index lists (and the decode inputs) are copied
    from pageable host memory, which CUDA orders after the stream's earlier work, so the copy may
    still wait for the step in flight; staging them in pinned memory would remove that wait."""

    token_ids: torch.Tensor
    rows: list[tuple[int, int]]

    def apply(self, input_ids: torch.Tensor) -> None:
        dev = input_ids.device
        dst = torch.tensor([d for d, _ in self.rows]).to(dev, non_blocking=True)
        src = torch.tensor([s for _, s in self.rows]).to(dev, non_blocking=True)
        input_ids[dst] = self.token_ids[src]
        if dev.type == "cuda":
            self.token_ids.record_stream(torch.cuda.current_stream(dev))


def _direct(run: Callable[[], _T]) -> _T:
    """A task's guard without tensor parallelism: run it."""
    return run()


class RanksDiverged(RuntimeError):
    """A tensor-parallel leader's forward failed after its followers queued theirs: fatal to the worker."""

    fatal = True


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but no CUDA/ROCm GPU is visible; use --device cpu")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ConfigError(f"dtype={name!r} is not supported; use auto or one of {sorted(DTYPES)}")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def load_runner(cfg: EngineConfig, tp: TPGroup | None = None) -> ModelRunner:
    """Resolve `cfg.model` and load it (with `tp`: this rank's shard) on the configured device."""
    dev = resolve_device(cfg.runner.device)
    source = resolve_model(cfg.model, preset_device=dev, preset_dtype=resolve_dtype(cfg.runner.dtype, dev))
    return ModelRunner(cfg, source, show_progress=False, tp=tp)


@dataclass
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    batch: int
    logits: torch.Tensor  # the graph's output buffer, [batch, vocab]


class ModelRunner:
    def __init__(self, cfg: EngineConfig, source: ModelSource | None, kv_pool: KVPool | None = None,
                 show_progress: bool = True, attached: SharedState | None = None, tp: TPGroup | None = None) -> None:
        """Load `source` and allocate a KV pool (or use `kv_pool`); or, in the prefill worker, use the
        weights and pool another process shares (`attached`), without a copy. With `tp` this process is
        one rank of a tensor-parallel group: it loads and computes its shard (its KV heads in its pool),
        and every rank must make the same calls in the same order (rapidserve/parallel/mirror.py)."""
        self.cfg, self.tp = cfg, tp
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
        self.block_size = cfg.cache.block_size
        self.max_model_len = cfg.max_model_len
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.ops = get_ops(self.device)
        self.attn = get_attention_backend(cfg.runner.attention_backend, self.device)
        logging.getLogger(__name__).info("attention backend: %s", self.attn.name)
        t0 = time.perf_counter()
        if attached is not None:
            from rapidserve.runner.model_sharing import attach_model

            self.model, self.kv_pool = attach_model(self.mcfg, self.ops, self.attn, self.dtype, self.device,
                                                    max(self.max_model_len, 1), attached, tp)
        else:
            if source is None:
                raise ValueError("ModelRunner needs a model source or attached shared weights")
            cpu_blocks = self._cpu_kv_blocks() if kv_pool is None else None  # before anything max_model_len sizes
            self.model = CausalLM(self.mcfg, self.ops, self.attn, self.dtype, self.device,
                                  max_positions=max(self.max_model_len, 1), tp=tp)
            self._load(source, show_progress)
            self.kv_pool = kv_pool if kv_pool is not None else self._allocate_kv_pool(cpu_blocks)
        if self.device.type == "cuda":
            # Stream ordering: the weights, the pool's zero-fill and (attached) the RoPE table were
            # written on the current stream; the engine computes on partition streams that do not wait
            # for it, so start-up ends with them written.
            torch.cuda.synchronize(self.device)
        self.load_seconds = time.perf_counter() - t0
        self.sampler = Sampler(self.device, cfg.runner.seed)
        self.tokens = TokenState(self.device)  # penalty / bad-word slots (logit_controls.py), owned by the worker
        self._unrecorded: tuple[torch.Tensor, ControlPlan] | None = None  # sample_next(record=False)'s tokens
        self._graphs: dict[str, dict[int, _DecodeGraph]] = {}
        self._graph_pool: object | None = None
        self._static: dict[str, torch.Tensor] = {}
        self._task_ids = 0  # block-wise prefill tasks made so far (their ids, for the followers)
        self._tasks: dict[int, PrefillTask] = {}  # a follower's tasks begun and not ended (replay_task)

    def block_manager(self) -> BlockManager:
        """The block tables and prefix cache over this runner's pool (for the one process that owns them).
        The cache's hashes start from the model's name and dtype: whatever changes the K/V changes them."""
        salt = f"{self.cfg.model}|{self.dtype}|{self.block_size}".encode()
        return BlockManager(self.kv_pool.num_blocks, self.block_size,
                            enable_caching=self.cfg.cache.enable_prefix_caching, salt=salt)

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

    def _cpu_kv_blocks(self) -> int | None:
        """The CPU pool's blocks, from its byte budget alone (None on a GPU, or with cache.num_blocks): known
        before the model is built, so a max_model_len that one sequence cannot fit is refused at once (naming
        --max-model-len), not after the weights load and a RoPE table of that many rows is built."""
        cache = self.cfg.cache
        if cache.num_blocks is not None or self.device.type != "cpu":
            return None
        shard = self.mcfg if self.tp is None else shard_config(self.mcfg, self.tp.layout)  # this rank's KV heads
        return num_blocks_for_budget(cache.cpu_kv_bytes, pool_spec(shard, cache, self.dtype, 1).bytes_per_block,
                                     self.block_size, self.max_model_len, cpu=True)

    def _allocate_kv_pool(self, cpu_blocks: int | None) -> KVPool:
        cache = self.cfg.cache
        shard = self.model.cfg  # this rank's KV heads under tensor parallelism
        probe = pool_spec(shard, cache, self.dtype, 1)
        if cache.num_blocks is not None:
            n = cache.num_blocks
        elif cpu_blocks is not None:
            n = cpu_blocks
        else:
            n = num_blocks_for_budget(self._gpu_kv_budget(), probe.bytes_per_block, self.block_size,
                                      self.max_model_len)
        if self.tp is not None:
            n = self.tp.agree_min(n)  # the ranks' pools hold the same blocks: the leader's tables index all
        return KVPool.allocate(pool_spec(shard, cache, self.dtype, n), self.device)

    def _gpu_kv_budget(self) -> int:
        """total * utilization - memory in use - the activation peak of the largest step."""
        torch.cuda.synchronize()
        tokens = min(self.cfg.scheduler.max_num_batched_tokens, self.max_model_len)
        scratch = KVPool.allocate(pool_spec(self.model.cfg, self.cfg.cache, self.dtype,
                                            -(-tokens // self.block_size)), self.device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        item = PrefillItem([0] * tokens, 0, list(range(-(-tokens // self.block_size))))
        self._prefill_on(scratch, [item])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        max_bs = self.cfg.runner.graph_batch_sizes[-1]
        peak = max(peak, max_bs * self.mcfg.vocab_size * 4 * 3)  # decode logits + sampling scratch
        del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return int(total * self.cfg.cache.gpu_memory_utilization - (total - free) - peak)

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

    def _prefill_arrays(self, items: Sequence[PrefillItem]) -> tuple[np.ndarray, ...]:
        """Host inputs of a prefill forward: ids, positions, tables, slots, ctx, cu, want (the rows
        whose logits are returned)."""
        bs = self.block_size
        lens = np.array([len(it.token_ids) for it in items], dtype=np.int64)
        starts = np.array([it.start_pos for it in items], dtype=np.int64)
        cu = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        ids = np.fromiter((t for it in items for t in it.token_ids), dtype=np.int64, count=int(cu[-1]))
        seq_of_tok = np.repeat(np.arange(len(items)), lens)
        positions = starts[seq_of_tok] + (np.arange(cu[-1]) - cu[seq_of_tok])
        # Width rounded up to 16 entries: the kernels' integer specialisations (stride % 16) stay fixed,
        # so steps with new table widths do not compile new kernel variants mid-serving.
        tables = self._table_array(items, -(-max(len(it.block_table) for it in items) // 16) * 16)
        slots = tables[seq_of_tok, positions // bs].astype(np.int64) * bs + positions % bs
        ctx = (starts + lens).astype(np.int32)
        want = np.array([i for i, it in enumerate(items) if it.need_logits], dtype=np.int64)
        return ids, positions, tables, slots, ctx, cu, want

    def _prefill_meta(self, arrays: Sequence[np.ndarray]) -> AttentionMetadata:
        """The attention metadata of a prefill forward, on the device (copies queued on the current stream)."""
        _, _, tables, slots, ctx, cu, _ = arrays
        lens = np.diff(cu)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._dev(slots),
            block_tables=self._dev(tables),
            context_lens=self._dev(ctx),
            cu_seqlens_q=self._dev(cu.astype(np.int32)),
            max_seqlen_q=int(lens.max()),
            max_context_len=int(ctx.max()),
        )
        return split_decode_rows(meta, lens.tolist())  # a mixed step's decodes use the decode kernel

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
            return self._new_task(arrays, self._task_ids, None, _direct)
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

    def _published(self, run: Callable[[], _T]) -> _T:
        """A call the followers were told of: if it fails here, theirs did not, and the ranks' collectives no
        longer pair up; the worker must die (the router restarts the engine) rather than go on."""
        try:
            return run()
        except Exception as e:
            raise RanksDiverged(f"a tensor-parallel forward failed on the leader after the followers were told of "
                                f"it ({type(e).__name__}: {e}); the ranks' collectives no longer pair up") from e

    def _decode_run(self, arrays: Sequence[np.ndarray], graph_key: str, carry: Carry | None) -> torch.Tensor:
        """Everything on the current stream: the static buffers are filled on the stream that replays
        the graph, so a replay never reads inputs another stream is still writing."""
        n = len(arrays[0])
        graphs = self._graphs.get(graph_key)
        if graphs and n <= max(graphs):
            g = graphs[min(b for b in graphs if b >= n)]
            self._fill_static(arrays, g.batch)
            if carry is not None:
                carry.apply(self._static["input_ids"])
            g.graph.replay()
            return g.logits[:n]
        ids, pos, tables, ctx, slots = arrays
        meta = AttentionMetadata(False, self._dev(slots), self._dev(tables), self._dev(ctx),
                                 max_context_len=int(ctx.max()))
        tokens = self._dev(ids)
        if carry is not None:
            carry.apply(tokens)
        hidden = self.model(tokens, self._dev(pos), self.kv_pool.layers, meta)
        return self.model.compute_logits(hidden)

    def replay(self, msg: Forward, sampled: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """A follower's copy of the leader's call `msg` (parallel/mirror.py), on the current stream; a
        Carry takes its tokens from `sampled` (the broadcasts received so far, by number)."""
        arrays = [a.array() for a in msg.arrays]
        carry = Carry(sampled[msg.carry_seq], list(msg.carry_rows)) if msg.carry_seq >= 0 else None
        if msg.kind == "prefill":  # the leader's piecewise graphs of msg.graph_key, if it captured them (so did we)
            return self._prefill_run(self.kv_pool, arrays, carry, msg.graph_key)
        if msg.kind in TASK_KINDS:  # a block-wise prefill's piece (prefill_task.py)
            return replay_task(self._tasks, msg, lambda: self._new_task(arrays, msg.task, None, _direct))
        return self._decode_run(arrays, msg.graph_key, carry)

    def decode_graph(self, n: int, graph_key: str = "default") -> torch.cuda.CUDAGraph | None:
        """The graph `decode()` replays for `n` sequences under `graph_key` (None: runs eager). After
        one `decode()` call its inputs are in place, so replaying it again repeats that step."""
        graphs = self._graphs.get(graph_key)
        if not graphs or n > max(graphs):
            return None
        return graphs[min(b for b in graphs if b >= n)].graph

    def _decode_arrays(self, items: Sequence[DecodeItem], width: int) -> tuple[np.ndarray, ...]:
        bs = self.block_size
        ids = np.array([it.token_id for it in items], dtype=np.int64)
        pos = np.array([it.position for it in items], dtype=np.int64)
        tables = self._table_array(items, width)
        slots = tables[np.arange(len(items)), pos // bs].astype(np.int64) * bs + pos % bs
        return ids, pos, tables, (pos + 1).astype(np.int32), slots

    def _fill_static(self, arrays: Sequence[np.ndarray], batch: int) -> None:
        s, n = self._static, len(arrays[0])
        ids, pos, tables, ctx, slots = arrays
        s["input_ids"][:n].copy_(torch.from_numpy(ids), non_blocking=True)
        s["positions"][:n].copy_(torch.from_numpy(pos), non_blocking=True)
        s["block_tables"][:n].copy_(torch.from_numpy(tables), non_blocking=True)
        s["context_lens"][:n].copy_(torch.from_numpy(ctx), non_blocking=True)
        s["slot_mapping"][:n].copy_(torch.from_numpy(slots), non_blocking=True)
        if batch > n:  # padding rows: write nothing, attend to nothing
            s["slot_mapping"][n:batch].fill_(-1)
            s["context_lens"][n:batch].fill_(0)

    def capture_decode_graphs(self, stream: torch.cuda.Stream | None = None, key: str = "default",
                              show_progress: bool = True, whole_gpu: bool = True) -> None:
        """Capture one decode graph per batch bucket on `stream` (its compute partition sticks).

        `whole_gpu`: whether `stream` may use every SM (no partition, or an overallocated one). Graphs of a
        stream limited to part of the GPU run their linear layers through cuBLAS (`ops.cublas_linears`):
        the small-batch Triton kernel is faster only with the whole GPU.

        Stream ordering (the rule for every side stream here): the static buffers, the weights and the
        KV pool were allocated and written on the caller's current stream, and the capture stream (a
        new one, or a partition's non-blocking stream) does not otherwise wait for it. The caching
        allocator recycles freed memory without clearing it, so a warm-up that overtook the zero-fill
        of the static buffers read an earlier test's data as block tables ("index out of bounds",
        only after other GPU work and never under CUDA_LAUNCH_BLOCKING=1). Hence: the capture stream
        waits for the caller's stream before touching them; every fill, warm-up and capture runs on
        the capture stream; the caller's stream waits for the capture stream at the end, so a later
        synchronize of the caller's stream or device (export_shared) covers this work too. The
        static buffers live as long as the runner: nothing frees them while a stream uses them.
        """
        if self.device.type != "cuda" or not self.cfg.runner.use_cuda_graphs or not self.attn.graph_safe:
            return
        sizes = list(self.cfg.runner.graph_batch_sizes)
        caller = torch.cuda.current_stream(self.device)
        if not self._static:
            m = sizes[-1]
            dev = self.device
            self._static = {
                "input_ids": torch.zeros(m, dtype=torch.int64, device=dev),
                "positions": torch.zeros(m, dtype=torch.int64, device=dev),
                "block_tables": torch.zeros(m, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
                "context_lens": torch.zeros(m, dtype=torch.int32, device=dev),
                "slot_mapping": torch.full((m,), -1, dtype=torch.int64, device=dev),
            }
            self._graph_pool = torch.cuda.graph_pool_handle()
        s = self._static
        whole_ops = self.model.ops
        self.model.ops = whole_ops if whole_gpu else cublas_linears(whole_ops)
        try:
            self._capture(sizes, s, stream, caller, key, show_progress)
        finally:
            self.model.ops = whole_ops

    def _capture(self, sizes: list[int], s: dict[str, torch.Tensor], stream: torch.cuda.Stream | None,
                 caller: torch.cuda.Stream, key: str, show_progress: bool) -> None:
        capture_stream = stream if stream is not None else torch.cuda.Stream(self.device)
        capture_stream.wait_stream(caller)  # static buffers, weights and pool are written before any read
        graphs: dict[int, _DecodeGraph] = {}
        with torch.cuda.stream(capture_stream):
            for b in tqdm(sorted(sizes, reverse=True), desc=f"capturing decode graphs [{key}]",
                          disable=not show_progress, leave=False):
                s["slot_mapping"][:b].fill_(-1)
                s["context_lens"][:b].fill_(0)
                meta = AttentionMetadata(False, s["slot_mapping"][:b], s["block_tables"][:b],
                                         s["context_lens"][:b], max_context_len=self.max_model_len)

                def step(b: int = b, meta: AttentionMetadata = meta) -> torch.Tensor:
                    h = self.model(s["input_ids"][:b], s["positions"][:b], self.kv_pool.layers, meta)
                    return self.model.compute_logits(h)

                step()  # warm-up: Triton compilation and cuBLAS handles happen outside capture
                capture_stream.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._graph_pool, stream=capture_stream):
                    logits = step()
                graphs[b] = _DecodeGraph(g, b, logits)
        caller.wait_stream(capture_stream)
        self._graphs[key] = graphs
        torch.cuda.synchronize(self.device)

    def capture_prefill_graphs(self, stream: torch.cuda.Stream | None = None, key: str = "default",
                               show_progress: bool = True, eager: bool = False) -> None:
        """Capture the piecewise prefill graphs (prefill_graphs.py) of every token bucket of
        `cfg.runner.prefill_graph_tokens` on `stream` under `key` (up to the first bucket that holds a whole
        step's `max_num_batched_tokens`); `prefill(..., graph_key=key)` then replays
        them for forwards that fit a bucket. Nothing on CPU, with graphs off (`use_cuda_graphs`, no buckets), or
        with a backend whose kernels cannot be captured. `eager`: record the pieces as plain calls instead of
        graphs (on any device): the CPU tests of the piecewise path. Tensor parallelism: the capture runs the
        pieces' collectives, so every rank captures the same keys in the same order before it leads or follows
        (engine/worker_build.py, engine/tp_workers.py), and a follower replays the leader's key."""
        rc = self.cfg.runner
        capturable = self.device.type == "cuda" and rc.use_cuda_graphs and self.attn.graph_safe
        if not rc.prefill_graph_tokens or not (capturable or eager):
            return
        if self._prefill_graphs is None:
            sizes = usable_buckets(rc.prefill_graph_tokens, self.cfg.scheduler.max_num_batched_tokens)
            self._prefill_graphs = PrefillGraphs(self.model, self.kv_pool.layers, sizes)
        self._prefill_graphs.capture(key, stream, show_progress, eager=eager)

    # ---- sampling and helpers -------------------------------------------------------------
    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> SamplerOutput:
        return self.sampler.sample(logits, list(params), list(generators))

    def sample_next(self, logits: torch.Tensor, params: Sequence[SamplingParams], output_index: Sequence[int],
                    eos: tuple[int, ...], grammar: GrammarMask | None = None, history: HistoryOf | None = None,
                    record: bool = True, share: bool = True) -> SamplerOutput:
        """Sample row i as output token `output_index[i]` of its request: stop tokens banned while
        `min_tokens` is not reached (in place), the request's seeded generator at that index.
        `grammar`: the step's structured-output bitmask (rapidserve/structured), applied in place; its
        rows' early-stop bans are in the mask already (a complete grammar may end below min_tokens).
        Rows with logit controls (penalties, logit_bias, bad words, allowed_token_ids) take them on a copy
        of the (masked) logits (logit_controls.py); `history(i)` gives row i's request tokens and slot key
        where the controls read earlier tokens. The sampled tokens are added to the rows' slots on the
        device (`logit_controls.record_tokens`) at once, or, with `record=False`, by `record_sampled()`
        once the caller's step is wholly queued (a step that fails after sampling must not count its
        tokens; a retry that is not taken never calls it). Under tensor parallelism the tokens are broadcast to
        the followers (a later Carry reads them there) unless `share=False` (a retry whose step is not taken)."""
        self._unrecorded = None
        rows: list[int] = []
        cols: list[int] = []
        controlled = False
        masked = set(grammar.rows) if grammar is not None else set()
        for i, (p, k) in enumerate(zip(params, output_index, strict=True)):
            controlled = controlled or p.has_logit_controls
            if i in masked:
                continue
            banned = [t for t in early_stop_bans(p, k, eos) if t < logits.shape[-1]]
            rows += [i] * len(banned)
            cols += banned
        # The logits come out of an inference-mode forward (or a graph's output buffer): writing them
        # outside inference mode raises, so the ban and the sampling run inside it.
        with torch.inference_mode():
            if rows:
                logits[self._dev(np.asarray(rows, dtype=np.int64)), self._dev(np.asarray(cols, dtype=np.int64))] = \
                    float("-inf")
            if grammar is not None:
                apply_grammar_mask(logits, grammar)
            gens = token_generators([(p.seed, k) for p, k in zip(params, output_index, strict=True)], self.device)
            if not controlled:
                return self._shared(self.sample(logits, params, gens), share)
            plan = plan_controls(params, output_index, history, self.tokens, logits.shape[-1])
            out = self.sampler.sample(apply_controls(logits, plan, self.tokens), list(params), list(gens),
                                      raw_logits=logits)
            if record:
                record_tokens(out.token_ids, plan, self.tokens)
            else:
                self._unrecorded = (out.token_ids, plan)
            return self._shared(out, share)

    def _shared(self, out: SamplerOutput, share: bool) -> SamplerOutput:
        """Tensor parallelism: the followers receive the sampled tokens (a Carry reads them there too)."""
        if self.leader is not None and share:
            self.leader.sampled(out.token_ids)
        return out

    def record_sampled(self) -> None:
        """Add the tokens of the last `sample_next(record=False)` to their slots (nothing if it had none)."""
        pending, self._unrecorded = self._unrecorded, None
        if pending is not None:
            with torch.inference_mode():  # the slots were made there (inside sample_next)
                record_tokens(pending[0], pending[1], self.tokens)

    def _table_array(self, items: Sequence[PrefillItem] | Sequence[DecodeItem], width: int) -> np.ndarray:
        out = np.zeros((len(items), width), dtype=np.int32)
        for i, it in enumerate(items):
            out[i, : len(it.block_table)] = it.block_table
        return out

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

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
