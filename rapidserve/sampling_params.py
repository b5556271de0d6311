"""Per-request sampling parameters.

`SamplingParams` is a frozen `msgspec.Struct` so it can travel between processes inside msgspec
messages. Field names and defaults follow vLLM. It is validated on construction and again when
decoded (msgspec runs `__post_init__` on decode and wraps the error in `msgspec.ValidationError`,
itself a `ValueError`). Every error names the field, the value and what is allowed.

What is carried here but handled elsewhere:
- `n`: the scheduler forks `n` sequences; the sampler draws one token per row.
- `stop` strings are matched by the server on detokenized text; `stop_token_ids`, `ignore_eos`,
  `min_tokens` and `max_tokens` are applied by the caller of the sampler (EOS suppression included).
  `include_stop_str_in_output` is read only where text is made (the server, `LLM`): workers ignore it.
- the logit controls (`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`,
  `allowed_token_ids`, `bad_words_token_ids`) are applied on the device by `rapidserve/logit_controls.py`.
  `bad_words` (text) are tokenized where the tokenizer lives, the edge (the server, `LLM`), by
  `resolve_bad_words`, into `bad_words_token_ids`; workers have no tokenizer and read only the ids.
  Token ids are checked against the vocabulary at each edge (`prompt.PromptLimits.check_params`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any

import msgspec
from msgspec.structs import force_setattr

from rapidserve import vllm_sampling_fields as vllm_fields
from rapidserve.sampling_checks import SamplingParamsError, check, is_int, is_real, short
from rapidserve.structured_outputs import STRUCTURED_KINDS, StructuredOutputs, StructuredOutputsParams
from rapidserve.vllm_sampling_fields import RequestOutputKind

__all__ = ["STRUCTURED_KINDS", "RequestOutputKind", "SamplingParams", "SamplingParamsError", "StructuredOutputs",
           "StructuredOutputsParams", "resolve_bad_words"]

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4
# Integer bounds: every field must survive msgpack between processes (int64 at most) and the
# device's int32 token/count tensors.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
# Temperatures below this are treated as greedy: dividing logits by them overflows float32.
GREEDY_TEMPERATURE_EPS = 1e-5
# Logit controls (vLLM's / OpenAI's ranges). Bias values are clamped to +-MAX_LOGIT_BIAS, as vLLM does.
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 32768  # the request travels in one ring message between processes
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 32  # a bad word's token sequence; the device keeps this many recent outputs per request


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, dict=True,  # dict: cached properties
                     omit_defaults=True):  # a field at its default travels as nothing
    """How to pick the next tokens of one request.

    - temperature: 0 (or below 1e-5) = greedy; otherwise logits are divided by it.
    - top_k: keep the k most likely tokens; 0 or -1 = off.
    - top_p: keep the smallest set of most likely tokens whose probability sums to >= top_p; 1 = off.
    - min_p: drop tokens whose probability is below min_p * the most likely token's; 0 = off.
    - seed: when set, the request's tokens do not depend on what else is in the batch.
    - logprobs: None = none; 0 = logprob of the chosen token; k > 0 = chosen + the top k.
    - include_stop_str_in_output (vLLM's): the text keeps the stop string that ended it, and the text of
      the stop token (EOS or one of `stop_token_ids`) that ended it; False: both are left out.
    - structured_outputs: a constraint on the output text (`StructuredOutputs`); None = free text.
    - presence_penalty, frequency_penalty (OpenAI's): logit[t] -= presence * (count[t] > 0) +
      frequency * count[t], count over the OUTPUT tokens so far; in [-2, 2]; 0 = off.
    - repetition_penalty (vLLM's / HF's): for a token in the prompt or the outputs, a logit > 0 is
      divided by it, else multiplied; > 0; 1 = off.
    - logit_bias: (token id, bias) pairs added to the logits; a dict {id: bias} is accepted and
      normalised (ids sorted, biases clamped to [-100, 100], as vLLM does).
    - allowed_token_ids: only these ids may be sampled; None = all.
    - bad_words: words that must not be generated; `bad_words_token_ids` are their token sequences
      (each word tokenized with and without a leading space, `resolve_bad_words`): the last token of
      a sequence is banned when the outputs so far end with the rest of it (one-token words: always).
    Logprobs are those of the logits before these controls (vLLM's default, raw logprobs).

    Every other field of vLLM 0.26's SamplingParams is here too (vllm_sampling_fields.py says what each does):
    detokenize and skip_reading_prefix_cache are honoured; output_kind, skip_clone and output_text_buffer_length
    change nothing; prompt_logprobs, logprob_token_ids, flat_logprobs, spaces_between_special_tokens, extra_args,
    routed_experts_prompt_start, thinking_token_budget and repetition_detection are refused by name unless they
    ask for nothing. As vLLM does: None for stop, stop_token_ids, bad_words or logit_bias is none, seed -1 is
    None (unseeded), logprobs True is 1.
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
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's other fields (vllm_sampling_fields.py)
    detokenize: bool = True
    skip_reading_prefix_cache: bool | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    prompt_logprobs: int | None = None
    logprob_token_ids: tuple[int, ...] | None = None
    flat_logprobs: bool = False
    spaces_between_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None
    routed_experts_prompt_start: int = 0
    thinking_token_budget: int | None = None
    repetition_detection: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Normalise what Python callers may pass loosely (lists, ints for floats, one stop string, a
        # logit_bias dict), so the struct stays hashable and the types match what a decode would produce.
        for name in ("stop", "stop_token_ids", "bad_words", "logit_bias"):  # vLLM's None: none
            if getattr(self, name) is None:
                force_setattr(self, name, ())
        if is_int(self.seed) and self.seed == -1:  # vLLM's: unseeded
            force_setattr(self, "seed", None)
        if self.logprobs is True:  # vLLM's: the chosen token's and the top one's
            force_setattr(self, "logprobs", 1)
        if isinstance(self.stop, str):
            force_setattr(self, "stop", (self.stop,))
        if isinstance(self.bad_words, str):
            force_setattr(self, "bad_words", (self.bad_words,))
        for name in ("stop_token_ids", "stop", "allowed_token_ids", "bad_words"):
            v = getattr(self, name)
            if isinstance(v, list):
                force_setattr(self, name, tuple(v))
        if isinstance(self.bad_words_token_ids, list | tuple):
            force_setattr(self, "bad_words_token_ids", tuple(tuple(w) if isinstance(w, list | tuple) else w
                                                              for w in self.bad_words_token_ids))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if is_int(v):
                force_setattr(self, name, float(v))
        force_setattr(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        vllm_fields.normalise(self)
        self.validate()

    def validate(self) -> None:
        """Raise `SamplingParamsError` naming the first invalid field."""
        check(is_int(self.n) and self.n >= 1, f"n={self.n!r} must be an integer >= 1")
        check(is_real(self.temperature) and self.temperature >= 0.0,
               f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        check(is_real(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        check(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0),
               f"top_k={self.top_k!r} must be -1 or an integer >= 0 (0 or -1 = off)")
        check(is_real(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p={self.min_p!r} must be in [0, 1] (0 = off)")
        check(self.seed is None or (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
               f"seed={self.seed!r} must be None or an integer in [{SEED_MIN}, {SEED_MAX}] (int64)")
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            v = getattr(self, name)
            check(v is None or not is_int(v) or v <= INT32_MAX, f"{name}={v!r} must be at most {INT32_MAX}")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens={self.max_tokens!r} must be an integer >= 1 or None")
        check(is_int(self.min_tokens) and self.min_tokens >= 0,
               f"min_tokens={self.min_tokens!r} must be an integer >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs={self.logprobs!r} must be None or an integer in [0, {MAX_LOGPROBS}]")
        check(isinstance(self.stop_token_ids, tuple)
               and all(is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids),
               f"stop_token_ids={self.stop_token_ids!r} must be a sequence of integers in [0, {INT32_MAX}]")
        check(isinstance(self.stop, tuple) and len(self.stop) <= MAX_STOP_STRINGS,
               f"stop={self.stop!r} may hold at most {MAX_STOP_STRINGS} strings")
        check(all(isinstance(s, str) and s != "" for s in self.stop),
               f"stop={self.stop!r} must hold non-empty strings only")
        check(isinstance(self.ignore_eos, bool), f"ignore_eos={self.ignore_eos!r} must be a bool")
        check(isinstance(self.skip_special_tokens, bool),
               f"skip_special_tokens={self.skip_special_tokens!r} must be a bool")
        check(isinstance(self.include_stop_str_in_output, bool),
               f"include_stop_str_in_output={self.include_stop_str_in_output!r} must be a bool")
        self._validate_controls()
        vllm_fields.validate(self)

    def _validate_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(is_real(v) and -MAX_PENALTY <= v <= MAX_PENALTY,
                   f"{name}={v!r} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off)")
        check(is_real(self.repetition_penalty) and self.repetition_penalty > 0.0,
               f"repetition_penalty={self.repetition_penalty!r} must be a finite number > 0 (1 = off)")
        lb = self.logit_bias
        check(isinstance(lb, tuple) and len(lb) <= MAX_LOGIT_BIAS_ENTRIES
               and all(isinstance(e, tuple) and len(e) == 2 and _is_token_id(e[0]) and is_real(e[1]) for e in lb)
               and len({e[0] for e in lb}) == len(lb),
               f"logit_bias={short(lb)} must map at most {MAX_LOGIT_BIAS_ENTRIES} distinct token ids (integers in "
               f"[0, {INT32_MAX}]) to finite numbers (clamped to [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}])")
        a = self.allowed_token_ids
        check(a is None or (isinstance(a, tuple) and 0 < len(a) <= MAX_ALLOWED_TOKEN_IDS
                             and all(_is_token_id(t) for t in a)),
               f"allowed_token_ids={short(a)} must be None or a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} "
               f"token ids (integers in [0, {INT32_MAX}])")
        check(isinstance(self.bad_words, tuple) and len(self.bad_words) <= MAX_BAD_WORDS
               and all(isinstance(w, str) and w.strip() != "" for w in self.bad_words),
               f"bad_words={short(self.bad_words)} must be a list of at most {MAX_BAD_WORDS} non-blank strings")
        bw = self.bad_words_token_ids
        check(isinstance(bw, tuple) and len(bw) <= 2 * MAX_BAD_WORDS
               and all(isinstance(w, tuple) and 0 < len(w) <= MAX_BAD_WORD_TOKENS and all(_is_token_id(t) for t in w)
                       for w in bw),
               f"bad_words_token_ids={short(bw)} must be a list of at most {2 * MAX_BAD_WORDS} token sequences, each "
               f"of 1 to {MAX_BAD_WORD_TOKENS} token ids (a longer bad word cannot be banned: shorten it)")

    @cached_property
    def has_penalties(self) -> bool:
        """Whether a presence, frequency or repetition penalty is on (they need the request's token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @cached_property
    def has_logit_controls(self) -> bool:
        """Whether any logit control is on: without one, sampling takes the plain path (cached: this is
        asked for every row of every step)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids))

    @cached_property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens on the device (penalties, multi-token bad words)."""
        return self.has_penalties or any(len(w) > 1 for w in self.bad_words_token_ids)

    def token_ids_in_controls(self) -> list[tuple[str, int]]:
        """(field, token id) of every id the logit controls name, for the vocabulary check at the edges."""
        out = [("logit_bias", t) for t, _ in self.logit_bias]
        out += [("allowed_token_ids", t) for t in self.allowed_token_ids or ()]
        out += [("bad_words", t) for w in self.bad_words_token_ids for t in w]
        return out

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

    def clone(self) -> SamplingParams:
        """vLLM's copy for a request: this one itself, which is frozen (so `skip_clone` changes nothing)."""
        return self


def _is_token_id(v: object) -> bool:
    return is_int(v) and 0 <= v <= INT32_MAX  # type: ignore[operator]


def _normalise_logit_bias(v: object) -> object:
    """A dict {token id (int or decimal string, as OpenAI's JSON keys): bias} or pairs -> sorted (id, bias)
    pairs with biases clamped to [-100, 100]; anything else is left for `validate` to name."""
    items: object
    if isinstance(v, Mapping):
        items = list(v.items())
    elif isinstance(v, list | tuple):
        items = [tuple(e) if isinstance(e, list | tuple) else e for e in v]
    else:
        return v
    out = []
    for e in items:  # type: ignore[attr-defined]
        if not (isinstance(e, tuple) and len(e) == 2):
            return tuple(items)  # type: ignore[call-overload]
        k, b = e
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k)
        if is_real(b):
            b = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(b)))
        out.append((k, b))
    if all(is_int(k) for k, _ in out):
        out.sort(key=lambda e: e[0])
    return tuple(out)


def resolve_bad_words(params: SamplingParams, encode: Callable[[str], list[int]]) -> SamplingParams:
    """`params` with `bad_words` tokenized into `bad_words_token_ids` by `encode` (text -> ids, no special
    tokens), where a tokenizer lives (the server, `LLM`). Each word is tokenized as given (leading spaces
    stripped) and with one leading space; the second form is added too when it is a different token
    sequence of the same length (vLLM's rule: a word is banned at the start of the text and mid-text).
    Raises SamplingParamsError naming `bad_words` when a word tokenizes to more than MAX_BAD_WORD_TOKENS."""
    if not params.bad_words:
        return params
    seqs: list[tuple[int, ...]] = list(params.bad_words_token_ids)
    for word in params.bad_words:
        plain = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        for ids in (plain, spaced):
            check(0 < len(ids) <= MAX_BAD_WORD_TOKENS,
                   f"bad_words: {word!r} is {len(ids)} tokens; a bad word may be at most {MAX_BAD_WORD_TOKENS} tokens")
        seqs.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
    return params.replace(bad_words_token_ids=tuple(dict.fromkeys(seqs)))
