"""Batched next-token sampling, on whatever device the logits live (CPU or GPU).

One call picks one token per row of a `[B, V]` logits tensor:

- Greedy rows (`SamplingParams.is_greedy`): argmax of the raw logits, so greedy output is exactly a
  reference argmax (first index on ties) and never touches a random generator.
- Random rows: logits / temperature, then top-k, top-p and min-p masks (one stable sort, shared by
  top-k and top-p; skipped when no row needs it), softmax, then the exponential race
  `argmax(probs / E)` with `E ~ Exp(1)` i.i.d. per token, which draws exactly from `probs`.
  A row whose request has a seed draws its noise from its own `torch.Generator` (see
  `make_generator`): the caller creates one per seeded request on the logits' device and keeps it
  across steps, so a seeded request gets the same tokens however it is batched. Other rows draw
  from the generator the `Sampler` owns.

Filters are applied in this order, each to what the previous one kept: top-k keeps exactly the k
highest logits (ties broken by lower token id); top-p keeps the smallest prefix of the sorted
distribution whose mass reaches top_p (the most likely token is always kept); min-p drops tokens
whose probability is below `min_p * p_max`.

Not done here, by design: stop strings / stop token ids, min_tokens (EOS suppression), ignore_eos,
max_tokens and `n` are the caller's business; it masks or forks before / after calling `sample`.
Logprobs are those of the raw logits (log-softmax before temperature and filtering), as vLLM
returns by default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rapidserve.sampling_params import SamplingParams

_UINT64_MASK = (1 << 64) - 1


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed` (any Python int; reduced modulo 2**64)."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed & _UINT64_MASK)
    return gen


def _to_device(values: list[float] | list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a tensor on `device`, copied asynchronously from pinned memory on CUDA."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


@dataclass(frozen=True)
class SamplingTensors:
    """One step's sampling parameters as device tensors, built once per step by `from_params`.

    The per-row tensors cover the whole batch (`[B]`); greedy rows hold neutral values
    (temperature 1, top_k = vocab size, top_p 1, min_p 0). The flags are computed over the random
    rows only, so work no row needs is skipped.
    """

    temperature: Tensor  # [B] float32
    top_p: Tensor  # [B] float32
    top_k: Tensor  # [B] int64, vocab_size where off
    min_p: Tensor  # [B] float32
    random_rows: tuple[int, ...]  # host indices of the rows that are sampled, not argmaxed
    random_idx: Tensor | None  # random_rows on the device; None when no row or every row is random
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    max_num_logprobs: int  # the largest `logprobs` asked for; -1 when no row asks

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def all_greedy(self) -> bool:
        return not self.random_rows

    @property
    def all_random(self) -> bool:
        return len(self.random_rows) == self.num_rows

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], vocab_size: int,
                    device: torch.device | str) -> SamplingTensors:
        device = torch.device(device)
        temps: list[float] = []
        top_ps: list[float] = []
        top_ks: list[int] = []
        min_ps: list[float] = []
        random_rows: list[int] = []
        do_top_k = do_top_p = do_min_p = False
        max_num_logprobs = -1
        for i, p in enumerate(params):
            if p.logprobs is not None:
                max_num_logprobs = max(max_num_logprobs, p.logprobs)
            if p.is_greedy:
                temps.append(1.0)
                top_ps.append(1.0)
                top_ks.append(vocab_size)
                min_ps.append(0.0)
                continue
            random_rows.append(i)
            k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
            temps.append(p.temperature)
            top_ps.append(p.top_p)
            top_ks.append(k)
            min_ps.append(p.min_p)
            do_top_k |= k < vocab_size
            do_top_p |= p.top_p < 1.0
            do_min_p |= p.min_p > 0.0
        floats = _to_device([*temps, *top_ps, *min_ps], torch.float32, device).view(3, len(params))
        partial = 0 < len(random_rows) < len(params)
        return cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2],
            top_k=_to_device(top_ks, torch.int64, device),
            random_rows=tuple(random_rows),
            random_idx=_to_device(random_rows, torch.int64, device) if partial else None,
            do_top_k=do_top_k, do_top_p=do_top_p, do_min_p=do_min_p,
            max_num_logprobs=max_num_logprobs,
        )


# One sampled row on the host (`SamplerOutput.rows`): the token id, its logprob, the top (id, logprob) pairs and the
# token's rank (the last three None where the row did not ask for logprobs; the top pairs where it asked for none)
SampledRow = tuple[int, float | None, list[tuple[int, float]] | None, int | None]


@dataclass(frozen=True)
class SamplerOutput:
    """What one `Sampler.sample` call picked.

    - token_ids: `[B]` int64.
    - logprobs: `[B]` float32 log-softmax of the raw logits at the chosen tokens; None when no row
      asked for logprobs (rows that did not ask get values too; the caller ignores them).
    - top_logprobs: `(values [B, k], token ids [B, k])`, sorted by value descending, for the
      largest k any row asked; None when that k is 0 or no row asked. A row that asked for fewer
      keeps the first ones.
    - ranks: `[B]` int64, the chosen token's rank among the vocabulary by those log-probabilities (1: the most
      likely; ties share the better rank), as vLLM's `Logprob.rank`; with `logprobs`.
    """

    token_ids: Tensor
    logprobs: Tensor | None = None
    top_logprobs: tuple[Tensor, Tensor] | None = None
    ranks: Tensor | None = None

    def to_host(self) -> SamplerOutput:
        """A host copy. On a GPU the copies are asynchronous into pinned memory: record an event after
        this call and wait for it before reading (the decode worker does, one step later)."""

        def cp(t: Tensor) -> Tensor:
            if t.device.type == "cpu":
                return t
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return h.copy_(t, non_blocking=True)

        top = None if self.top_logprobs is None else (cp(self.top_logprobs[0]), cp(self.top_logprobs[1]))
        return SamplerOutput(cp(self.token_ids), None if self.logprobs is None else cp(self.logprobs), top,
                             None if self.ranks is None else cp(self.ranks))

    def rows(self, params: list[SamplingParams]) -> list[SampledRow]:
        """Per row, on the host: (token id, its logprob if the row asked, the row's top (id, logprob) pairs
        if it asked for k > 0, the token's rank if the row asked). One device-to-host copy per tensor."""
        tokens = self.token_ids.tolist()
        lps = self.logprobs.tolist() if self.logprobs is not None else None
        ranks = self.ranks.tolist() if self.ranks is not None else None
        vals = ids = None
        if self.top_logprobs is not None:
            vals, ids = (t.tolist() for t in self.top_logprobs)
        out: list[SampledRow] = []
        for i, (tok, p) in enumerate(zip(tokens, params, strict=True)):
            asked = p.logprobs is not None
            lp = lps[i] if lps is not None and asked else None
            rank = ranks[i] if ranks is not None and asked else None
            top = None
            if vals is not None and ids is not None and p.logprobs:
                top = list(zip(ids[i][: p.logprobs], vals[i][: p.logprobs], strict=True))
            out.append((tok, lp, top, rank))
        return out


class Sampler:
    """Picks the next token of every row of a logits batch. Holds the generator of unseeded rows."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.generator = make_generator(seed, dev)

    def sample(self, logits: Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None],
               tensors: SamplingTensors | None = None, raw_logits: Tensor | None = None) -> SamplerOutput:
        """One token per row of `logits` `[B, V]` (any float dtype; not modified).

        `params[i]` and `generators[i]` belong to row i; `generators[i]` must be set (on the logits'
        device) for every random row whose request has a seed and is ignored on greedy rows, which
        never advance it. `tensors` may be passed when the caller built them already. `raw_logits`
        (same shape): where logprobs are taken from, when `logits` were processed (logit controls).
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab]; got shape {tuple(logits.shape)}")
        num_rows, vocab_size = logits.shape
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(f"got {num_rows} logits rows, {len(params)} params and "
                             f"{len(generators)} generators; they must match")
        if logits.device != self.device:
            raise ValueError(f"logits are on {logits.device} but this Sampler is on {self.device}")
        if num_rows == 0:
            return SamplerOutput(token_ids=torch.empty(0, dtype=torch.int64, device=logits.device))
        if tensors is None:
            tensors = SamplingTensors.from_params(params, vocab_size, logits.device)

        if tensors.all_random:
            token_ids = self._sample_random(logits, tensors, params, generators)
        else:
            token_ids = logits.argmax(dim=-1)
            if not tensors.all_greedy:
                assert tensors.random_idx is not None
                sampled = self._sample_random(logits, tensors, params, generators)
                token_ids.index_copy_(0, tensors.random_idx, sampled)

        if tensors.max_num_logprobs < 0:
            return SamplerOutput(token_ids=token_ids)
        logprobs_all = torch.log_softmax((logits if raw_logits is None else raw_logits).float(), dim=-1)
        chosen = logprobs_all.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        ranks = (logprobs_all > chosen.unsqueeze(1)).sum(dim=-1) + 1  # 1: nothing more likely
        top = None
        if tensors.max_num_logprobs > 0:
            k = min(tensors.max_num_logprobs, vocab_size)
            values, ids = logprobs_all.topk(k, dim=-1, sorted=True)
            top = (values, ids)
        return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_logprobs=top, ranks=ranks)

    def _sample_random(self, logits: Tensor, t: SamplingTensors, params: Sequence[SamplingParams],
                       generators: Sequence[torch.Generator | None]) -> Tensor:
        """Token ids `[R]` for the random rows, in `t.random_rows` order."""
        idx = t.random_idx
        if idx is None:
            x, temp, top_k, top_p, min_p = logits, t.temperature, t.top_k, t.top_p, t.min_p
        else:
            x = logits.index_select(0, idx)
            temp, top_k, top_p, min_p = (v.index_select(0, idx) for v in
                                         (t.temperature, t.top_k, t.top_p, t.min_p))
        x = x.float() / temp.unsqueeze(1)  # a new tensor: the caller's logits stay untouched
        mask = _filter_mask(x, top_k, top_p, min_p, t.do_top_k, t.do_top_p, t.do_min_p)
        if mask is not None:
            x.masked_fill_(mask, -math.inf)
        probs = torch.softmax(x, dim=-1)
        noise = self._exponential_noise(probs.shape, t.random_rows, params, generators)
        return probs.div_(noise).argmax(dim=-1)

    def _exponential_noise(self, shape: torch.Size, rows: Sequence[int], params: Sequence[SamplingParams],
                           generators: Sequence[torch.Generator | None]) -> Tensor:
        """Exp(1) noise `[R, V]`: seeded rows from their own generator, the rest from ours."""
        noise = torch.empty(shape, dtype=torch.float32, device=self.device)
        seeded: list[tuple[int, torch.Generator]] = []
        for j, row in enumerate(rows):
            gen = generators[row]
            if gen is not None:
                seeded.append((j, gen))
            elif params[row].seed is not None:
                raise ValueError(f"row {row} has seed={params[row].seed} but no generator; "
                                 "create one with make_generator(seed, device) and keep it per request")
        if len(seeded) < len(rows):
            noise.exponential_(generator=self.generator)
        for j, gen in seeded:
            noise[j].exponential_(generator=gen)
        # Exp(1) can return exactly 0; 0/0 would be NaN, which argmax prefers. tiny keeps p/E finite.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _filter_mask(x: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                 do_top_k: bool, do_top_p: bool, do_min_p: bool) -> Tensor | None:
    """True where a token is dropped, for temperature-scaled logits `x` `[R, V]`; None = keep all.

    min-p is applied in logit space: p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); top-k and
    top-p always keep the most likely token, so x_max is the same before and after them.
    """
    if not (do_top_k or do_top_p):
        if not do_min_p:
            return None
        return x < x.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)

    vocab_size = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    if do_top_k:
        positions = torch.arange(vocab_size, device=x.device)
        sorted_mask = positions.unsqueeze(0) >= top_k.unsqueeze(1)
    else:
        sorted_mask = torch.zeros_like(sorted_x, dtype=torch.bool)
    if do_top_p:
        probs = torch.softmax(sorted_x.masked_fill(sorted_mask, -math.inf), dim=-1)
        mass_before = probs.cumsum(dim=-1).sub_(probs)
        # Rows with top_p == 1 are left alone: rounding in the cumsum must not cut their tail.
        sorted_mask |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        sorted_mask[:, 0] = False  # kept whatever top_p is: one below float32's range reads as 0
    if do_min_p:
        sorted_mask |= sorted_x < sorted_x[:, :1] + min_p.log().unsqueeze(1)
    return torch.empty_like(sorted_mask).scatter_(1, order, sorted_mask)


def token_seed(seed: int, index: int) -> int:
    """The sampling seed of output token `index` of a seeded request: the same in every process
    and however the request is batched, preempted or split between prefill and decode workers."""
    return (seed * 1_000_003 + index * 7_919 + 1) % (1 << 63)


def token_generators(rows: list[tuple[int | None, int]], device: torch.device | str) -> list[torch.Generator | None]:
    """One generator per row of (request seed, output index); None for unseeded rows.

    Seeding per output token (`token_seed`) makes a seeded request's tokens independent of how it
    is batched, preempted, or split between the prefill and decode processes.
    """
    return [None if seed is None else make_generator(token_seed(seed, index), device) for seed, index in rows]
