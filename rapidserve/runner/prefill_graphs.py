"""Piecewise CUDA graphs of the prefill forward (issue 16: "CUDA graphs wherever shapes allow: prefill chunks by
bucket or piecewise").

Why: launched from Python, a prefill forward of Qwen3-8B costs the host 14-30 ms (~400 launches, Triton's launcher
~30-50 us each; it varied between H100 machines) whatever its size, while the GPU is busy 6 ms for 16 tokens, 8 ms
for 256, 12 ms for 512 and 24 ms for 1024. So a forward of up to ~512 tokens (a short prompt's TTFT, a hybrid
step's chunk) waits for the host; replayed as pieces it takes 7-9 ms up to 256 tokens (bench/results/h100_1127/
prefill_graphs/).

What is captured: per token bucket b (RunnerConfig.prefill_graph_tokens) and per stream key (a partition
configuration: a graph keeps the compute partition of the stream it was captured on), the forward cut at
attention into L + 1 pieces for a model of L layers:

    P_0        embed(ids[:b]), then layer 0's `pre_attention`
    P_i        layer i-1's `post_attention`, then layer i's `pre_attention`        (0 < i < L)
    P_L        layer L-1's `post_attention`, then the final norm

Attention runs between the pieces, eagerly, with the step's own metadata: any number of sequences, any cached
context, a mixed step's decode rows. Everything in a piece works row by row, so a forward of T <= b tokens
fills rows [0, T) of the inputs, pads rows [T, b) (token 0, position 0, slot -1: no K/V written), and the
padding rows never reach a real row; attention reads and writes rows [0, T) only.

Memory layout: one set of static buffers sized for the largest bucket, shared by every bucket and key:
    ids [Tm] int64, positions [Tm] int64, slots [Tm] int64 (cache slot of each row; -1 writes nothing),
    q [Tm, heads, head_dim] (P_i's output: rotated queries of layer i; their K/V are already in the cache),
    o [Tm, heads, head_dim] (attention's output of layer i, P_{i+1}'s input),
    residual [Tm, hidden] (the residual stream between pieces), out [Tm, hidden] (P_L's output).
A piece reads static buffers and writes its results into them (a copy at its end); its own temporaries are
dead when it ends. Every piece of every bucket and key is captured into one private memory pool, where a later
capture on the same stream reuses an earlier one's temporaries (the caching allocator reuses a block on the
stream that freed it: each key, captured on its own partition stream, adds its own). That is safe because pieces
never run concurrently (one stream at a time in a process; a switch of partition stream is ordered by the
caller) and no piece's temporaries outlive it. This memory (0.18 GiB for 5 keys and Qwen3-8B on the H100) comes
out of what the KV pool leaves (1 - gpu_memory_utilization), not out of the KV budget.

Tensor parallelism: the pieces' collectives are captured with them, so every rank captures the same sets in the
same order before the leader starts to publish (engine/worker_build.py, engine/tp_workers.py), and a follower
replays the key the leader's Forward names (the same bucket rule on the same inputs picks graph or eager on both).

Which buckets: the prefill worker's up to PREFILL_WORKER_MAX_BUCKET, the decode worker's fused steps (duet's on the
configuration a fused step runs on, `PlanWire.fused_graphs`; hybrid's) every bucket of the list, both only those a
step's token budget can use (`usable_buckets`).

Not graphed: forwards longer than the largest bucket (their launches hide behind the GPU's work),
disaggregated prefill and the block-wise prefill of the drift policy
(prefill_task.py), whose workers capture none, and a forward into another pool than the captured
one (the runner's KV-budget probe). On CPU there is nothing to capture: `eager=True` records each
piece as a plain call, so the CPU tests run the very same pieces, buffers and padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from tqdm import tqdm

from rapidserve.attention import AttentionMetadata
from rapidserve.config import RunnerConfig

if TYPE_CHECKING:
    from rapidserve.models.decoder_layer import KVCache
    from rapidserve.models.transformer import CausalLM


class Piece(Protocol):
    def replay(self) -> None: ...


class EagerPiece:
    """A piece run as a plain call on each replay (CPU, tests)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class Carries(Protocol):
    """A mixed step's carried tokens (runner.Carry): writes them into the step's input ids on the device."""

    def apply(self, input_ids: torch.Tensor) -> None: ...


