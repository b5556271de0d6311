"""Logit controls on the device: penalties, logit_bias, bad words, allowed_token_ids (vLLM's semantics).

`ModelRunner.sample_next` takes this path only when some row of the batch has a control on
(`SamplingParams.has_logit_controls`); a batch without one is sampled exactly as before, at no cost.
The controls are applied to a float32 copy of the logits, in vLLM's order:
1. allowed_token_ids: every other id gets -inf;
2. bad words: the last token of a bad word gets -inf when the outputs so far end with the rest of it
   (one-token words: always), matched on the device against the request's recent outputs;
3. logit_bias: added;
4. repetition_penalty: for ids in the prompt or the outputs, a logit > 0 is divided by it, else multiplied;
5. frequency_penalty * count[id] and presence_penalty * (count[id] > 0) are subtracted, counts over
   the outputs.
Then greedy rows take the argmax and random rows are sampled (temperature, top-k/p, min-p) from the
result; logprobs are those of the logits before the controls (vLLM's raw logprobs).

Token history on the device (`TokenState`, one per worker process, in its runner): requests whose
sampling reads their earlier tokens (penalties, bad words of more than one token) hold a SLOT:
- `counts[slot, id]` (int32): how often `id` is among the outputs;
- `prompt[slot, id]` (bool): whether `id` is in the prompt;
- `recent[slot, k % HISTORY]` (int64): output k, for the last HISTORY outputs (-1: none yet).
A slot is keyed by (request id, attempt): the attempt changes when a request is preempted, so the
slot of a preempted request is never reused by it. It is taken at the request's first sample under
that key and filled from the prompt and outputs the host knows then (every engine samples a
request's first token after (re)admission from host-known tokens only: nothing of it is in flight).
After every step that samples it, the sampled tokens are added to its slot ON THE DEVICE (a scatter,
`record_tokens`, queued once the step is wholly queued: `ModelRunner.record_sampled` in the decode worker
and `LLM`'s engine, so a step that fails after sampling, or a row-by-row retry, counts nothing), so a step
launched before the previous step's tokens reach the host (the one step loop's one-step-ahead scheduling)
reads counts that include them.
Owner and freeing: the worker that samples the request; it calls `retain(live keys)` after recording
a step, which frees the slots of every request that finished, was aborted, failed or was preempted
(its key is no longer live). A freed slot is refilled by its next user with work queued on the same
stream after everything earlier, so a late scatter of a step still in flight cannot leak into it.
The prefill worker takes slots for the first token only and frees them right after sampling.
Memory: slots grow by doubling, vocab * 5 bytes + HISTORY * 8 each, only while some request uses them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rapidserve.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams

HISTORY = MAX_BAD_WORD_TOKENS  # recent outputs kept per slot: a bad word's prefix is at most this long


@dataclass(frozen=True)
class TokenHistory:
    """What a request has: its slot key (request id, attempt) and its host-known tokens, to fill a new slot."""

    key: Hashable
    prompt: Sequence[int]
    outputs: Sequence[int]


HistoryOf = Callable[[int], TokenHistory]  # batch row -> its request's history (called only for rows that need one)


def _dev(values: list[int] | list[float] | np.ndarray, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a tensor on `device`, copied asynchronously from pinned memory on CUDA."""
    t = torch.as_tensor(np.asarray(values), dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class TokenState:
    """The per-process slots (module docstring): token counts, prompt masks and recent outputs."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.vocab = 0
        self.capacity = 0
        self.counts = torch.zeros(0, 0, dtype=torch.int32)
        self.prompt = torch.zeros(0, 0, dtype=torch.bool)
        self.recent = torch.zeros(0, HISTORY, dtype=torch.int64)
        self._slots: dict[Hashable, int] = {}
        self._free: list[int] = []

    @property
    def in_use(self) -> int:
        return len(self._slots)

    def slot(self, h: TokenHistory, vocab: int) -> int:
        """The slot of `h.key`, taken and filled from `h`'s tokens if it has none yet."""
        s = self._slots.get(h.key)
        if s is not None:
            return s
        if -1 in h.outputs:
            raise ValueError(f"request {h.key!r}: its outputs hold a token still in flight; a slot is filled only "
                             "from tokens the host knows (the engine samples a request's first token after "
                             "(re)admission from known tokens)")
        if vocab != self.vocab:
            if self._slots:
                raise ValueError(f"logits of width {vocab} but the token state holds slots of width {self.vocab}")
            self.vocab, self.capacity, self._free = vocab, 0, []
        if not self._free:
            self._grow()
        s = self._free.pop()
        self._fill(s, h)
        self._slots[h.key] = s
        return s

    def retain(self, live: Iterable[Hashable]) -> None:
        """Free the slots of every key not in `live` (requests that ended or were preempted)."""
        keep = set(live)
        for key in [k for k in self._slots if k not in keep]:
            self._free.append(self._slots.pop(key))

    def _grow(self) -> None:
        old = self.capacity
        cap = max(4, 2 * old)
        dev = self.device
        counts = torch.zeros(cap, self.vocab, dtype=torch.int32, device=dev)
        prompt = torch.zeros(cap, self.vocab, dtype=torch.bool, device=dev)
        recent = torch.full((cap, HISTORY), -1, dtype=torch.int64, device=dev)
        if old and self.counts.shape[1] == self.vocab:
            counts[:old].copy_(self.counts)
            prompt[:old].copy_(self.prompt)
            recent[:old].copy_(self.recent)
            if dev.type == "cuda":  # the old tensors are read by the copies just queued on this stream
                cur = torch.cuda.current_stream(dev)
                for t in (self.counts, self.prompt, self.recent):
                    t.record_stream(cur)
        self.counts, self.prompt, self.recent = counts, prompt, recent
        self._free = list(range(cap - 1, old - 1, -1)) + self._free
        self.capacity = cap

    def _fill(self, s: int, h: TokenHistory) -> None:
        """Queue the slot's contents from the host-known tokens (after anything queued before on this stream)."""
        self.counts[s].zero_()
        self.prompt[s].zero_()
        self.recent[s].fill_(-1)
        prompt = [t for t in h.prompt if 0 <= t < self.vocab]
        if prompt:
            self.prompt[s].index_fill_(0, _dev(prompt, torch.int64, self.device), True)
        outs = [t for t in h.outputs if 0 <= t < self.vocab]
        if outs:
            ids = _dev(outs, torch.int64, self.device)
            self.counts[s].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        k0 = max(0, len(h.outputs) - HISTORY)
        if len(h.outputs) > k0:
            pos = [k % HISTORY for k in range(k0, len(h.outputs))]
            self.recent[s].index_copy_(0, _dev(pos, torch.int64, self.device),
                                       _dev(list(h.outputs[k0:]), torch.int64, self.device))


@dataclass
class ControlPlan:
    """One step's controls as host arrays, then device tensors (built by `plan_controls`)."""

    allowed_rows: list[int]
    allowed: tuple[list[int], list[int]]  # (row among allowed_rows, id)
    bans: tuple[list[int], list[int]]  # (row, id): one-token bad words
    words: list[tuple[int, int, tuple[int, ...], int]]  # (row, slot, bad word, output index k) to match on device
    bias: tuple[list[int], list[int], list[float]]  # (row, id, bias)
    pen_rows: list[int]
    pen_slots: list[int]
    pen: tuple[list[float], list[float], list[float]]  # repetition, frequency, presence per pen row
    rec_rows: list[int]  # rows whose sampled token is added to their slot
    rec_slots: list[int]
    rec_pos: list[int]  # k % HISTORY


def plan_controls(params: Sequence[SamplingParams], output_index: Sequence[int], history: HistoryOf | None,
                  state: TokenState, vocab: int) -> ControlPlan:
    """The host side of one step's controls; slots are taken (and filled) for rows that need one."""
    p = ControlPlan([], ([], []), ([], []), [], ([], [], []), [], [], ([], [], []), [], [], [])
    for i, (sp, k) in enumerate(zip(params, output_index, strict=True)):
        if not sp.has_logit_controls:
            continue
        slot = None
        if sp.needs_token_history:
            if history is None:
                raise ValueError("a row with penalties or multi-token bad words needs its request's token history: "
                                 "pass `history` to sample_next")
            slot = state.slot(history(i), vocab)
            p.rec_rows.append(i)
            p.rec_slots.append(slot)
            p.rec_pos.append(k % HISTORY)
        if sp.allowed_token_ids is not None:
            r = len(p.allowed_rows)
            p.allowed_rows.append(i)
            ids = [t for t in sp.allowed_token_ids if t < vocab]
            p.allowed[0].extend([r] * len(ids))
            p.allowed[1].extend(ids)
        for w in sp.bad_words_token_ids:
            if w[-1] >= vocab:
                continue
            if len(w) == 1:
                p.bans[0].append(i)
                p.bans[1].append(w[0])
            elif len(w) - 1 <= k:  # the prefix must lie within the outputs (vLLM matches outputs only)
                assert slot is not None
                p.words.append((i, slot, w, k))
        for t, b in sp.logit_bias:
            if t < vocab:
                p.bias[0].append(i)
                p.bias[1].append(t)
                p.bias[2].append(b)
        if sp.has_penalties:
            assert slot is not None
            p.pen_rows.append(i)
            p.pen_slots.append(slot)
            p.pen[0].append(sp.repetition_penalty)
            p.pen[1].append(sp.frequency_penalty)
            p.pen[2].append(sp.presence_penalty)
    return p


def apply_controls(logits: Tensor, plan: ControlPlan, state: TokenState) -> Tensor:
    """A float32 copy of `logits` [B, V] with the plan's controls applied (module docstring's order)."""
    dev = logits.device
    x = logits.float().clone()
    vocab = x.shape[1]
    if plan.allowed_rows:
        rows = _dev(plan.allowed_rows, torch.int64, dev)
        block = torch.ones(len(plan.allowed_rows), vocab, dtype=torch.bool, device=dev)
        block[_dev(plan.allowed[0], torch.int64, dev), _dev(plan.allowed[1], torch.int64, dev)] = False
        x.index_copy_(0, rows, x.index_select(0, rows).masked_fill_(block, -math.inf))
    if plan.bans[0]:
        x[_dev(plan.bans[0], torch.int64, dev), _dev(plan.bans[1], torch.int64, dev)] = -math.inf
    if plan.words:
        _ban_matched_words(x, plan.words, state)
    if plan.bias[0]:
        x.index_put_((_dev(plan.bias[0], torch.int64, dev), _dev(plan.bias[1], torch.int64, dev)),
                      _dev(plan.bias[2], torch.float32, dev), accumulate=True)
    if plan.pen_rows:
        rows = _dev(plan.pen_rows, torch.int64, dev)
        slots = _dev(plan.pen_slots, torch.int64, dev)
        rep, freq, pres = (_dev(v, torch.float32, dev).unsqueeze(1) for v in plan.pen)
        counts = state.counts.index_select(0, slots).float()
        seen_out = counts > 0
        y = x.index_select(0, rows)
        if any(r != 1.0 for r in plan.pen[0]):
            seen = state.prompt.index_select(0, slots) | seen_out
            y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
        y = y - freq * counts - pres * seen_out.float()
        x.index_copy_(0, rows, y)
    return x


def _ban_matched_words(x: Tensor, words: list[tuple[int, int, tuple[int, ...], int]], state: TokenState) -> None:
    """-inf at each word's last token where the slot's recent outputs end with the word's prefix; matched on
    the device (the newest outputs may still be in flight), without a host sync."""
    dev = x.device
    width = max(len(w) - 1 for _, _, w, _ in words)
    n = len(words)
    pos = np.zeros((n, width), dtype=np.int64)
    want = np.full((n, width), -1, dtype=np.int64)
    pad = np.ones((n, width), dtype=bool)
    for j, (_, _, w, k) in enumerate(words):
        m = len(w) - 1
        pos[j, :m] = [(k - m + q) % HISTORY for q in range(m)]  # outputs k-m .. k-1
        want[j, :m] = w[:-1]
        pad[j, :m] = False
    slots = _dev([s for _, s, _, _ in words], torch.int64, dev)
    got = state.recent[slots.unsqueeze(1), _dev(pos, torch.int64, dev)]
    match = ((got == _dev(want, torch.int64, dev)) | _dev(pad, torch.bool, dev)).all(dim=1)
    add = torch.zeros(n, dtype=torch.float32, device=dev).masked_fill_(match, -math.inf)
    x.index_put_((_dev([r for r, _, _, _ in words], torch.int64, dev),
                  _dev([w[-1] for _, _, w, _ in words], torch.int64, dev)), add, accumulate=True)


def record_tokens(token_ids: Tensor, plan: ControlPlan, state: TokenState) -> None:
    """Add each history row's sampled token to its slot, on the device (queued right after sampling)."""
    if not plan.rec_rows:
        return
    dev = token_ids.device
    toks = token_ids.index_select(0, _dev(plan.rec_rows, torch.int64, dev))
    slots = _dev(plan.rec_slots, torch.int64, dev)
    state.counts.index_put_((slots, toks), torch.ones_like(toks, dtype=torch.int32), accumulate=True)
    state.recent.index_put_((slots, _dev(plan.rec_pos, torch.int64, dev)), toks)
