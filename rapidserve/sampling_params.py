"""Per-request sampling parameters.

`SamplingParams` is a frozen `msgspec.Struct` so it can travel between processes inside msgspec
messages. Field names and defaults follow vLLM. It is validated on construction and again when
decoded (msgspec runs `__post_init__` on decode and wraps the error in `msgspec.ValidationError`,
itself a `ValueError`). Every error names the field, the value and what is allowed.

What is carried here but handled elsewhere:
- `n`: the scheduler forks `n` sequences; the sampler draws one token per row.
- `stop` strings are matched by the server on detokenized text; `stop_token_ids`, `ignore_eos`,
  `min_tokens` and `max_tokens` are applied by the caller of the sampler (EOS suppression included).
"""

from __future__ import annotations

import math

import msgspec
from msgspec.structs import force_setattr

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4
# Integer bounds: every field must survive msgpack between processes (int64 at most) and the
# device's int32 token/count tensors.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
# Temperatures below this are treated as greedy: dividing logits by them overflows float32.
GREEDY_TEMPERATURE_EPS = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; the message says which field and what is allowed."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise SamplingParamsError(msg)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the generated text, enforced by the grammar engine (vLLM's field names).

    Exactly one is set:
    - json: a JSON schema, as JSON text; the output is one JSON value that validates against it;
    - json_object: True = any JSON object;
    - regex: the whole output matches this regular expression;
    - choice: the output is exactly one of these strings;
    - grammar: an EBNF / Lark grammar (as the grammar engine reads it).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            force_setattr(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint is set: one of STRUCTURED_KINDS."""
        for name in STRUCTURED_KINDS:
            v = getattr(self, name)
            if v is not None and v is not False:
                return name
        raise SamplingParamsError("structured_outputs: no constraint set")

    def validate(self) -> None:
        set_ = [n for n in STRUCTURED_KINDS if getattr(self, n) is not None and getattr(self, n) is not False]
        _check(len(set_) == 1, f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                               f"got {set_ or 'none'}")
        _check(isinstance(self.json_object, bool),
               f"structured_outputs.json_object={self.json_object!r} must be a bool")
        for name in ("json", "regex", "grammar"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, str) and v.strip() != ""),
                   f"structured_outputs.{name} must be a non-empty string")
        _check(self.choice is None or (isinstance(self.choice, tuple) and len(self.choice) > 0
                                       and all(isinstance(c, str) and c for c in self.choice)),
               f"structured_outputs.choice={self.choice!r} must be a non-empty list of non-empty strings")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick the next tokens of one request.

    - temperature: 0 (or below 1e-5) = greedy; otherwise logits are divided by it.
    - top_k: keep the k most likely tokens; 0 or -1 = off.
    - top_p: keep the smallest set of most likely tokens whose probability sums to >= top_p; 1 = off.
    - min_p: drop tokens whose probability is below min_p * the most likely token's; 0 = off.
    - seed: when set, the request's tokens do not depend on what else is in the batch.
    - logprobs: None = none; 0 = logprob of the chosen token; k > 0 = chosen + the top k.
    - structured_outputs: a constraint on the output text (`StructuredOutputs`); None = free text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # Normalise what Python callers may pass loosely (lists, ints for floats, one stop string),
        # so the struct stays hashable and the types match what a decode would produce.
        if isinstance(self.stop, str):
            force_setattr(self, "stop", (self.stop,))
        for name in ("stop_token_ids", "stop"):
            v = getattr(self, name)
            if isinstance(v, list):
                force_setattr(self, name, tuple(v))
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if _is_int(v):
                force_setattr(self, name, float(v))
        self.validate()

    def validate(self) -> None:
        """Raise `SamplingParamsError` naming the first invalid field."""
        _check(_is_int(self.n) and self.n >= 1, f"n={self.n!r} must be an integer >= 1")
        _check(_is_real(self.temperature) and self.temperature >= 0.0,
               f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        _check(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0),
               f"top_k={self.top_k!r} must be -1 or an integer >= 0 (0 or -1 = off)")
        _check(_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p={self.min_p!r} must be in [0, 1] (0 = off)")
        _check(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
               f"seed={self.seed!r} must be None or an integer in [{SEED_MIN}, {SEED_MAX}] (int64)")
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            v = getattr(self, name)
            _check(v is None or not _is_int(v) or v <= INT32_MAX, f"{name}={v!r} must be at most {INT32_MAX}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens={self.max_tokens!r} must be an integer >= 1 or None")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               f"min_tokens={self.min_tokens!r} must be an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs={self.logprobs!r} must be None or an integer in [0, {MAX_LOGPROBS}]")
        _check(isinstance(self.stop_token_ids, tuple)
               and all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids),
               f"stop_token_ids={self.stop_token_ids!r} must be a sequence of integers in [0, {INT32_MAX}]")
        _check(isinstance(self.stop, tuple) and len(self.stop) <= MAX_STOP_STRINGS,
               f"stop={self.stop!r} may hold at most {MAX_STOP_STRINGS} strings")
        _check(all(isinstance(s, str) and s != "" for s in self.stop),
               f"stop={self.stop!r} must hold non-empty strings only")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos={self.ignore_eos!r} must be a bool")
        _check(isinstance(self.skip_special_tokens, bool),
               f"skip_special_tokens={self.skip_special_tokens!r} must be a bool")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax of the logits (temperature ~0 or top_k == 1)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def for_sample(self, j: int) -> SamplingParams:
        """The parameters of sample `j` of `n`, as one engine request: n=1, and a seeded request's
        sample j gets seed + j (so samples differ and each is reproducible). The one seed rule, for
        the server and `LLM` alike."""
        if self.n == 1 and j == 0:
            return self
        return msgspec.structs.replace(self, n=1, seed=None if self.seed is None else self.seed + j)

    def replace(self, **kw: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return msgspec.structs.replace(self, **kw)
