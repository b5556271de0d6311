"""Applying a step's token bitmask to logits rows on the device (pure torch: CUDA, ROCm and CPU).

The bitmask is filled on the CPU (`matchers.GrammarBook.fill`): row r's int32 word w, bit b allows
token 32 * w + b. One flat host buffer holds the words of every masked row (`[R, W]`, contiguous, as
the grammar engine fills them) followed by the logits row each belongs to (`[R]`), so a step's whole
mask reaches the device in ONE small copy (non-blocking, from pinned memory on a GPU). There the bits
are unpacked and every token not allowed gets -inf; rows without a grammar are untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for `vocab_size` tokens."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class GrammarMask:
    """One step's bitmask: `words[i]` allow tokens of logits row `row_ids[i]`; both are views of `buf`."""

    buf: torch.Tensor  # [R * W + R] int32, host (pinned when bound for a GPU)
    num_rows: int
    num_words: int

    @classmethod
    def new(cls, num_rows: int, vocab_size: int, pin: bool, fill: bool = True) -> GrammarMask:
        """All tokens allowed (`fill=False`: uninitialised, for a caller that writes every row). A
        fresh buffer per step: torch's pinned allocator hands it out again only once the copy that
        read it has completed."""
        w = bitmask_words(vocab_size)
        buf = torch.empty((num_rows * w + num_rows,), dtype=torch.int32, pin_memory=pin)
        if fill:
            buf.fill_(-1)
        return cls(buf, num_rows, w)

    @property
    def words(self) -> torch.Tensor:
        return self.buf[: self.num_rows * self.num_words].view(self.num_rows, self.num_words)

    @property
    def row_ids(self) -> torch.Tensor:
        return self.buf[self.num_rows * self.num_words :]

    @property
    def rows(self) -> list[int]:
        return self.row_ids.tolist()

    def for_row(self, row: int) -> GrammarMask:
        """The mask of logits row `row` alone, as row 0 (to sample that row by itself)."""
        sel = (self.row_ids == row).nonzero().flatten().tolist()
        out = GrammarMask(torch.zeros(len(sel) * (self.num_words + 1), dtype=torch.int32), len(sel), self.num_words)
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
    dev = logits.device
    buf = mask.buf.to(dev, non_blocking=True) if dev.type != "cpu" else mask.buf
    # As bytes (little-endian words: byte k of word w holds tokens 32w + 8k ...): the unpacked
    # temporary is uint8, a quarter of what unpacking int32 words would take.
    octets = buf[: r * w].view(torch.uint8).view(r, w * 4)
    rows = buf[r * w :].long()
    shifts = torch.arange(8, device=dev, dtype=torch.uint8)
    allowed = ((octets.unsqueeze(-1) >> shifts) & 1).view(r, w * 32)[:, :vocab].bool()
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, -math.inf)
    logits.index_copy_(0, rows, sub)
