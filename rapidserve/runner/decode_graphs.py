"""Decode CUDA/HIP graphs: one graph per batch-size bucket (RunnerConfig.graph_batch_sizes up to the first at or above
the worker's seats: `batch_limits.decode_graph_buckets`) per stream key.

`capture_decode_graphs(stream, key)` captures them on `stream`: a graph keeps the compute partition of the
stream it was captured on (docs/measured.md), so the engine captures one set per partition configuration and
`decode(..., graph_key=key)` replays the set of the partition whose stream is current. A step of n sequences
replays the smallest bucket >= n; a step larger than every bucket, a key with no graphs, CPU, graphs off
(`use_cuda_graphs`) or a backend whose kernels cannot be captured (`graph_safe`) run eagerly.

Programmatic dependent launch (rapidserve/ops/pdl.py): each bucket's graph is captured with the Triton kernels
launched as `decode_launch(bucket)` chooses (`ops.pdl_table.pdl_for_step`: PDL and the skinny GEMMs' L2 weight
prefetch on at small batches, off at large ones, from the GPU's measured table), and an eager step as its row count
chooses; the model's own bundles (every other forward: prefill, mixed steps) launch with PDL off. Each graph records
its choice (`DecodeGraph.launch`, `decode_launches(key)`); `capture_decode_graphs(launch=...)` forces one choice on
every bucket (bench/decode_profile.py's A/B).

Memory layout: one set of static input buffers, sized for the largest bucket m and shared by every bucket and
key: input_ids [m] int64, positions [m] int64, block_tables [m, max_blocks_per_seq] int32, context_lens [m]
int32, slot_mapping [m] int64. A step of n rows fills rows [0, n); padding rows up to the bucket get slot -1
(no K/V written) and context length 0 (attend to nothing). Every graph captures into one private memory pool,
and its logits stay in one output buffer shared by every graph of every key (`_static["logits"]`, [largest bucket,
vocab] float32, rows [0, bucket) each graph's) until the next replay of any graph: the same as one graph replayed
twice, which the steps on a key's stream already order (a step's logits are sampled on that stream before its next
forward), and across keys the decode worker's switch of configuration orders it (it synchronizes the old key's
stream before the first step on the new one: engine/decode_worker.py `_switch`; a TP follower replays the leader's
keys in the leader's order). One buffer, not one a graph (the buckets up to 512 would hold 4455 rows, 2.7 GB at a
151936-token vocabulary) nor one a key (311 MB each at 512 rows: 1.2 GB more in rapid mode's 5 keys, memory the KV
budget does not charge).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from rapidserve.attention import AttentionBackend, AttentionMetadata, with_pdl
from rapidserve.batch_limits import config_seats, decode_graph_buckets
from rapidserve.ops import Ops, cublas_linears, with_launch
from rapidserve.ops.pdl_table import PDL_TABLE, LaunchChoice, PdlDevice, pdl_for_step
from rapidserve.runner.inputs import BatchInputs, Carry

if TYPE_CHECKING:
    from rapidserve.config import EngineConfig
    from rapidserve.kv_pool import KVPool
    from rapidserve.models.transformer import CausalLM

log = logging.getLogger(__name__)


@dataclass
class DecodeGraph:
    graph: torch.cuda.CUDAGraph
    batch: int
    logits: torch.Tensor  # the graph's output buffer, [batch, vocab]
    launch: LaunchChoice  # how its Triton kernels were launched (PDL, the GEMMs' prefetch bytes)


class DecodeGraphs(BatchInputs):
    """Decode graph capture and replay, and the eager decode step (a part of ModelRunner)."""

    cfg: EngineConfig
    attn: AttentionBackend
    model: CausalLM
    kv_pool: KVPool
    max_model_len: int
    max_blocks_per_seq: int
    _graphs: dict[str, dict[int, DecodeGraph]]  # per stream key, per batch bucket
    _graph_pool: object | None
    _static: dict[str, torch.Tensor]  # the static input buffers (layout above), empty until the first capture
    pdl_device: PdlDevice  # what `decode_launch` reads of the device (ops.pdl.pdl_device)
    # per choice: the (ops, attn) bound from, and the bundles bound (`_launching`)
    _launch_bundles: dict[LaunchChoice, tuple[Ops, AttentionBackend, Ops, AttentionBackend]]

    def decode_launch(self, rows: int) -> LaunchChoice:
        """How a decode step of `rows` rows (a graph's bucket, an eager step's sequences) launches its Triton kernels
        on this device: `ops.pdl_table.pdl_for_step` from the packaged table."""
        return pdl_for_step(rows, self.pdl_device, PDL_TABLE)

    def decode_launches(self, graph_key: str = "default") -> dict[int, LaunchChoice]:
        """What each captured graph of `graph_key` chose, by batch bucket (empty: no graphs of that key)."""
        return {b: g.launch for b, g in sorted(self._graphs.get(graph_key, {}).items())}

    @contextmanager
    def _launching(self, choice: LaunchChoice) -> Iterator[None]:
        """The model's ops and attention bound to `choice` while the block runs (a decode step's forward or its
        capture), then the model's own back. Bound once per choice and bundle pair."""
        ops, attn = self.model.ops, self.model.attn
        hit = self._launch_bundles.get(choice)
        if hit is None or hit[0] is not ops or hit[1] is not attn:
            hit = (ops, attn, with_launch(ops, choice), with_pdl(attn, choice.pdl))
            self._launch_bundles[choice] = hit
        self.model.ops, self.model.attn = hit[2], hit[3]
        try:
            yield
        finally:
            self.model.ops, self.model.attn = ops, attn

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
        with self._launching(self.decode_launch(n)):
            hidden = self.model(tokens, self._dev(pos), self.kv_pool.layers, meta)
        return self.model.compute_logits(hidden)

    def decode_graph(self, n: int, graph_key: str = "default") -> torch.cuda.CUDAGraph | None:
        """The graph `decode()` replays for `n` sequences under `graph_key` (None: runs eager). After
        one `decode()` call its inputs are in place, so replaying it again repeats that step."""
        graphs = self._graphs.get(graph_key)
        if not graphs or n > max(graphs):
            return None
        return graphs[min(b for b in graphs if b >= n)].graph

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
                              show_progress: bool = True, whole_gpu: bool = True,
                              launch: LaunchChoice | None = None) -> None:
        """Capture one decode graph per batch bucket on `stream` (its compute partition sticks).

        `whole_gpu`: whether `stream` may use every SM (no partition, or an overallocated one). Graphs of a
        stream limited to part of the GPU run their linear layers through cuBLAS (`ops.cublas_linears`):
        the small-batch Triton kernel is faster only with the whole GPU.
        `launch`: how every bucket's kernels launch (None: `decode_launch(bucket)`, the table's choice; given: that
        one for all, bench/decode_profile.py's A/B); each graph records it (`decode_launches`).

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
        sizes = list(decode_graph_buckets(self.cfg.runner.graph_batch_sizes, config_seats(self.cfg)))
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
        log.info("capturing decode graphs [%s]: batch sizes %s", key, ",".join(map(str, sizes)))
        t0 = time.perf_counter()
        try:
            self._capture(sizes, s, stream, caller, key, show_progress, launch)
        finally:
            self.model.ops = whole_ops
        chosen = self.decode_launches(key)
        log.info("decode graphs [%s] captured in %.1f s; on %s: %s", key, time.perf_counter() - t0,
                 self.pdl_device.name, "; ".join(f"{c.label()} at {','.join(str(b) for b in chosen if chosen[b] == c)}"
                                                 for c in dict.fromkeys(chosen.values())))

    def _capture(self, sizes: list[int], s: dict[str, torch.Tensor], stream: torch.cuda.Stream | None,
                 caller: torch.cuda.Stream, key: str, show_progress: bool, launch: LaunchChoice | None) -> None:
        capture_stream = stream if stream is not None else torch.cuda.Stream(self.device)
        capture_stream.wait_stream(caller)  # static buffers, weights and pool are written before any read
        graphs: dict[int, DecodeGraph] = {}
        out = s.get("logits")  # the one logits buffer (module doc), sized by the first key's largest bucket
        with torch.cuda.stream(capture_stream):
            for b in tqdm(sorted(sizes, reverse=True), desc=f"capturing decode graphs [{key}]",
                          disable=not show_progress, leave=False):
                s["slot_mapping"][:b].fill_(-1)
                s["context_lens"][:b].fill_(0)
                meta = AttentionMetadata(False, s["slot_mapping"][:b], s["block_tables"][:b],
                                         s["context_lens"][:b], max_context_len=self.max_model_len)

                def step(b: int = b, meta: AttentionMetadata = meta, into: torch.Tensor | None = None) -> torch.Tensor:
                    h = self.model(s["input_ids"][:b], s["positions"][:b], self.kv_pool.layers, meta)
                    return self.model.compute_logits(h, None if into is None else into[:b])

                choice = launch if launch is not None else self.decode_launch(b)
                with self._launching(choice):
                    warm = step()  # warm-up: Triton compilation and cuBLAS handles happen outside capture
                    if out is None or out.shape[0] < b:
                        out = s["logits"] = torch.empty(b, warm.shape[1], dtype=torch.float32, device=self.device)
                    del warm
                    capture_stream.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self._graph_pool, stream=capture_stream):
                        logits = step(into=out)
                graphs[b] = DecodeGraph(g, b, logits, choice)
        caller.wait_stream(capture_stream)
        self._graphs[key] = graphs
        torch.cuda.synchronize(self.device)
