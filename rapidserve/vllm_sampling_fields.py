"""vLLM's `SamplingParams` fields beyond the sampling itself, as rapidserve takes them (vLLM 0.26's names).

Every field of vLLM's SamplingParams is one of `SamplingParams`' (sampling_params.py); the ones whose handling is not
sampling are described and checked here (`normalise`, then `validate`, from `SamplingParams.__post_init__`):
- honoured: `detokenize` (False: `LLM` returns the token ids with empty text; stop strings need the text, so they are
  refused with it, as vLLM refuses them), `skip_reading_prefix_cache` (True: the request's prompt is not looked up
  in the prefix cache, so it is computed whole; its blocks are still cached for later requests; None = False, as
  vLLM's default without prompt_logprobs);
- accepted with any valid value, changing nothing (`NO_EFFECT`): `output_kind`, `skip_clone`,
  `output_text_buffer_length`;
- accepted at the value that asks for nothing and refused otherwise, naming the field and why (`IDLE`; the reason is
  vllm_reasons.WHY's, the HTTP API's where it has the field): `prompt_logprobs`, `logprob_token_ids`,
  `flat_logprobs`, `spaces_between_special_tokens`, `extra_args`, `routed_experts_prompt_start`,
  `thinking_token_budget`, `repetition_detection`. Their idle forms are normalised to the default first (an empty
  list or dict to None, thinking_token_budget -1 to None, as vLLM reads them), so a struct always holds its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any

from msgspec.structs import force_setattr

from rapidserve.sampling_checks import SamplingParamsError, check, is_int, unsupported
from rapidserve.vllm_reasons import WHY


class RequestOutputKind(Enum):
    """vLLM's streaming hint: each output holds everything so far, only what is new, or only the final one. `LLM`
    returns finished outputs whatever it says (vLLM's LLM sets FINAL_ONLY on every request it adds)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# field -> (its default: the one value that asks for nothing once normalised; the values accepted, as a message
# says them; why any other is refused)
IDLE: MappingProxyType[str, tuple[object, str, str]] = MappingProxyType({
    "prompt_logprobs": (None, "None", WHY["prompt_logprobs"]),
    "logprob_token_ids": (None, "None or []", WHY["logprob_token_ids"]),
    "flat_logprobs": (False, "False", WHY["flat_logprobs"]),
    "spaces_between_special_tokens": (True, "True", WHY["spaces_between_special_tokens"]),
    "extra_args": (None, "None or {}", WHY["vllm_xargs"]),
    "routed_experts_prompt_start": (0, "0", WHY["routed_experts_prompt_start"]),
    "thinking_token_budget": (None, "None or -1 (no budget)", WHY["thinking_token_budget"]),
    "repetition_detection": (None, "None, {} or max_pattern_size 0 (off)", WHY["repetition_detection"]),
})
NO_EFFECT: MappingProxyType[str, str] = MappingProxyType({  # field -> why any valid value changes nothing
    "output_kind": "LLM returns each request's finished output, as vLLM's LLM does whatever it says; the HTTP API "
                   "streams by its stream field",
    "skip_clone": "a copy hint: rapidserve's SamplingParams are frozen and never copied per request",
    "output_text_buffer_length": "vLLM sets it itself (the characters its streamed text holds back while a stop "
                                 "string may still match); it is no input",
})
HONOURED = ("detokenize", "skip_reading_prefix_cache")


def _empty(v: object) -> bool:
    return isinstance(v, (list, tuple, dict)) and len(v) == 0


def _off(v: object) -> bool:
    """vLLM's repetition detection turned off: an empty mapping, or max_pattern_size 0 (in a mapping or object)."""
    size = v.get("max_pattern_size", 0) if isinstance(v, Mapping) else getattr(v, "max_pattern_size", None)
    return size == 0 and not isinstance(size, bool)


def normalise(p: Any) -> None:
    """Put the idle forms vLLM takes into the one default each field keeps (before `validate`). `p`: a
    SamplingParams (not imported: it imports this module)."""
    if p.logprob_token_ids is not None:
        force_setattr(p, "logprob_token_ids", None if _empty(p.logprob_token_ids) else tuple(p.logprob_token_ids))
    if _empty(p.extra_args):
        force_setattr(p, "extra_args", None)
    if is_int(p.thinking_token_budget) and p.thinking_token_budget == -1:
        force_setattr(p, "thinking_token_budget", None)
    if p.repetition_detection is not None and _off(p.repetition_detection):
        force_setattr(p, "repetition_detection", None)
    if is_int(p.output_kind) and p.output_kind in (k.value for k in RequestOutputKind):
        force_setattr(p, "output_kind", RequestOutputKind(p.output_kind))


def _same(v: object, default: object) -> bool:
    return type(v) is type(default) and v == default


def validate(p: Any) -> None:
    """Raise `SamplingParamsError` naming the first of these fields that is invalid or asks for what is not served."""
    for name in ("detokenize", "skip_clone"):
        v = getattr(p, name)
        check(isinstance(v, bool), f"{name}={v!r} must be a bool")
    check(p.skip_reading_prefix_cache is None or isinstance(p.skip_reading_prefix_cache, bool),
          f"skip_reading_prefix_cache={p.skip_reading_prefix_cache!r} must be None or a bool")
    check(isinstance(p.output_kind, RequestOutputKind),
          f"output_kind={p.output_kind!r} must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
    check(is_int(p.output_text_buffer_length) and p.output_text_buffer_length >= 0,
          f"output_text_buffer_length={p.output_text_buffer_length!r} must be an integer >= 0")
    for name, (default, allowed, why) in IDLE.items():
        v = getattr(p, name)
        if not _same(v, default):
            raise unsupported(name, v, allowed, why)
    if p.stop and not p.detokenize:
        raise SamplingParamsError(f"detokenize=False with stop={p.stop!r}: stop strings are matched on the text, which "
                                  "detokenize=False leaves unmade (vLLM refuses them together too); use stop_token_ids")