def check_buckets(sizes: Sequence[int]) -> tuple[int, ...]:
    """The token buckets, validated by RunnerConfig's rule (ConfigError, a ValueError): positive integers, unique,
    ascending (empty: no prefill graphs)."""
    return RunnerConfig(prefill_graph_tokens=tuple(sizes)).prefill_graph_tokens


# The largest bucket the prefill worker (rapid, duet's split) and `LLM` capture: the prefill worker's forwards of more
# tokens keep the GPU busy longer than their launch takes (1% saved at 1024 tokens on the H100), so their launches hide
# behind its work, and offline no stream waits on a step's tokens; larger graphs would only cost start-up time and
# memory there. The decode worker's fused steps capture every bucket of
# RunnerConfig.prefill_graph_tokens: a fused step is launched while the step before it is in flight, whose tokens are
# recorded only once that launch returns, so an eager launch of 14-30 ms (~400 kernels from Python) delays them.
PREFILL_WORKER_MAX_BUCKET = 512


def usable_buckets(sizes: Sequence[int], max_tokens: int) -> tuple[int, ...]:
    """The buckets a forward of at most `max_tokens` tokens (the step's token budget) can use: those below it and
    the first at or above it; the rest would never be replayed, only captured."""
    out = []
    for b in sizes:
        out.append(b)
        if b >= max_tokens:
            break
    return tuple(out)


def bucket_for(sizes: Sequence[int], num_tokens: int) -> int | None:
    """The smallest bucket holding `num_tokens` tokens, or None when none does (the forward runs eager)."""
    return next((b for b in sizes if b >= num_tokens), None)


