"""The runner's sampling entry points, and the bookkeeping of the penalty / bad-word token slots.

`sample` samples logits as they are; `sample_next` first applies what a request asks of its next token
(early-stop bans below `min_tokens`, the structured-output mask, logit controls: penalties, logit_bias, bad
words, allowed_token_ids) and then samples with the request's seeded generator. The tokens sampled for rows
with logit controls are added to their slots in `tokens` (a `TokenState`, rapidserve/logit_controls.py) at
once, or by `record_sampled()` once the caller's step is wholly queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from rapidserve.logit_controls import ControlPlan, HistoryOf, TokenState, apply_controls, plan_controls, record_tokens
from rapidserve.runner.inputs import BatchInputs
from rapidserve.sampler import Sampler, SamplerOutput, token_generators
from rapidserve.sampling_params import SamplingParams
from rapidserve.stop_rules import early_stop_bans
from rapidserve.structured import GrammarMask, apply_grammar_mask


class Sampling(BatchInputs):
    """Sampling (a part of ModelRunner)."""

    sampler: Sampler
    tokens: TokenState  # penalty / bad-word slots (logit_controls.py), owned by the worker
    _unrecorded: tuple[torch.Tensor, ControlPlan] | None  # sample_next(record=False)'s tokens

    if TYPE_CHECKING:  # tensor parallelism's broadcast of the sampled tokens (tp.py)
        def _shared(self, out: SamplerOutput, share: bool) -> SamplerOutput: ...

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

    def record_sampled(self) -> None:
        """Add the tokens of the last `sample_next(record=False)` to their slots (nothing if it had none)."""
        pending, self._unrecorded = self._unrecorded, None
        if pending is not None:
            with torch.inference_mode():  # the slots were made there (inside sample_next)
                record_tokens(pending[0], pending[1], self.tokens)
