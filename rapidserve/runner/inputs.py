"""The inputs of a forward: the items the engine schedules, and the flat token batch and attention metadata
built from them.

`PrefillItem` and `DecodeItem` are what the engine hands `ModelRunner.prefill` / `decode` (model_runner.py);
`Carry` feeds a step tokens still on the device. `BatchInputs`, one part of `ModelRunner`, turns items into
host arrays (numpy), and host arrays into device tensors and an `AttentionMetadata`:

- a prefill (`_prefill_arrays`): ids, positions, tables, slots, ctx, cu, want: the items' new tokens end to
  end (`cu`: where each item's rows start, cumulative), each token's position and cache slot, per item its
  block table (width rounded up to 16 entries) and context length after the step, and the items whose last
  row's logits are returned;
- a decode step (`_decode_arrays`): ids, pos, tables, ctx, slots: one row per item.

Under tensor parallelism these host arrays are what the leader publishes to its followers
(rapidserve/parallel/mirror.py), so every rank builds the same metadata from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rapidserve.attention import AttentionMetadata, split_decode_rows


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


class BatchInputs:
    """Items -> host arrays -> device tensors and attention metadata (a part of ModelRunner)."""

    device: torch.device
    block_size: int

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

    def _decode_arrays(self, items: Sequence[DecodeItem], width: int) -> tuple[np.ndarray, ...]:
        bs = self.block_size
        ids = np.array([it.token_id for it in items], dtype=np.int64)
        pos = np.array([it.position for it in items], dtype=np.int64)
        tables = self._table_array(items, width)
        slots = tables[np.arange(len(items)), pos // bs].astype(np.int64) * bs + pos % bs
        return ids, pos, tables, (pos + 1).astype(np.int32), slots

    def _table_array(self, items: Sequence[PrefillItem] | Sequence[DecodeItem], width: int) -> np.ndarray:
        out = np.zeros((len(items), width), dtype=np.int32)
        for i, it in enumerate(items):
            out[i, : len(it.block_table)] = it.block_table
        return out

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)