class PrefillGraphs:
    """Piecewise prefill graphs of one model over one KV pool, per stream key and token bucket. One owner."""

    def __init__(self, model: CausalLM, kv_layers: list[KVCache], sizes: Sequence[int]) -> None:
        self.model, self.kv_layers = model, kv_layers
        self.sizes = check_buckets(sizes)
        if not self.sizes:
            raise ValueError("PrefillGraphs needs at least one token bucket")
        cfg, dev = model.cfg, model.device
        m = self.sizes[-1]
        with torch.inference_mode():
            self.ids = torch.zeros(m, dtype=torch.int64, device=dev)
            self.positions = torch.zeros(m, dtype=torch.int64, device=dev)
            self.slots = torch.full((m,), -1, dtype=torch.int64, device=dev)
            self.q = torch.zeros(m, cfg.num_heads, cfg.head_dim, dtype=model.dtype, device=dev)
            self.o = torch.zeros(m, cfg.num_heads, cfg.head_dim, dtype=model.dtype, device=dev)
            self.residual = torch.zeros(m, cfg.hidden_size, dtype=model.dtype, device=dev)
            self.out = torch.zeros(m, cfg.hidden_size, dtype=model.dtype, device=dev)
        self.sets: dict[str, dict[int, list[Piece]]] = {}
        self.pool: object | None = None

    def bucket(self, key: str, num_tokens: int) -> int | None:
        """The bucket a forward of `num_tokens` tokens replays under `key` (None: no graphs cover it)."""
        return bucket_for(self.sizes, num_tokens) if key in self.sets else None

    # ---- capture ------------------------------------------------------------------------------
    def _piece(self, p: int, b: int) -> None:
        """Piece p of bucket b (module doc), reading and writing the static buffers."""
        m = self.model
        if p == 0:
            hidden, residual = m.embed(self.ids[:b]), None
        else:
            hidden, residual = m.layers[p - 1].post_attention(self.o[:b], self.residual[:b], m.ops)
        if p < len(m.layers):
            q, residual = m.layers[p].pre_attention(hidden, residual, self.positions[:b], m.cos_sin,
                                                    self.kv_layers[p], self.slots[:b], m.ops)
            self.q[:b].copy_(q)
            self.residual[:b].copy_(residual)
        else:
            self.out[:b].copy_(m.final_norm(hidden, residual))

    @torch.inference_mode()
    def capture(self, key: str, stream: torch.cuda.Stream | None = None, show_progress: bool = False,
                eager: bool = False) -> None:
        """Capture every bucket's pieces on `stream` for `key` (`eager`: record plain calls instead; on CPU
        always). Stream ordering as ModelRunner.capture_decode_graphs: the capture stream waits for the caller's
        (weights, pool and static buffers written), runs every warm-up and capture, and the caller's stream
        waits for it at the end. The slots are all -1 meanwhile: warm-ups write no K/V. Ends with one forward
        through the new pieces (`_warm_attention`)."""
        dev = self.model.device
        eager = eager or dev.type != "cuda"
        self.slots.fill_(-1)
        layers = len(self.model.layers)
        sets: dict[int, list[Piece]] = {}
        if eager:
            for b in self.sizes:
                sets[b] = [EagerPiece(lambda p=p, b=b: self._piece(p, b)) for p in range(layers + 1)]
            self.sets[key] = sets
            self._warm_attention(key)
            return
        caller = torch.cuda.current_stream(dev)
        cap = stream if stream is not None else torch.cuda.Stream(dev)
        cap.wait_stream(caller)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(cap):
            for b in tqdm(sorted(self.sizes, reverse=True), desc=f"capturing prefill graphs [{key}]",
                          disable=not show_progress, leave=False):
                for p in range(layers + 1):
                    self._piece(p, b)  # warm-up: Triton compilation and cuBLAS handles outside capture
                cap.synchronize()
                pieces: list[Piece] = []
                for p in range(layers + 1):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool, stream=cap):
                        self._piece(p, b)
                    pieces.append(g)
                sets[b] = pieces
            self.sets[key] = sets
            self._warm_attention(key)
        caller.wait_stream(cap)
        torch.cuda.synchronize(dev)

    def _warm_attention(self, key: str) -> None:
        """One forward of the smallest bucket through the pieces and the attention kernels between them, so the
        first request does not wait for their compilation. Every slot is -1: nothing is written to the pool
        (which another process may be using), and attention reads block 0 whatever it holds."""
        b = self.sizes[0]
        dev = self.model.device
        blocks = -(-b // self.kv_layers[0][0].shape[2])
        width = -(-blocks // 16) * 16  # as the runner's tables: a multiple of 16 entries
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=torch.full((b,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(1, width, dtype=torch.int32, device=dev),
            context_lens=torch.tensor([b], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, b], dtype=torch.int32, device=dev), max_seqlen_q=b, max_context_len=b)
        zeros = np.zeros(b, dtype=np.int64)  # position 0: inside RoPE's table whatever max_model_len is
        self.run(key, b, zeros, zeros, np.full(b, -1, dtype=np.int64), meta)

    # ---- run ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, key: str, bucket: int, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            meta: AttentionMetadata, carry: Carries | None = None) -> torch.Tensor:
        """The prefill forward of `len(ids)` <= `bucket` tokens on the current stream: hidden states after the
        final norm, [T, hidden], a view of the static output (read it before the next forward is queued).
        `meta`: the step's attention metadata (its slot mapping is ignored: `slots` are written by the
        pieces); `carry`: a mixed step's decode rows take their tokens from the device."""
        t = len(ids)
        pieces = self.sets[key][bucket]
        if t > bucket:
            raise ValueError(f"{t} tokens do not fit the {bucket}-token bucket")
        pad = bucket - t
        self.ids[:bucket].copy_(torch.from_numpy(np.pad(ids, (0, pad))), non_blocking=True)
        self.positions[:bucket].copy_(torch.from_numpy(np.pad(positions, (0, pad))), non_blocking=True)
        self.slots[:bucket].copy_(torch.from_numpy(np.pad(slots, (0, pad), constant_values=-1)),
                                  non_blocking=True)
        if carry is not None:
            carry.apply(self.ids[:t])
        q, o = self.q[:t], self.o[:t]
        for i, kv in enumerate(self.kv_layers):
            pieces[i].replay()
            o.copy_(self.model.layers[i].attention(q, kv, meta, self.model.attn))
        pieces[-1].replay()
        return self.out[:t]
