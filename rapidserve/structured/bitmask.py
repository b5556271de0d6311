"""Applying a step's token bitmask to logits rows on the device (pure torch: CUDA, ROCm and CPU).

The bitmask is filled on the CPU (`matchers.GrammarBook.fill`): row r's int32 word w, bit b allows
token 32 * w + b. One flat host buffer holds the words of every masked row (`[R, W]`, contiguous, as
the grammar engine fills them), the logits row each belongs to (`[R]`) and two constant words (the
bytes 1, 2, 4, ..., 128, which unpack the bits), so a step's whole mask reaches the device in ONE small
copy (non-blocking, from pinned memory on a GPU) and needs nothing else there. The device compares
each byte with those bits (two kernels) and fills every token not allowed with -inf (one more); rows
without a grammar are untouched. When the masked rows are a contiguous run of logits rows (the usual
case: every request of the step has a constraint) the fill writes into them in place; otherwise it
goes through a gather and a scatter of those rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# The bytes 1, 2, 4, ..., 128 as two little-endian int32 words: byte k of the pair is 1 << k.
BIT_WORDS = (0x08040201, 0x80402010 - (1 << 32))


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def contiguous_start(rows: Sequence[int]) -> int | None:
    """`rows[0]` if `rows` is a run of consecutive logits rows (`a, a + 1, ...`), else None."""
    if not rows:
        return None
    start = rows[0]
    return start if list(rows) == list(range(start, start + len(rows))) else None


@dataclass(frozen=True)
class GrammarMask:
    """One step's bitmask: `words[i]` allow tokens of logits row `row_ids[i]`; both are views of `buf`.
    `row_start`: set when the row ids are known to be `row_start, row_start + 1, ...` (None: any rows)."""

    buf: torch.Tensor  # [R * W + R + 2] int32, host (pinned when bound for a GPU)
    num_rows: int
    num_words: int
    row_start: int | None = None

    @classmethod
    def new(cls, num_rows: int, vocab_size: int, pin: bool, fill: bool = True,
            rows: Sequence[int] | None = None) -> GrammarMask:
        """All tokens allowed (`fill=False`: uninitialised, for a caller that writes every row), for the
        logits rows `rows` (None: the caller writes `row_ids`). A fresh buffer per step: torch's pinned
        allocator hands it out again only once the copy that read it has completed."""
        w = bitmask_words(vocab_size)
        n = num_rows * w
        buf = torch.empty((n + num_rows + 2,), dtype=torch.int32, pin_memory=pin)
        if fill:
            buf[:n].fill_(-1)
        host = buf.numpy()
        host[n + num_rows :] = BIT_WORDS
        start = None
        if rows is not None:
            if len(rows) != num_rows:
                raise ValueError(f"{len(rows)} row ids for a mask of {num_rows} rows")
            host[n : n + num_rows] = rows
            start = contiguous_start(rows)
        return cls(buf, num_rows, w, start)

    @property
    def words(self) -> torch.Tensor:
        return self.buf[: self.num_rows * self.num_words].view(self.num_rows, self.num_words)

    @property
    def row_ids(self) -> torch.Tensor:
        """The logits row of each mask row. Write it only for a mask made without `rows` (`row_start`
        is then None); with `rows` it is set already, and `row_start` was derived from it."""
        n = self.num_rows * self.num_words
        return self.buf[n : n + self.num_rows]

    @property
    def rows(self) -> list[int]:
        return self.row_ids.tolist()

    def for_row(self, row: int) -> GrammarMask:
        """The mask of logits row `row` alone, as row 0 (to sample that row by itself)."""
        sel = (self.row_ids == row).nonzero().flatten().tolist()
        out = GrammarMask.new(len(sel), self.num_words * 32, pin=False, fill=False, rows=[0] * len(sel))
        if sel:
            out.words.copy_(self.words[sel])
        return out

    def allowed(self, i: int, vocab_size: int) -> list[int]:
        """Token ids allowed in mask row i (host; for checks and tests)."""
        bits = np.unpackbits(self.words[i].numpy().view(np.uint8), bitorder="little")[:vocab_size]
        return np.flatnonzero(bits).tolist()


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """Set logits `[B, V]` to -inf (in place) wherever the mask's rows forbid a token."""
    r, w = mask.num_rows, mask.num_words
    if r == 0:
        return
    vocab = logits.shape[-1]
    if w * 32 < vocab:
        raise ValueError(f"a bitmask of {w} words covers {w * 32} tokens but the logits have {vocab}: "
                         f"build it with GrammarMask.new(rows, {vocab}, pin)")
    buf = mask.buf.to(logits.device, non_blocking=True) if logits.device.type != "cpu" else mask.buf
    n = r * w
    # As bytes (little-endian words: byte k of word w holds tokens 32w + 8k ...), each compared with the
    # bits 1, 2, ..., 128 (the buffer's last two words): uint8 temporaries, a quarter of int32 ones.
    octets = buf[:n].view(torch.uint8).view(r, w * 4, 1)
    bits = buf[n + r :].view(torch.uint8)
    forbidden = (octets & bits).view(r, w * 32)[:, :vocab] == 0
    if mask.row_start is not None:  # a run of rows: filled in place
        logits[mask.row_start : mask.row_start + r].masked_fill_(forbidden, -math.inf)
        return
    rows = buf[n : n + r].long()
    sub = logits.index_select(0, rows)
    sub.masked_fill_(forbidden, -math.inf)
    logits.index_copy_(0, rows, sub)
