"""Structured outputs: constraints compiled to grammars, one matcher per request, token bitmasks.

- `grammars`: a `StructuredOutputs` constraint -> grammar text for the grammar engine (llguidance,
  chosen by measurement: bench/results/grammar_engines.md), validated up front (`check`), and the
  bounded LRU of compiled grammars, which remembers failures as failures;
- `trial`: compiling a constraint against the model's tokenizer and trying its first steps (`build`),
  where the engine's lexer limits show; the server's verdicts (`GrammarTrials`);
- `matchers`: `GrammarBook`, a worker's matchers (one per request, kept in step with the request's
  known tokens by replaying them), filling a step's bitmask rows on the CPU;
- `bitmask`: applying a filled bitmask to logits rows on the device (pure torch: CUDA, ROCm, CPU).

Nothing here imports llguidance until a constraint is used, so free-text serving never needs it.
"""

from rapidserve.structured.bitmask import GrammarMask, apply_grammar_mask
from rapidserve.structured.grammars import GrammarCache, GrammarError, check, grammar_text
from rapidserve.structured.matchers import GrammarBook, GrammarRow
from rapidserve.structured.trial import GrammarTrials

__all__ = ["GrammarBook", "GrammarCache", "GrammarError", "GrammarMask", "GrammarRow", "GrammarTrials",
           "apply_grammar_mask", "check", "grammar_text"]
